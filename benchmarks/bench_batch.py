"""Concurrent requests at the API level: our batch engine, ours one at a time, mlx_lm batched.

    python benchmarks/bench_batch.py [--concurrency 1 2 4 8] [--max-tokens 96] [--block-size auto]

At each concurrency c, c requests (the first c MT-Bench questions, chat
template applied, greedy) arrive together and run to completion, on the
built-in pair (``dflash_mlx.default.default_pair``), for each system:

- ``batched``: the ``Engine`` with up to c rows (``--block-size``, default auto);
- ``serial``: our ``stream_generate``, one request after another (what
  ``dflash-mlx serve`` does today);
- ``mlx_lm``: mlx_lm's ``BatchGenerator`` decoding the same target plainly,
  batched (prefill and completion batches of c), same process, same BLAS;
- ``oracle`` (with ``--oracle N``): the batch engine with a drafter that runs
  its real forward but proposes the target's own greedy continuation, wrong at
  every N-th position: what the engine reaches when acceptance is high;
- with ``--also NAME=SPEC`` (repeatable): more batch engines in the same race, SPEC a
  block size or the JSON keyword arguments of ``make_batch_policy``, e.g.
  ``--also b1=1 --also bonus='{"optimism": 0.3}'``.

``--dataset gsm8k`` takes GSM8K questions instead of MT-Bench's.

The systems run interleaved step by step (one engine step, one serial step,
one mlx_lm step, round robin, each followed by synchronizing every stream), and each
has its own clock that advances only while it works: on a shared machine a busy
spell hits all three alike. Aggregate tokens/s is every generated token over
the system's clock at its last finish; latency is a request's clock time from
arrival to its last token (queueing included), p50 and p95. ``exact`` compares
each system's tokens with the serial run's (``stream_generate``, which the
tests hold to mlx_lm's greedy decoding; mlx_lm's batched decoding can differ
from it where batching changes rounding). The table goes to stdout, the details
(and the calibrated batch cost curve, which shows what limits the batch size)
to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import dflash_mlx
import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step, generation_stream

from dflash_mlx import DFlashModel, Engine, stream_generate
from dflash_mlx.benchmark import load_dataset
from dflash_mlx.costs import costs
from dflash_mlx.default import default_pair
from dflash_mlx.policy import make_policy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny import OracleDrafter  # noqa: E402


# Each system is a generator that does one unit of work per next() and yields
# (request index, token or None, finished) for what that unit produced.


def batched(model, prompts, eos, max_tokens, block_size, stats, oracle=None, refs=None, wrong_every=0):
    if block_size == "auto":  # the pair's calibration, also for the oracle's pair
        block_size = make_policy(model, "auto")
    if oracle is not None:
        model = DFlashModel(model.target, oracle)
    engine = Engine(model, block_size=block_size, max_rows=len(prompts))
    index = {engine.add(p, max_tokens=max_tokens, stop_tokens=eos): i for i, p in enumerate(prompts)}
    if oracle is not None:
        oracle.engine = engine
        oracle.refs = {uid: prompts[i] + refs[i] for uid, i in index.items()}
        oracle.wrong = dict.fromkeys(index, wrong_every)
    while not engine.idle:
        yield [(index[e.uid], None if e.finish_reason == "stop" else e.token, e.finish_reason is not None)
               for e in engine.step()]
    s = engine.stats
    stats.update(mean_rows=s.mean_rows, steps=s.steps, ragged_steps=s.ragged_steps, block_sizes=dict(s.block_sizes))


def serial(model, tokenizer, prompts, max_tokens, block_size, stats):
    for i, p in enumerate(prompts):
        for r in stream_generate(model, tokenizer, p, max_tokens, block_size=block_size):
            yield [(i, None if r.finish_reason == "stop" else r.token, r.finish_reason is not None)]


def plain_batched(model, prompts, eos, max_tokens, stats):
    c = len(prompts)
    gen = BatchGenerator(model.target.model, max_tokens=max_tokens, stop_tokens=[[t] for t in eos],
                         completion_batch_size=c, prefill_batch_size=c)
    index = {uid: i for i, uid in enumerate(gen.insert(prompts))}
    while True:
        prompt_responses, responses = gen.next()
        if not prompt_responses and not responses:
            break
        yield [(index[r.uid], None if r.finish_reason == "stop" else r.token, r.finish_reason is not None)
               for r in responses]
    gen.close()


def race(systems: dict, n: int) -> dict:
    """Advance every system one unit at a time, round robin, each on its own clock."""
    runs = {name: dict(clock=0.0, outputs=[[] for _ in range(n)], latency=[0.0] * n) for name in systems}
    active = dict(systems)
    while active:
        for name, gen in list(active.items()):
            run = runs[name]
            tic = time.perf_counter()
            try:
                produced = next(gen)
            except StopIteration:
                del active[name]
                continue
            # No system's pending work may run on another's clock (mlx_lm decodes on its own stream).
            mx.synchronize()
            mx.synchronize(generation_stream)
            run["clock"] += time.perf_counter() - tic
            for i, token, finished in produced:
                if token is not None:
                    run["outputs"][i].append(token)
                if finished:
                    run["latency"][i] = run["clock"]
    return runs


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--block-size", default="auto", help="the batch engine's block size: an integer or auto")
    p.add_argument("--serial-block-size", type=int, default=4, help="block size of the one-at-a-time runs")
    p.add_argument("--dataset", default="mt-bench", help="mt-bench, gsm8k or humaneval")
    p.add_argument("--also", action="append", default=[], metavar="NAME=SPEC",
                   help="another engine in the race: a block size or BlockPolicy's JSON kwargs (auto)")
    p.add_argument("--oracle", type=int, default=0, metavar="N",
                   help="also run the engine with an oracle drafter wrong at every N-th position (0: off)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "batch.json")
    args = p.parse_args()
    block_size = args.block_size if args.block_size == "auto" else int(args.block_size)

    model, tokenizer = dflash_mlx.load(*default_pair())
    eos = list(tokenizer.eos_token_ids)
    questions = load_dataset(args.dataset, max(args.concurrency))
    also = {name: spec for name, spec in (a.split("=", 1) for a in args.also)}
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    table = costs(model).ready(max(args.concurrency)) if block_size == "auto" else None
    # Warm-up: first calls pay for allocation and graph setup.
    race({"batched": batched(model, prompts[:2], eos, 8, block_size, {}),
          "mlx_lm": plain_batched(model, prompts[:2], eos, 8, {})}, 2)

    oracle, refs = None, None
    if args.oracle:
        oracle = OracleDrafter(model.drafter)
        refs = []  # mlx_lm's own greedy answers, one request at a time
        for prompt in prompts:
            refs.append([])
            for t, _ in generate_step(mx.array(prompt), model.target.model, max_tokens=args.max_tokens):
                refs[-1].append(int(t))
                if refs[-1][-1] in eos:
                    break
    results = []
    print(f"{'clients':>7} {'system':>8} {'tok/s':>7} {'p50 s':>7} {'p95 s':>7} {'rows/step':>9}  exact")
    for c in args.concurrency:
        ps, extras = prompts[:c], {name: {} for name in ("batched", "serial", "mlx_lm", "oracle", *also)}
        systems = {
            "batched": batched(model, ps, eos, args.max_tokens, block_size, extras["batched"]),
            "serial": serial(model, tokenizer, ps, args.max_tokens, args.serial_block_size, extras["serial"]),
            "mlx_lm": plain_batched(model, ps, eos, args.max_tokens, extras["mlx_lm"]),
        }
        for name, spec in also.items():
            spec_block = int(spec) if spec.isdigit() else make_policy(model, "auto", **json.loads(spec))
            systems[name] = batched(model, ps, eos, args.max_tokens, spec_block, extras[name])
        if oracle is not None:
            systems["oracle"] = batched(model, ps, eos, args.max_tokens, block_size, extras["oracle"],
                                        oracle, refs, args.oracle)
        runs = race(systems, c)
        for name, r in runs.items():
            tokens = sum(len(o) for o in r["outputs"])
            row = dict(clients=c, system=name, tokens_per_second=tokens / r["clock"],
                       p50=statistics.median(r["latency"]), p95=percentile(r["latency"], 0.95), tokens=tokens,
                       seconds=r["clock"], exact=r["outputs"] == runs["serial"]["outputs"], **extras[name])
            results.append(row)
            rows = f"{row['mean_rows']:.2f}" if "mean_rows" in row else "-"
            print(f"{c:>7} {name:>8} {row['tokens_per_second']:>7.2f} {row['p50']:>7.2f} {row['p95']:>7.2f} "
                  f"{rows:>9}  {row['exact']}", flush=True)
        tps = {r["system"]: r["tokens_per_second"] for r in results if r["clients"] == c}
        print(f"{c:>7} {'ratio':>8} batched/mlx_lm {tps['batched'] / tps['mlx_lm']:.2f}x, "
              f"batched/serial {tps['batched'] / tps['serial']:.2f}x"
              + (f", oracle/mlx_lm {tps['oracle'] / tps['mlx_lm']:.2f}x" if oracle else "")
              + "".join(f", {name}/mlx_lm {tps[name] / tps['mlx_lm']:.2f}x" for name in also), flush=True)
    report = dict(
        dataset=args.dataset, also=also,
        max_tokens=args.max_tokens, block_size=args.block_size, serial_block_size=args.serial_block_size,
        oracle_wrong_every=args.oracle,
        results=results, peak_memory_gb=mx.get_peak_memory() / 1e9,
        costs=None if table is None else {
            "rows": {r: {"verify": c.verify, "draft": c.draft} for r, c in table.rows.items()}, "per_key": table.per_key,
        },
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
