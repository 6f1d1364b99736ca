"""This checkout against a previous release and plain mlx_lm, side by side in one process.

    git worktree add /tmp/previous <commit>      # the release to compare with
    python benchmarks/bench_release.py --baseline /tmp/previous [--num-prompts 5] [--max-tokens 128]
        [--system this this:chain] [--drafter NAME=PATH] [--out benchmarks/results/release.json]

The previous release's package is imported from ``--baseline`` under another name
(``dflash_mlx_previous``; its modules import each other relatively), so both run on the same
machine, in the same process, on the same loaded target weights' files, each with its own
calibration. Built-in pair, greedy, the three benchmark datasets. For every prompt each system runs
once, in an order rotated from prompt to prompt, so a busy spell of this shared machine falls on
all of them; every output is checked against mlx_lm's. Systems: ``previous`` (its
``stream_generate`` at the previous CLI default, block size auto), ``this`` (the defaults: block
size auto, draft trees auto), ``this:chain`` (``tree_budget=0``), ``this:tN`` (trees of N
proposals), ``this:B`` (a fixed block B), combined as ``this:chain:8``; ``previous:B`` (the previous
release at a fixed block B); ``--drafter NAME=PATH`` adds systems ``NAME[:variants]``, this checkout
with another drafter for the built-in target. Reported per dataset: tokens/s, speedup over mlx_lm, tau
split into the target's token, accepted drafts and accepted copies per step, tree steps, the steps by
verified rows (``blocks``: rows or tree nodes -> steps; 1 is a plain step), and this over previous.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import dflash_mlx  # before mlx: it loads OpenBLAS
from dflash_mlx import DFlashModel
from dflash_mlx.benchmark import DATASETS, _chat, _timed, load_dataset, plain_run
from dflash_mlx.default import default_pair
from dflash_mlx.models import load_drafter
from side_by_side import rotated


def import_previous(checkout: Path):
    """The package of another checkout, as ``dflash_mlx_previous``."""
    init = checkout / "dflash_mlx" / "__init__.py"
    spec = importlib.util.spec_from_file_location("dflash_mlx_previous", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["dflash_mlx_previous"] = module
    spec.loader.exec_module(module)
    return module


def named_path(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not (name and sep and path):
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=PATH, e.g. retrained=runs/drafter")
    return name, path


def systems(previous, names: list[str], pair: tuple[str, str], drafters: dict[str, str]) -> dict:
    """name -> function(prompt ids, max_tokens) -> (Run, last response)."""
    model, tokenizer = dflash_mlx.load(*pair)
    # other drafters share this target (loaded once)
    # In the target's dtype, as ``dflash_mlx.load`` gives the shipped one.
    models = {"this": model} | {name: DFlashModel(model.target, load_drafter(path, model.target.dtype))
                                for name, path in drafters.items()}
    out = {"mlx_lm": lambda prompt, n: (plain_run(model.target.model, tokenizer, prompt, n, 0.0, 0), None)}
    if previous is not None:
        old_model, old_tokenizer = previous.load(*pair)
        out["previous"] = lambda prompt, n: _timed(previous.stream_generate(old_model, old_tokenizer, prompt, n,
                                                                            block_size="auto"))
    for name in names:
        system, *variants = name.split(":")
        if system == "previous":  # at its default (run whenever --baseline is given) or at a fixed block
            if previous is None:
                raise SystemExit(f"system {name!r} needs --baseline, a checkout of the previous release")
            if variants:
                out[name] = lambda prompt, n, B=int(variants[0]): _timed(previous.stream_generate(
                    old_model, old_tokenizer, prompt, n, block_size=B))
            continue
        if system not in models:
            raise SystemExit(f"unknown system {name!r}: name this, previous or a --drafter NAME")
        kwargs = {"block_size": "auto", "tree_budget": "auto"}
        for variant in variants:
            if variant == "chain":
                kwargs["tree_budget"] = 0
            elif variant.startswith("t"):
                kwargs["tree_budget"] = int(variant[1:])
            else:
                kwargs["block_size"] = int(variant)
        out[name] = lambda prompt, n, m=models[system], kwargs=kwargs: _timed(dflash_mlx.stream_generate(
            m, tokenizer, prompt, n, **kwargs))
    return out, tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, default=None, help="a checkout of the previous release")
    p.add_argument("--system", nargs="+", default=["this", "this:chain"])
    p.add_argument("--dataset", nargs="+", default=list(DATASETS))
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--drafter", nargs="+", default=[], metavar="NAME=PATH", type=named_path,
                   help="other drafters for the built-in target, run as systems NAME[:variants]")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    drafters = dict(args.drafter)
    print(f"BLAS: {dflash_mlx.BLAS}", flush=True)  # figures taken on the reference BLAS compare with nothing
    previous = import_previous(args.baseline) if args.baseline else None
    runners, tokenizer = systems(previous, args.system, default_pair(), drafters)
    names = list(runners)
    results = {}
    for dataset in args.dataset:
        totals = {n: {"tokens": 0, "seconds": 0.0, "steps": 0, "committed": 0, "drafted": 0, "copied": 0,
                      "tree_steps": 0, "blocks": Counter()} for n in names}
        for i, text in enumerate(load_dataset(dataset, args.num_prompts)):
            prompt, outputs = _chat(tokenizer, text), {}
            for name in rotated(names, i):
                run, last = runners[name](prompt, args.max_tokens)
                t = totals[name]
                t["tokens"] += len(run.tokens) - 1
                t["seconds"] += run.seconds
                if last is not None:
                    t["steps"] += len(last.stats.acceptance_lengths)
                    t["committed"] += sum(last.stats.acceptance_lengths)
                    t["drafted"] += last.stats.drafted
                    t["copied"] += last.stats.copied
                    t["tree_steps"] += getattr(last.stats, "tree_steps", 0)
                    t["blocks"].update(last.stats.block_sizes)
                outputs[name] = run.tokens
            assert all(o == outputs["mlx_lm"] for o in outputs.values()), f"{dataset} prompt {i}: outputs differ"
        base = totals["mlx_lm"]["tokens"] / totals["mlx_lm"]["seconds"]
        row = {"mlx_lm_tps": round(base, 2)}
        for name, t in totals.items():
            if name == "mlx_lm":
                continue
            tps = t["tokens"] / t["seconds"]
            steps = max(t["steps"], 1)
            row[name] = {"tps": round(tps, 2), "speedup": round(tps / base, 3), "tau": round(t["committed"] / steps, 3),
                         "drafted": round(t["drafted"] / steps, 3), "copied": round(t["copied"] / steps, 3),
                         "tree_steps": t["tree_steps"], "steps": t["steps"],
                         "blocks": dict(sorted(t["blocks"].items()))}
        if "previous" in row:
            for name in args.system:
                row[name]["over_previous"] = round(row[name]["tps"] / row["previous"]["tps"], 3)
        results[dataset] = row
        print(dataset, json.dumps(row), flush=True)
        if args.out:  # after every dataset: a run stopped later keeps what it measured
            args.out.write_text(json.dumps({"max_tokens": args.max_tokens, "num_prompts": args.num_prompts,
                                            "baseline": str(args.baseline), "drafters": drafters, "blas": dflash_mlx.BLAS,
                                            "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
