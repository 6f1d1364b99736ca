"""Concurrent requests at the API level: our batch engine, ours one at a time, mlx_lm batched.

    python benchmarks/bench_batch.py [--concurrency 1 2 4 8] [--max-tokens 96] [--block-size auto]

At each concurrency c, c requests (the first c MT-Bench questions, chat
template applied, greedy) arrive together and run to completion, on the
built-in pair (``dflash_mlx.default.default_pair``), once per system:

- ``batched``: ``BatchEngine`` with up to c rows (``--block-size``, default auto);
- ``serial``: our ``stream_generate``, one request after another (what
  ``dflash-mlx serve`` does today);
- ``mlx_lm``: mlx_lm's ``BatchGenerator`` decoding the same target plainly,
  batched (prefill and completion batches of c), same process, same BLAS.

Systems alternate order from one concurrency to the next. Aggregate tokens/s is
every generated token over the wall time from arrival to the last finish;
latency is each request's time from arrival to its last token (queueing
included), p50 and p95. ``exact`` compares each system's tokens with the serial
run's (``stream_generate``, which the tests hold to mlx_lm's greedy decoding;
mlx_lm's batched decoding may differ from it where batching changes rounding).
The table goes to stdout, the details (and the calibrated batch cost curve,
which says what limits the batch size) to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import dflash_mlx
import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from dflash_mlx import stream_generate
from dflash_mlx.batch import BatchEngine
from dflash_mlx.batch_adaptive import row_cost_curve
from dflash_mlx.benchmark import load_dataset
from dflash_mlx.default import default_pair


def run_batched(model, prompts, eos, max_tokens, block_size):
    engine = BatchEngine(model, block_size=block_size, completion_batch_size=len(prompts))
    tic = time.perf_counter()
    uids = [engine.add(p, max_tokens=max_tokens, stop_tokens=eos) for p in prompts]
    tokens, done = {u: [] for u in uids}, {}
    while not engine.idle:
        for e in engine.step():
            if e.finish_reason != "stop":
                tokens[e.uid].append(e.token)
            if e.finish_reason:
                done[e.uid] = time.perf_counter() - tic
    stats = engine.stats
    extra = {"mean_rows": stats.mean_rows, "steps": stats.steps, "ragged_steps": stats.ragged_steps,
             "block_sizes": dict(stats.block_sizes)}
    return [tokens[u] for u in uids], [done[u] for u in uids], extra


def run_serial(model, tokenizer, prompts, eos, max_tokens, block_size):
    tic = time.perf_counter()
    outputs, done = [], []
    for p in prompts:
        out = [r.token for r in stream_generate(model, tokenizer, p, max_tokens, block_size=block_size)
               if r.finish_reason != "stop"]
        outputs.append(out)
        done.append(time.perf_counter() - tic)
    return outputs, done, {}


def run_mlx_lm(model, prompts, eos, max_tokens):
    c = len(prompts)
    gen = BatchGenerator(model.target.model, max_tokens=max_tokens, stop_tokens=[[t] for t in eos],
                         completion_batch_size=c, prefill_batch_size=c)
    tic = time.perf_counter()
    uids = gen.insert(prompts)
    tokens, done = {u: [] for u in uids}, {}
    while responses := gen.next_generated():
        for r in responses:
            if r.finish_reason != "stop":
                tokens[r.uid].append(r.token)
            if r.finish_reason:
                done[r.uid] = time.perf_counter() - tic
    gen.close()
    return [tokens[u] for u in uids], [done[u] for u in uids], {}


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--block-size", default="auto", help="the batch engine's block size: an integer or auto")
    p.add_argument("--serial-block-size", type=int, default=4, help="block size of the one-at-a-time runs")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "batch.json")
    args = p.parse_args()
    block_size = args.block_size if args.block_size == "auto" else int(args.block_size)

    model, tokenizer = dflash_mlx.load(*default_pair())
    eos = list(tokenizer.eos_token_ids)
    questions = load_dataset("mt-bench", max(args.concurrency))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    curve = row_cost_curve(model) if block_size == "auto" else None
    # Warm-up: first calls pay for allocation and graph setup.
    run_batched(model, prompts[:2], eos, 8, block_size)
    run_mlx_lm(model, prompts[:2], eos, 8)

    systems = {
        "batched": lambda ps: run_batched(model, ps, eos, args.max_tokens, block_size),
        "serial": lambda ps: run_serial(model, tokenizer, ps, eos, args.max_tokens, args.serial_block_size),
        "mlx_lm": lambda ps: run_mlx_lm(model, ps, eos, args.max_tokens),
    }
    results = []
    print(f"{'clients':>7} {'system':>8} {'tok/s':>7} {'p50 s':>7} {'p95 s':>7} {'rows/step':>9}  exact")
    for i, c in enumerate(args.concurrency):
        order = list(systems) if i % 2 == 0 else list(reversed(systems))
        runs = {}
        for name in order:
            tic = time.perf_counter()
            outputs, latency, extra = systems[name](prompts[:c])
            wall = time.perf_counter() - tic
            runs[name] = dict(outputs=outputs, latency=latency, wall=wall, extra=extra,
                              tokens=sum(len(o) for o in outputs))
        for name in systems:
            r = runs[name]
            exact = r["outputs"] == runs["serial"]["outputs"]
            row = dict(clients=c, system=name, tokens_per_second=r["tokens"] / r["wall"],
                       p50=statistics.median(r["latency"]), p95=percentile(r["latency"], 0.95),
                       tokens=r["tokens"], wall=r["wall"], exact=exact, **r["extra"])
            results.append(row)
            rows = f"{row['mean_rows']:.2f}" if "mean_rows" in row else "-"
            print(f"{c:>7} {name:>8} {row['tokens_per_second']:>7.2f} {row['p50']:>7.2f} {row['p95']:>7.2f} "
                  f"{rows:>9}  {exact}", flush=True)
        tps = {r["system"]: r["tokens_per_second"] for r in results if r["clients"] == c}
        print(f"{c:>7} {'ratio':>8} batched/mlx_lm {tps['batched'] / tps['mlx_lm']:.2f}x, "
              f"batched/serial {tps['batched'] / tps['serial']:.2f}x", flush=True)
    report = dict(
        max_tokens=args.max_tokens, block_size=args.block_size, serial_block_size=args.serial_block_size,
        results=results, peak_memory_gb=mx.get_peak_memory() / 1e9,
        cost_curve=None if curve is None else {
            rows: {"verify": c.verify, "draft": c.draft} for rows, c in curve.curves.items()
        },
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
