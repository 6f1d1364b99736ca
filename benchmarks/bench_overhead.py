"""Per-step overhead of the draft-verify loop: what a step costs beyond the two forwards.

A drafter with random weights accepts (almost) nothing, so every step commits one token and the
loop's tokens/s against plain mlx_lm is pure cost: target verify of B rows + drafter forward + the
loop's own work (graph building, host syncs, sampling, cache bookkeeping). This script measures,
in one process and interleaved:

- plain mlx_lm decoding (``mlx_lm.stream_generate``, ms per token; detokenizing as ours does) and
  a bare 1-row target forward: mlx_lm's own overhead;
- a bare B-row target forward and a bare drafter forward of B rows;
- the DFlash loop at block B with the random drafter (ms per step);

and reports overhead = loop step - verify(B) - draft(B). Each number is the best of --repeats
rounds (on a shared machine noise only ever adds time), and the median of the rounds is shown
beside it. With block size 1 it also times plain steps that do not run ahead (each step's forward
built only after the host read the token before it), which is what running ahead saves.

``--tiny`` swaps in the tests' tiny random qwen3 target (a forward costs about a millisecond), so
that a step's time is almost all loop overhead, as it would be on a fast accelerator.

    python benchmarks/bench_overhead.py                  # the built-in SmolLM2 pair, random drafter weights
    python benchmarks/bench_overhead.py --block-size 4 8 --tokens 64 --repeats 5
    python benchmarks/bench_overhead.py --tiny --block-size 1 4 --tokens 200 --repeats 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

from dflash_mlx import DFlashModel, load, stream_generate
from dflash_mlx.policy import BlockPolicy
from dflash_mlx.models import Drafter
from dflash_mlx.kernels import get_ops
from side_by_side import pair_paths

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return times


def best(fn, repeats: int) -> float:
    return min(timed(fn, repeats))


def tiny_pair(folder: Path) -> tuple[str, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny import TARGETS, drafter_config, save_drafter, save_target

    return str(save_target(folder / "target", "qwen3")), str(save_drafter(folder / "draft", drafter_config(TARGETS["qwen3"])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--block-size", type=int, nargs="+", default=[4, 8])
    p.add_argument("--tokens", type=int, default=48, help="tokens per timed generation")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny random target: steps are all overhead")
    args = p.parse_args()
    if args.tiny:
        model_path, draft_path = tiny_pair(Path(tempfile.mkdtemp()))
    else:
        model_path, draft_path = pair_paths(args.model, args.draft)
    pair, tokenizer = load(model_path, draft_path)
    mx.random.seed(0)
    random_drafter = Drafter(pair.drafter.args)  # same shape, random weights: tau ~ 1
    if pair.drafter.vocab_rows is not None:
        random_drafter.draft_vocab = pair.drafter.vocab_rows
    mx.eval(random_drafter.parameters())
    model = DFlashModel(pair.target, random_drafter)
    target, ops = model.target, get_ops()
    if tokenizer.chat_template is not None:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    else:
        prompt = tokenizer.encode(PROMPT)
    context = len(prompt) + args.tokens // 2  # the mean context of a timed generation

    def plain():
        for _ in mlx_lm_stream_generate(target.model, tokenizer, prompt, max_tokens=args.tokens):
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
    random_drafter.absorb(hidden[:, :-2], draft_cache)
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

    def no_run_ahead():
        with mock.patch.object(BlockPolicy, "expects_plain", lambda self, rows, *a: False):
            return dflash(1)

    plain()  # warm-up
    plain_times = timed(plain, args.repeats)
    t_v1 = best(lambda: verify(1), args.repeats * 5)
    loops = [(f"DFlash B={B}", B, lambda B=B: dflash(B)) for B in args.block_size]
    if 1 in args.block_size:
        loops.insert(args.block_size.index(1) + 1, ("B=1 not ahead", 1, no_run_ahead))
    rows = []
    for name, B, run in loops:
        steps = run()  # warm-up, and the step count (greedy: the same every run)
        loop_times = timed(run, args.repeats)
        plain_times += timed(plain, 1)  # interleaved baseline
        t_v = best(lambda: verify(B), args.repeats * 5)
        t_d = best(lambda: draft(B), args.repeats * 5) if B > 1 else 0.0  # a plain step drafts nothing
        rows.append((name, [t / steps for t in loop_times], t_v, t_d, args.tokens / steps))
    rows.insert(0, ("mlx_lm", [t / args.tokens for t in plain_times], t_v1, 0.0, 1.0))
    t_plain = min(plain_times) / args.tokens
    print(f"context ~{context} tokens; {args.tokens} tokens per generation; best (median) of {args.repeats}")
    print(f"{'loop':<14}{'ms/step':>16}{'verify ms':>11}{'draft ms':>10}{'overhead ms':>13}{'tau':>6}{'vs mlx_lm':>11}")
    for name, steps, v, d, tau in rows:
        step, median = min(steps), statistics.median(steps)
        ratio = (tau / step) / (1 / t_plain)
        print(f"{name:<14}{1e3 * step:>8.2f} ({1e3 * median:5.2f}){1e3 * v:>11.2f}{1e3 * d:>10.2f}"
              f"{1e3 * (step - v - d):>13.2f}{tau:>6.2f}{ratio:>10.2f}x")


if __name__ == "__main__":
    main()
