"""Sampled decoding side by side: mlx_lm and coupled sampling at several block sizes, in one process.

    python benchmarks/bench_sampling.py [--temp 0.7] [--top-p 1.0] [--num-prompts 4] [--max-tokens 96]
        [--seeds 0 1] [--system coupled:4 coupled:auto] [--output results.json]

Built-in pair, chat prompts of GSM8K, HumanEval and MT-Bench. Every system runs every (prompt,
seed) once, in an order rotated from prompt to prompt, so a busy spell of this shared machine falls
on all of them. A system is ``coupled:BLOCK`` (``sampling.Coupled``, the rule of DFlash drafters) at
a fixed block size or ``auto``; earlier runs against rejection sampling, which DFlash2 drafters keep,
are in benchmarks/results/README.md. Reported per dataset: tokens/s, speedup over mlx_lm's sampled decoding with the same
settings, and tau. Sampled outputs differ between systems (except coupled ones, which must agree
with each other: checked), so this measures speed only; exactness is the tests' job.
"""

from __future__ import annotations

import argparse
import json
import time

import dflash_mlx  # noqa: F401  (before mlx: it loads OpenBLAS)

from dflash_mlx import Engine, load
from dflash_mlx.benchmark import DATASETS, _chat, load_dataset, plain_run
from dflash_mlx.costs import costs
from dflash_mlx.default import default_pair
from dflash_mlx.sampling import SamplingParams
from side_by_side import rotated


def ours(model, prompt: list[int], params: SamplingParams, seed: int, max_tokens: int, rule: str, block: str):
    assert rule == "coupled", "DFlash drafters sample with the coupled rule"
    engine = Engine(model, block_size=block if block == "auto" else int(block), max_rows=1)
    engine.add(prompt, max_tokens=max_tokens, temp=params.temp, top_p=params.top_p, seed=seed)
    tokens, tic, stats = [], None, None
    while not engine.idle:
        for event in engine.step():
            tic = tic or time.perf_counter()
            tokens.append(event.token)
            stats = event.stats or stats
    return tokens, time.perf_counter() - tic, len(stats.acceptance_lengths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--temp", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--system", nargs="+", default=["coupled:4", "coupled:auto"])
    p.add_argument("--output", default=None)
    args = p.parse_args()
    model, tokenizer = load(*default_pair())
    costs(model)  # calibrate once, before any timing
    params = SamplingParams(args.temp, args.top_p)
    systems = ["mlx_lm", *args.system]
    results = {}
    for dataset in DATASETS:
        totals = {s: [0, 0.0, 0] for s in systems}  # tokens after the first, seconds, steps
        for i, text in enumerate(load_dataset(dataset, args.num_prompts)):
            prompt = _chat(tokenizer, text)
            for seed in args.seeds:
                texts = {}
                for system in rotated(systems, i):
                    if system == "mlx_lm":
                        run = plain_run(model.target.model, tokenizer, prompt, args.max_tokens, params.temp, seed,
                                        params.top_p)
                        tokens, seconds, steps = run.tokens, run.seconds, len(run.tokens) - 1
                    else:
                        tokens, seconds, steps = ours(model, prompt, params, seed, args.max_tokens, *system.split(":"))
                        texts[system] = tokens
                    for k, x in enumerate((len(tokens) - 1, seconds, steps)):
                        totals[system][k] += x
                coupled = [t for s, t in texts.items() if s.startswith("coupled")]
                assert all(t == coupled[0] for t in coupled), f"{dataset} prompt {i} seed {seed}: coupled runs differ"
        base = totals["mlx_lm"][0] / totals["mlx_lm"][1]
        results[dataset] = {s: {"tps": round(n / t, 2), "speedup": round(n / t / base, 3), "tau": round(n / max(k, 1), 2)}
                            for s, (n, t, k) in totals.items()}
        print(dataset, json.dumps(results[dataset]), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"temp": args.temp, "top_p": args.top_p, "num_prompts": args.num_prompts, "seeds": args.seeds,
                       "max_tokens": args.max_tokens, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
