"""Systems run side by side in one process on the benchmark datasets (bench_corpus, bench_policy).

For every prompt each system runs once, in an order rotated from prompt to prompt, so a busy spell
of this shared machine falls on all of them; every output is checked against mlx_lm's (the first
system). Also ``free_port``, for the processes benchmarks start beside each other (servers, ranks),
and ``pair_paths``, the pair a benchmark's ``--model`` / ``--draft`` name.
"""

from __future__ import annotations

import json
import socket

import dflash_mlx  # noqa: F401  (before mlx: it loads OpenBLAS)
from dflash_mlx.benchmark import DATASETS, _chat, _timed, load_dataset, plain_run
from dflash_mlx.default import default_pair
from dflash_mlx.generation import stream_generate

MAX_TOKENS = 128


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pair_paths(model: str | None, draft: str | None) -> tuple[str, str]:
    """The target and drafter folders a benchmark runs: ``model`` and ``draft`` where given, the
    built-in pair's where not (so ``--draft`` alone runs that drafter on the built-in target)."""
    if model is None or draft is None:
        target, drafter = default_pair()
        model, draft = model or target, draft or drafter
    return model, draft


def rotated(items: list, shift: int) -> list:
    """``items`` in an order rotated by ``shift``: over len(items) rounds each runs in every place."""
    shift %= len(items)
    return items[shift:] + items[:shift]


def side_by_side(model, tokenizer, policies: dict, num_prompts: int, prepare=None):
    """Yields (dataset, {system: totals}) for mlx_lm and one DFlash run per entry of ``policies``
    (name -> block_size for ``stream_generate``, or a function making one per prompt).
    ``prepare(name)`` runs before each DFlash run (e.g. to swap the drafter's corpus)."""
    systems = ["mlx_lm", *policies]
    for dataset in DATASETS:
        totals = {s: {"tokens": 0, "seconds": 0.0, "steps": 0, "committed": 0, "corpus": 0, "plain": 0}
                  for s in systems}
        for i, text in enumerate(load_dataset(dataset, num_prompts)):
            prompt = _chat(tokenizer, text)
            outputs = {}
            for system in rotated(systems, i):
                t = totals[system]
                if system == "mlx_lm":
                    run = plain_run(model.target.model, tokenizer, prompt, MAX_TOKENS, 0.0, 0)
                else:
                    if prepare is not None:
                        prepare(system)
                    block_size = policies[system]() if callable(policies[system]) else policies[system]
                    run, last = _timed(stream_generate(model, tokenizer, prompt, MAX_TOKENS, block_size=block_size))
                    s = last.stats
                    t["steps"] += len(s.acceptance_lengths)
                    t["committed"] += sum(s.acceptance_lengths)
                    t["corpus"] += s.corpus_copied
                    t["plain"] += s.block_sizes.count(1)
                t["tokens"] += len(run.tokens) - 1
                t["seconds"] += run.seconds
                outputs[system] = run.tokens
            assert all(o == outputs["mlx_lm"] for o in outputs.values()), f"{dataset} prompt {i}: outputs differ"
        yield dataset, totals


def speedups(totals: dict) -> dict:
    """Each DFlash system's tokens/s over mlx_lm's, tau, and the raw counts, for one dataset."""
    base = totals["mlx_lm"]["tokens"] / totals["mlx_lm"]["seconds"]
    return {"mlx_lm_tps": round(base, 2)} | {
        s: {"speedup": round(t["tokens"] / t["seconds"] / base, 3), "tau": round(t["committed"] / t["steps"], 3),
            "tau_corpus": round(t["corpus"] / t["steps"], 3), "plain_steps": t["plain"], "steps": t["steps"]}
        for s, t in totals.items() if s != "mlx_lm"
    }


def report(model, tokenizer, policies: dict, num_prompts: int, out: str | None, prepare=None) -> None:
    """``side_by_side``, one line of ``speedups`` per dataset as it finishes, and the JSON to ``out``."""
    results = {}
    for dataset, totals in side_by_side(model, tokenizer, policies, num_prompts, prepare):
        results[dataset] = speedups(totals)
        print(dataset, json.dumps(results[dataset]), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"max_tokens": MAX_TOKENS, "num_prompts": num_prompts, "results": results}, f, indent=1)
