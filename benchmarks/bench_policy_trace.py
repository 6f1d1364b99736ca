"""Block policies judged on many long prompts by the steps they take, priced by verify times timed
at those prompts' contexts (issues 29 and 31: at 4k-8k tokens one prompt's wall-clock ratio drowns
in this machine's noise, and a small policy change moves one prompt's steps far).

A single row's steps do not depend on timing once its calibration is kept: the same prompt gives the
same steps in every run. Each system's steps are recorded (verified rows or tree nodes, whether it
drafted, whether its anchors ran in the step before) and priced by a table of verify and draft times
timed here at 128 / 2048 / 4096 / the longest prompt's context (``costs.calibrate``, piecewise
linear between them; a tree of N nodes priced as a chain of N rows, as the policy prices it). The
figure of merit is plain decoding's price (a 1-row verify per token after the first) over the run's.

Systems: ``this`` (the defaults); ``this:priced`` (this checkout with the timed table as its step
costs: what a calibration exact at every context would do); ``previous`` (the checkout given by
``--baseline`` at its defaults, with its own kept calibration). Prompts: ``bench_long_context``'s
sources, ``--prompts-per-kind`` manual pages and source files per length, none trained on. Every
run's tokens are checked against the first system's; wall-clock tokens/s are reported beside the
price, not judged on.

    python benchmarks/bench_policy_trace.py --baseline /tmp/previous --lengths 4096 7936 \\
        --prompts-per-kind 4 6 --output benchmarks/results/policy_trace.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
from pathlib import Path

import dflash_mlx  # before mlx: it loads OpenBLAS
from dflash_mlx import costs as costs_module
from dflash_mlx.benchmark import _timed
from dflash_mlx.default import default_pair
from bench_long_context import build_prompts
from bench_release import import_previous

CONTEXTS = (costs_module.SHORT_CONTEXT, 2048, 4096)  # and the longest prompt's


class TimedTable:
    """Verify and draft seconds of one row by block size, timed at each of ``contexts`` (piecewise
    linear between them); it stands in for a calibration (``ready``, ``rows``, ``step_seconds``)."""

    def __init__(self, contexts: list[int], timed: list[costs_module.RowCosts]):
        self.contexts, self.timed, self.rows = contexts, timed, {1: timed[0]}

    def ready(self, rows: int) -> "TimedTable":
        return self

    def verify(self, block_size: int, context: float) -> float:
        return costs_module.interpolate({c: costs_module.interpolate(t.verify, block_size)
                                         for c, t in zip(self.contexts, self.timed)}, context)

    def step_seconds(self, rows: int, block_size: int, draft: bool = True, context: float = 0) -> float:
        """A step's verify, after a drafter forward of its block (``draft``), at most the drafter's
        own (a tree's nodes are drafted in one block of the drafter's: ``price``)."""
        seconds = self.verify(block_size, context)
        return seconds + self.draft_seconds(rows, block_size) if draft and block_size > 1 else seconds

    def draft_seconds(self, rows: int, block_size: int) -> float:
        drafts = self.timed[0].draft
        return costs_module.interpolate(drafts, min(block_size, max(drafts)))

    def price(self, steps: list[dict]) -> float:
        """Seconds of recorded steps, each as ``step_seconds``; a step whose anchors ran ahead pays
        their 1-row forward and its proposals' B - 1 rows in place of B (``BlockPolicy._calibrated``)."""
        total = 0.0
        for s in steps:
            B, context = s["rows"], s["context"]
            if s.get("tree"):  # the drafter ran its whole block (``BlockPolicy._calibrated``)
                total += self.verify(B, context) + self.draft_seconds(1, max(self.timed[0].draft))
            else:
                total += self.step_seconds(1, B, s["draft"], context)
            if s["head_start"] and B > 1:
                total += self.verify(1, context) + self.verify(B - 1, context) - self.verify(B, context)
        return total


@contextlib.contextmanager
def traced(package, steps: list[dict]):
    """Record every step ``package``'s block policies observe."""
    policy_class = importlib.import_module(f"{package.__name__}.policy").BlockPolicy
    observe = policy_class.observe

    def record(self, rows, plan, seconds, ahead=False, head_start=False):
        steps.append({"rows": plan.block_size, "draft": plan.draft, "head_start": head_start,
                      "context": rows[0].context, "tree": getattr(plan, "tree", False)})
        return observe(self, rows, plan, seconds, ahead, head_start)

    policy_class.observe = record
    try:
        yield
    finally:
        policy_class.observe = observe


@contextlib.contextmanager
def step_costs(package, model, table):
    """``model``'s calibration replaced by ``table`` (None: as it is)."""
    if table is None:
        yield
        return
    costs = importlib.import_module(f"{package.__name__}.costs").costs(model)
    kept, costs.table = costs.table, table
    try:
        yield
    finally:
        costs.table = kept


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="a checkout of the previous release (system 'previous')")
    p.add_argument("--system", nargs="+", default=["previous", "this", "this:priced"])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 7936])
    p.add_argument("--prompts-per-kind", type=int, nargs="+", default=[2],
                   help="manual pages and source files per length (one figure for all lengths, or one per length)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4, help="rounds the priced table is timed in")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    if "previous" in args.system and args.baseline is None:
        raise SystemExit("system 'previous' needs --baseline, a checkout of the previous release")
    per_kind = args.prompts_per_kind * len(args.lengths) if len(args.prompts_per_kind) == 1 else args.prompts_per_kind
    if len(per_kind) != len(args.lengths):
        raise SystemExit("--prompts-per-kind: give one figure, or one per --lengths entry")

    pair = default_pair()
    model, tokenizer = dflash_mlx.load(*pair)
    prompts = [q for length, n in zip(args.lengths, per_kind) for q in build_prompts(tokenizer, [length], n)]
    contexts = sorted({*CONTEXTS, max(len(q["ids"]) for q in prompts) + args.max_tokens})
    costs_module.costs(model)  # the kept calibration first: timing the table must not replace it
    table = TimedTable(contexts, costs_module.calibrate(model, 1, repeats=args.repeats, contexts=tuple(contexts)))
    plain_ms = {c: round(1e3 * table.verify(1, c), 1) for c in contexts}
    shown = {c: [ms] + [round(table.verify(B, c) / table.verify(1, c), 2) for B in (2, 4, 8, 16)]
             for c, ms in plain_ms.items()}
    print("timed table (ms of a plain step; 2 / 4 / 8 / 16 rows over it):", shown, flush=True)
    runners = {}
    previous = import_previous(args.baseline) if args.baseline else None
    for name in args.system:
        package, system_model = dflash_mlx, model
        if name == "previous":
            package = previous
            system_model = previous.load(*pair)[0]
        elif name not in ("this", "this:priced"):
            raise SystemExit(f"unknown system {name!r}: previous, this or this:priced")
        runners[name] = (package, system_model, table if name == "this:priced" else None,
                         package.PromptCache(max_entries=1))

    rows = []
    for q in prompts:
        row, first = {"prompt": q["name"], "kind": q["kind"], "length": q["length"], "tokens": len(q["ids"])}, None
        for name, (package, system_model, costs, prompt_cache) in runners.items():
            steps: list[dict] = []
            with traced(package, steps), step_costs(package, system_model, costs):
                run, last = _timed(package.stream_generate(system_model, tokenizer, q["ids"], args.max_tokens,
                                                           prompt_cache=prompt_cache))
            first = first or run.tokens
            plain = (len(run.tokens) - 1) * table.verify(1, len(q["ids"]) + len(run.tokens) / 2)
            s = last.stats
            row[name] = {"priced_speedup": round(plain / table.price(steps), 3),
                         "steps": len(steps), "plain_steps": sum(st["rows"] == 1 for st in steps),
                         "tau": round(s.tau, 3), "tree_steps": s.tree_steps, "tokens": len(run.tokens),
                         "wall_tps": round(run.tps, 2), "match": run.tokens == first}
            if run.tokens != first:
                raise SystemExit(f"{q['name']}: {name}'s tokens differ from {next(iter(runners))}'s")
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {}
    for name in runners:
        for length in args.lengths:
            at = [r[name] for r in rows if r["length"] == length]
            figures = [r["priced_speedup"] for r in at]
            summary[f"{name} @ {length}"] = {"geomean": round(math.exp(sum(map(math.log, figures)) / len(figures)), 3),
                                             "lowest": min(figures), "steps": sum(r["steps"] for r in at)}
    print(json.dumps(summary, indent=1), flush=True)
    if args.output:
        args.output.write_text(json.dumps({"pair": pair, "max_tokens": args.max_tokens, "systems": args.system,
                                           "timed_table": {c: {B: table.verify(B, c) for B in table.timed[0].verify}
                                                           for c in contexts},
                                           "summary": summary, "prompts": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
