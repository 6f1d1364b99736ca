"""One closed batch, this checkout against a previous release and plain batching, in one process.

    python benchmarks/bench_batch_release.py --baseline /tmp/previous [--dataset mt-bench] [--rows 8]
        [--max-tokens 64] [--rounds 4] [--out benchmarks/results/batch_release.json]

What ``bench_serve.py`` measures at c clients, without the servers: ``--rows`` chat prompts of one
dataset start together in ``batch_generate`` (greedy, end of text suppressed by a logit bias as the
serving bench does, so every row decodes ``--max-tokens`` and the batch ends when its slowest row
does) for ``this`` (block size auto), ``this:plain`` (block size 1) and ``previous`` (the release in
``--baseline``, imported as in ``bench_release.py``, block size auto). Each round runs every system
once, in an order rotated by round (more than 8 rows queue: ``batch_generate`` decodes 8 at a time,
and a waiting prompt takes each finished row's place); reported: each system's median seconds, its
speed against the previous release as the median of per-round ratios, its steps by block size, and
whether every output equals the previous release's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import dflash_mlx  # before mlx: it loads OpenBLAS
from bench_release import import_previous
from dflash_mlx.benchmark import _chat, load_dataset
from dflash_mlx.default import default_pair
from mlx_lm.sample_utils import make_logits_processors
from side_by_side import rotated


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="a checkout of the previous release")
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    previous = import_previous(args.baseline)
    pair = default_pair()
    model, tokenizer = dflash_mlx.load(*pair)
    old_model, old_tokenizer = previous.load(*pair)
    prompts = [_chat(tokenizer, q) for q in load_dataset(args.dataset, args.rows)]
    bias = make_logits_processors(logit_bias={tokenizer.eos_token_id: -100.0})
    systems = {"this": (dflash_mlx, model, tokenizer, "auto"), "this:plain": (dflash_mlx, model, tokenizer, 1),
               "previous": (previous, old_model, old_tokenizer, "auto")}

    def run(name: str, max_tokens: int):
        package, m, t, block_size = systems[name]
        tic = time.perf_counter()
        out = package.batch_generate(m, t, prompts, max_tokens=max_tokens, logits_processors=bias,
                                     block_size=block_size, return_token_ids=True)
        return time.perf_counter() - tic, out

    for name in systems:  # warm up: compile, and calibrate each policy at this row count
        run(name, 8)
    seconds, outputs = {name: [] for name in systems}, {}
    for round_ in range(args.rounds):
        for name in rotated(list(systems), round_):
            s, outputs[name] = run(name, args.max_tokens)
            seconds[name].append(s)
    results = []
    for name in systems:
        stats = outputs[name].stats
        ratio = statistics.median(b / a for a, b in zip(seconds[name], seconds["previous"]))
        results.append(dict(system=name, seconds=[round(s, 3) for s in seconds[name]],
                            median_seconds=statistics.median(seconds[name]), vs_previous=ratio, steps=stats.steps,
                            block_sizes=dict(sorted(stats.block_sizes.items())),
                            exact=outputs[name].texts == outputs["previous"].texts))
        print(f"{name:>10} {results[-1]['median_seconds']:7.2f} s  {ratio:.3f}x previous  steps {stats.steps}"
              f"  blocks {results[-1]['block_sizes']}  exact {results[-1]['exact']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(dataset=args.dataset, rows=args.rows, max_tokens=args.max_tokens,
                                            rounds=args.rounds, blas=dflash_mlx.BLAS, results=results), indent=1))


if __name__ == "__main__":
    main()
