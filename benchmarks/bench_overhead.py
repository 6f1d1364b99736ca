"""Per-step overhead of the draft-verify loop: what a step costs beyond the two forwards.

A drafter with random weights accepts (almost) nothing, so every step commits one token and the
loop's tokens/s against plain mlx_lm is pure cost: target verify of B rows + drafter forward + the
loop's own work (graph building, host syncs, sampling, cache bookkeeping). This script measures,
in one process and interleaved:

- plain mlx_lm decoding (ms per token) and a bare 1-row target forward: mlx_lm's own overhead;
- a bare B-row target forward and a bare drafter forward of B rows;
- the DFlash loop at block B with the random drafter (ms per step);

and reports overhead = loop step - verify(B) - draft(B). Each number is the best of --repeats
rounds (on a shared machine noise only ever adds time).

    python benchmarks/bench_overhead.py                  # the built-in SmolLM2 pair, random drafter weights
    python benchmarks/bench_overhead.py --block-size 4 8 --tokens 64 --repeats 5
"""

from __future__ import annotations

import argparse
import time

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx import DFlashModel, load, stream_generate
from dflash_mlx.default import default_pair
from dflash_mlx.drafter import Drafter
from dflash_mlx.kernels import get_ops

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--block-size", type=int, nargs="+", default=[4, 8])
    p.add_argument("--tokens", type=int, default=48, help="tokens per timed generation")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model_path, draft_path = (args.model, args.draft) if args.model else default_pair()
    pair, tokenizer = load(model_path, draft_path)
    mx.random.seed(0)
    random_drafter = Drafter(pair.drafter.args)  # same shape, random weights: tau ~ 1
    if pair.drafter.vocab_rows is not None:
        random_drafter.draft_vocab = pair.drafter.vocab_rows
    mx.eval(random_drafter.parameters())
    model = DFlashModel(pair.target, random_drafter)
    target, ops = model.target, get_ops()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    context = len(prompt) + args.tokens // 2  # the mean context of a timed generation

    def plain():
        for _ in zip(range(args.tokens), generate_step(mx.array(prompt), target.model, max_tokens=args.tokens)):
            pass

    def dflash(B):
        steps = 0
        for r in stream_generate(model, tokenizer, prompt, args.tokens, block_size=B):
            steps = len(r.stats.acceptance_lengths)
        return steps

    # Bare forwards at the mean context of a generation, on throw-away caches.
    tokens = mx.arange(context + 32, dtype=mx.int32) % target.vocab_size
    cache, draft_cache = target.make_cache(), random_drafter.make_cache()
    _, hidden = target.prefill(tokens[:context], cache)
    head = target.head(random_drafter.vocab_rows)
    random_drafter(target.embed(tokens[:2])[None], hidden[:, :-2], draft_cache, head, ops)
    mx.eval([c.state for c in cache])

    def verify(B):
        logits, h = target(tokens[context : context + B][None], cache)
        mx.eval(mx.argmax(logits, axis=-1), h)
        target.rollback(cache, B)

    def draft(B):
        logits = random_drafter(target.embed(tokens[context : context + B])[None], hidden[:, -2:], draft_cache, head, ops)
        mx.eval(mx.argmax(logits, axis=-1))
        for c in draft_cache:
            c.trim(2)

    plain()  # warm-up
    t_plain = best(plain, args.repeats) / args.tokens
    t_v1 = best(lambda: verify(1), args.repeats * 5)
    rows = [("mlx_lm", 1, t_plain, t_v1, 0.0, t_plain - t_v1, 1.0)]
    for B in args.block_size:
        steps = dflash(B)  # warm-up, and the step count (greedy: the same every run)
        t_loop = best(lambda: dflash(B), args.repeats)
        t_plain = min(t_plain, best(plain, 1) / args.tokens)  # interleaved baseline
        t_step = t_loop / steps
        t_v = best(lambda: verify(B), args.repeats * 5)
        t_d = best(lambda: draft(B), args.repeats * 5) if B > 1 else 0.0  # a plain step drafts nothing
        rows.append((f"DFlash B={B}", B, t_step, t_v, t_d, t_step - t_v - t_d, args.tokens / steps))
    print(f"context ~{context} tokens; {args.tokens} tokens per generation; best of {args.repeats}")
    print(f"{'loop':<14}{'ms/step':>9}{'verify ms':>11}{'draft ms':>10}{'overhead ms':>13}{'tau':>6}{'vs mlx_lm':>11}")
    for name, B, step, v, d, over, tau in rows:
        ratio = (tau / step) / (1 / t_plain)
        print(f"{name:<14}{1e3 * step:>9.1f}{1e3 * v:>11.1f}{1e3 * d:>10.1f}{1e3 * over:>13.1f}{tau:>6.2f}{ratio:>10.2f}x")


if __name__ == "__main__":
    main()
