"""Drafters for the built-in target compared by what they alone get accepted: the same on every machine.

    python benchmarks/bench_drafter.py --drafter shipped /path/to/other [--sets long held-out datasets]
        [--out benchmarks/results/drafters.json]

Greedy, one chain at block 8, no copy proposals and no trees, each drafter reading through its own
draft window: so the figure, drafted tokens accepted per step, depends on the drafter's weights
and the prompts alone, not on the machine's speed or its measured step costs (``dflash-mlx
benchmark`` and ``bench_release.py`` measure speed at the defaults). Every drafter's tokens are
checked equal (each is the target's greedy output). Sets:

- ``long``: the long-context benchmark's prompts (``bench_long_context.py``) at ``--lengths``,
  a manual page and a source file at each, 64 tokens after each;
- ``held-out``: 3k-token prompts of four more manual pages and four more source files that
  ``dflash-mlx train`` never reads (``train.data.LONG_HELD_OUT``), 64 tokens after each;
- ``datasets``: ``--num-prompts`` prompts of GSM8K, HumanEval and MT-Bench, 96 tokens each.

``shipped`` names the built-in drafter. Rows per drafter and prompt, and per drafter and group
(a set's kind and length) the acceptance over all its steps.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import dflash_mlx  # before mlx: it loads OpenBLAS
from bench_long_context import build_prompts, dflash_run, fit, source_text
from dflash_mlx import DFlashModel
from dflash_mlx.benchmark import _chat, load_dataset
from dflash_mlx.default import default_pair
from dflash_mlx.models import load_drafter
from dflash_mlx.train.data import CODE_QUESTIONS, DOC_QUESTIONS

HELD_OUT = (("docs", "howto/argparse.rst.txt"), ("docs", "tutorial/classes.rst.txt"),
            ("docs", "howto/urllib2.rst.txt"), ("docs", "howto/unicode.rst.txt"),
            ("code", "flask/cli.py"), ("code", "jinja2/environment.py"),
            ("code", "rich/text.py"), ("code", "werkzeug/serving.py"))


def prompts(tokenizer, sets: list[str], lengths: list[int], num_prompts: int) -> list[dict]:
    out = []
    if "long" in sets:
        out += [{"set": "long", "name": p["name"], "group": f"{p['kind']} {p['length']}", "ids": p["ids"],
                 "max_tokens": 64} for p in build_prompts(tokenizer, lengths)]
    if "held-out" in sets:
        for i, (kind, name) in enumerate(HELD_OUT):
            question = (DOC_QUESTIONS if kind == "docs" else CODE_QUESTIONS)[i % 4]
            out.append({"set": "held-out", "name": name, "group": f"held-out {kind} 3000",
                        "ids": fit(tokenizer, source_text(kind, name), question, kind, 3000), "max_tokens": 64})
    if "datasets" in sets:
        for dataset in ("gsm8k", "humaneval", "mt-bench"):
            for i, text in enumerate(load_dataset(dataset, num_prompts)):
                out.append({"set": "datasets", "name": f"{dataset} {i}", "group": dataset,
                            "ids": _chat(tokenizer, text), "max_tokens": 96})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", nargs="+", default=["shipped"], help="drafter folders, or shipped")
    p.add_argument("--sets", nargs="+", choices=["long", "held-out", "datasets"], default=["long", "held-out", "datasets"])
    p.add_argument("--lengths", type=int, nargs="+", default=[200, 1024, 2048, 4096])
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    target_path, shipped = default_pair()
    model, tokenizer = dflash_mlx.load(target_path, shipped)
    # In the target's dtype, as ``dflash_mlx.load`` gives them.
    pairs = {d: DFlashModel(model.target, load_drafter(shipped if d == "shipped" else d, model.target.dtype))
             for d in args.drafter}
    rows, groups = [], defaultdict(lambda: [0, 0])  # (drafter, group) -> [drafted accepted, steps]
    for prompt in prompts(tokenizer, args.sets, args.lengths, args.num_prompts):
        outputs = {}
        for name, pair in pairs.items():
            run, stats = dflash_run(pair, tokenizer, prompt["ids"], prompt["max_tokens"], 8, "auto", False, 0)
            outputs[name] = run.tokens
            groups[name, prompt["group"]][0] += round(stats["drafted"] * stats["steps"])
            groups[name, prompt["group"]][1] += stats["steps"]
            rows.append({"drafter": name, "set": prompt["set"], "name": prompt["name"], "group": prompt["group"],
                         "prompt_tokens": len(prompt["ids"]), "steps": stats["steps"], "drafted_per_step": stats["drafted"]})
            print(json.dumps(rows[-1]), flush=True)
        assert all(o == outputs[args.drafter[0]] for o in outputs.values()), f"{prompt['name']}: outputs differ"
    summary = {f"{d} | {g}": round(a / s, 3) for (d, g), (a, s) in groups.items()}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"drafters": args.drafter, "summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
