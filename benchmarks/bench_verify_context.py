"""What a verify row costs as the context grows (issue 31, part 3: a policy that knows the context).

One prefill of the longest context, then for each context length (longest first, the target's
cache trimmed down to it) a target forward of B rows (B = 1: a plain step) on top of the cached
rows, rolled back after each run, interleaved over B and best of ``--repeats``. Prints each
B-row forward's cost relative to a 1-row step at the same context, by the wall clock and by this
process's CPU time (steadier on a shared machine; run with OPENBLAS_NUM_THREADS=1).

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_verify_context.py --output benchmarks/results/verify_context.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import dflash_mlx
import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from dflash_mlx.default import default_pair


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[7936, 4096, 1024, 200])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)

    model, _ = dflash_mlx.load(*default_pair())
    target = model.target
    contexts = sorted(args.contexts, reverse=True)
    prompt = mx.array([(37 * i) % 40000 + 100 for i in range(contexts[0])], mx.int32)
    cache = target.make_cache()
    target.prefill(prompt, cache)
    mx.eval([c.state for c in cache])
    rows = []
    for context in contexts:
        trim_prompt_cache(cache, cache[0].offset - context)
        best: dict[tuple[int, str], float] = {}
        for r in range(args.repeats):
            for B in (args.blocks if r % 2 == 0 else list(reversed(args.blocks))):
                tokens = prompt[:B][None]
                wall, cpu = time.perf_counter(), time.process_time()
                logits, hidden = target(tokens, cache)
                mx.eval(logits, hidden)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                target.rollback(cache, B)
                for clock, seconds in (("wall", wall), ("cpu", cpu)):
                    best[B, clock] = min(best.get((B, clock), float("inf")), seconds)
        row = {"context": context}
        for clock in ("wall", "cpu"):
            one = best[1, clock]
            row[clock] = {"ms_1": round(1e3 * one, 2), **{f"x{B}": round(best[B, clock] / one, 3) for B in args.blocks}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.output:
        args.output.write_text(json.dumps({"blocks": args.blocks, "repeats": args.repeats, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
