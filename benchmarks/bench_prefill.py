"""Where our prefill's time goes, against mlx_lm's, on long prompts (issue 31, part 1).

For each prompt length, interleaved in one process (the order alternates per round), best of
``--repeats`` rounds (noise on a shared machine only ever slows a run down). The end-to-end
comparison (time to the first token of ``dflash_mlx.stream_generate`` and ``mlx_lm.stream_generate``)
is ``bench_long_context.py``'s prefill section; this script times the parts:

- ``target_taps``: ``Target.prefill`` alone (chunked forward with the hidden-state taps, the
  concatenation of the tapped rows, the last row's logits);
- ``target_plain``: the same chunked forward without taps, as mlx_lm runs it (its loop, rebuilt here
  on the same cache type so that only the taps differ);
- ``concat``: joining the tapped layers' rows and the chunks (``(1, P, 3H)``) from evaluated taps;
- ``draft_all``: the first draft after the prompt as it runs today: the drafter's fc, hidden_norm and
  every layer's k/v projections over all P prompt rows, then one block of 8;
- ``draft_window``: the same first draft given only the ``keep`` + ``recent`` rows a window keeps;
- ``copy_index``: the copy-proposal index over the prompt (built before the first token).

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_prefill.py --lengths 1024 2048 --output benchmarks/results/prefill_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dflash_mlx  # noqa: E402  (loads OpenBLAS before mlx.core)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench_long_context import build_prompts  # noqa: E402
from dflash_mlx import kernels  # noqa: E402
from dflash_mlx.default import default_pair  # noqa: E402
from dflash_mlx.copying import CopyIndex  # noqa: E402
from dflash_mlx.sampling import SamplingParams, make_strategy  # noqa: E402


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): on a machine shared with other jobs the CPU
    time, counted only while this process runs, is the steadier measure (run with
    OPENBLAS_NUM_THREADS=1 so that no thread spins waiting)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def target_taps(model, ids, step):
    cache = model.target.make_cache()
    logits, hidden = model.target.prefill(mx.array(ids), cache, step)
    mx.eval(logits, hidden)


def target_plain(model, ids, step):
    """mlx_lm's prefill loop: chunks of all but the last token, evaluating only the cache."""
    m = model.target.model
    cache = make_prompt_cache(m)
    prompt = mx.array(ids)
    while prompt.size > 1:
        n = min(step, prompt.size - 1)
        m(prompt[None, :n], cache=cache)
        mx.eval([c.state for c in cache])
        prompt = prompt[n:]
    mx.eval(m(prompt[None], cache=cache)[:, -1])


def prompt_hidden(model, ids, step) -> tuple[list, mx.array]:
    """The tapped rows of each chunk, evaluated, unjoined; and the joined (1, P, 3H)."""
    t = model.target
    cache = t.make_cache()
    pieces, prompt = [], mx.array(ids)
    while prompt.size > 0:
        n = min(step, prompt.size)
        with t._tapped() as sinks:
            t.model(prompt[None, :n], cache=cache)
        taps = [sinks[i][0] for i in t.layer_ids]
        mx.eval(taps, [c.state for c in cache])
        pieces.append(taps)
        prompt = prompt[n:]
    return pieces, mx.concatenate([mx.concatenate(p, axis=-1) for p in pieces], axis=1)


def first_draft(model, hidden, window):
    d, t = model.drafter, model.target
    if window is not None:
        keep, recent = window
        hidden = mx.concatenate([hidden[:, :keep], hidden[:, -recent:]], axis=1) if hidden.shape[1] > keep + recent else hidden
    cache = d.make_cache(window)  # timing only: the window's rows sit at the wrong RoPE positions here
    strategy = make_strategy(SamplingParams(0.0, 1.0, 0, 0.0), None, kernels.get_ops(), None)
    block = mx.concatenate([mx.array([1], mx.int32), mx.repeat(mx.array([d.args.mask_token_id], mx.int32), 7)])
    picks, _, _ = d.propose(t.embed(block)[None], block[:1], hidden, cache, t.head(d.vocab_rows), strategy)
    mx.eval(picks)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048], help="Prompt lengths of the target probes")
    p.add_argument("--draft-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 7936],
                   help="Context lengths of the drafter probes (random hidden states: only shapes matter)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step", type=int, default=2048, help="Prefill chunk (mlx_lm's prefill_step_size)")
    p.add_argument("--window", default="16:256")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    window = tuple(int(x) for x in args.window.split(":"))

    model, tokenizer = dflash_mlx.load(*default_pair())
    prompts = {p["length"]: p["ids"] for p in build_prompts(tokenizer, args.lengths) if p["kind"] == "docs"}
    report = {"window": list(window), "step": args.step, "repeats": args.repeats, "target": [], "drafter": []}

    def best_of(probes: dict) -> dict:
        best: dict[str, float] = {}
        for r in range(args.repeats):
            for name in (list(probes) if r % 2 == 0 else list(reversed(probes))):
                wall, cpu = timed(probes[name])
                best[name] = min(best.get(name, float("inf")), wall)
                best[f"{name}_cpu"] = min(best.get(f"{name}_cpu", float("inf")), cpu)
        return {k: round(v, 4) for k, v in best.items()}

    for length, ids in prompts.items():
        pieces, _ = prompt_hidden(model, ids, args.step)
        row = {"tokens": len(ids), **best_of({
            "target_taps": lambda: target_taps(model, ids, args.step),
            "target_plain": lambda: target_plain(model, ids, args.step),
            "concat": lambda: mx.eval(mx.concatenate([mx.concatenate(p, axis=-1) for p in pieces], axis=1)),
            "copy_index": lambda: CopyIndex(ids, model.drafter.corpus),
        })}
        row["taps_over_plain"] = round(row["target_taps"] / row["target_plain"], 3)
        row["taps_over_plain_cpu"] = round(row["target_taps_cpu"] / row["target_plain_cpu"], 3)
        report["target"].append(row)
        print(json.dumps(row), flush=True)
    width = len(model.target.layer_ids) * model.target.hidden_size
    for length in args.draft_lengths:
        hidden = mx.random.normal((1, length, width))
        mx.eval(hidden)
        row = {"tokens": length, **best_of({
            "draft_all": lambda: first_draft(model, hidden, None),
            "draft_window": lambda: first_draft(model, hidden, window),
        })}
        report["drafter"].append(row)
        print(json.dumps(row), flush=True)
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
