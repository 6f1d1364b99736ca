"""The drafter's corpus, side by side in one process: mlx_lm, DFlash without the corpus, and
DFlash with corpus copies from a given shortest match.

    python benchmarks/bench_corpus.py [--min-match 4 6] [--num-prompts 5] [--out FILE]

Built-in pair, block size auto, greedy, 128 tokens, the three benchmark datasets. For every
prompt each system runs once, in an order rotated from prompt to prompt, so a busy spell of this
shared machine falls on all of them; every output is checked against mlx_lm's. Speedups are
tokens/s over mlx_lm's in the same run.
"""

from __future__ import annotations

import argparse
import json

import dflash_mlx  # before mlx: it loads OpenBLAS
from dflash_mlx import copying
from dflash_mlx.benchmark import DATASETS, _chat, _timed, load_dataset, plain_run
from dflash_mlx.default import default_pair
from dflash_mlx.generation import stream_generate

MAX_TOKENS = 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-match", type=int, nargs="+", default=[4, 6])
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model, tokenizer = dflash_mlx.load(*default_pair())
    tokens = model.drafter.corpus.tokens
    # A corpus index finds matches as long as its key at least (copying.corpus_index).
    corpora = {k: copying.CopyIndex(tokens, key_length=k) for k in args.min_match}
    systems = ["mlx_lm", "no corpus", *args.min_match]
    results = {}
    for dataset in DATASETS:
        totals = {s: {"tokens": 0, "seconds": 0.0, "steps": 0, "committed": 0, "corpus": 0} for s in systems}
        for i, text in enumerate(load_dataset(dataset, args.num_prompts)):
            prompt = _chat(tokenizer, text)
            outputs = {}
            for system in systems[i % len(systems):] + systems[: i % len(systems)]:
                t = totals[system]
                if system == "mlx_lm":
                    run = plain_run(model.target.model, tokenizer, prompt, MAX_TOKENS, 0.0, 0)
                else:
                    model.drafter.corpus = corpora.get(system)
                    run, last = _timed(stream_generate(model, tokenizer, prompt, MAX_TOKENS, block_size="auto"))
                    s = last.stats
                    t["steps"] += len(s.acceptance_lengths)
                    t["committed"] += sum(s.acceptance_lengths)
                    t["corpus"] += s.corpus_copied
                t["tokens"] += len(run.tokens) - 1
                t["seconds"] += run.seconds
                outputs[system] = run.tokens
            assert all(o == outputs["mlx_lm"] for o in outputs.values()), f"{dataset} prompt {i}: outputs differ"
        base = totals["mlx_lm"]["tokens"] / totals["mlx_lm"]["seconds"]
        results[dataset] = {"mlx_lm_tps": round(base, 2)} | {
            f"min match {s}" if s != "no corpus" else s: {
                "speedup": round(t["tokens"] / t["seconds"] / base, 3),
                "tau": round(t["committed"] / t["steps"], 3),
                "tau_corpus": round(t["corpus"] / t["steps"], 3),
            }
            for s, t in totals.items() if s != "mlx_lm"
        }
        print(dataset, json.dumps(results[dataset]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"max_tokens": MAX_TOKENS, "num_prompts": args.num_prompts, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
