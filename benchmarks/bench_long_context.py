"""Long prompts on the built-in pair (issue 31): prefill against mlx_lm, decode speed, acceptance.

The prompts are documents and source files with a question, none trained on (the built-in
drafter saw GSM8K, stdlib docstring requests and ShareGPT first turns; ``dflash-mlx train``'s
long sources hold out the manual sections and packages read here, ``train.data.LONG_HELD_OUT``):
pages of the Python manual (Debian ``python3.11-doc``: ``apt-get install python3.11-doc``) and
modules of installed packages, each cut at a line so that the chat-formatted prompt is at most
the asked number of tokens of the target's tokenizer. SmolLM2's context is 8192 tokens, so the
"8k" prompts are 7936 tokens: room for 256 more.

Sections (``--sections``), all greedy, in one process:

- ``prefill``: time to the first token, ``dflash_mlx.stream_generate`` against
  ``mlx_lm.stream_generate`` on the same target, each at its default prefill chunk (ours measured,
  ``costs.PrefillChunks``; mlx_lm's 2048), the first tokens checked equal, interleaved (the order
  alternates per round), best of ``--repeats``; prompt tokens/s of each and their ratio, by the
  wall clock and by this process's CPU time (steadier on a shared machine; run with
  OPENBLAS_NUM_THREADS=1).
- ``decode``: decode tokens/s (first token to last, as ``dflash-mlx benchmark`` counts) of plain
  mlx_lm and of DFlash at the defaults, with the whole context as the drafter's (``no window``) and
  with chains only (``chains``, tree budget 0), tau split into the
  target's token, accepted drafted tokens and accepted copies per step; every DFlash run's tokens
  are checked against mlx_lm's.
- ``windows``: acceptance only (drafted / copied accepted per step) at block 8 and auto, copies off
  and on, for each ``--windows`` entry (``none``: the whole context). The tree budget stays auto,
  so a fixed block of 8 verifies trees of up to 8 nodes: these figures are not ``bench_drafter.py``'s,
  which verifies chains.

Decode runs start from prompts prefilled once per system (mlx_lm's caches copied; a ``PromptCache``
per DFlash configuration): decode time excludes prefill on both sides, so this changes no measured
number, only the wall time of the benchmark.

    python benchmarks/bench_long_context.py --output benchmarks/results/long_context.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import dflash_mlx  # before mlx: it loads OpenBLAS
import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx import stream_generate
from dflash_mlx.benchmark import _timed
from dflash_mlx.cache.prompt import PromptCache
from dflash_mlx.costs import prefill_chunks
from dflash_mlx.train.data import (CODE_QUESTIONS, DOC_QUESTIONS, LONG_HELD_OUT, PYTHON_DOCS, long_prompt,
                                   package_root, prompt_ids)
from side_by_side import pair_paths

# Prompt length -> (manual page, package source file) pairs, none of them trained on; a run takes
# the first ``--prompts-per-kind`` of them. More than one per kind: at long contexts one prompt's
# steps move far with small policy changes (benchmarks/results/README.md, 2026-12-07).
SOURCES = {
    200: (("tutorial/controlflow.rst.txt", "flask/app.py"), ("tutorial/datastructures.rst.txt", "flask/cli.py")),
    1024: (("howto/regex.rst.txt", "werkzeug/routing/rules.py"), ("howto/sorting.rst.txt", "werkzeug/http.py")),
    2048: (("howto/descriptor.rst.txt", "rich/console.py"), ("howto/argparse.rst.txt", "jinja2/environment.py")),
    4096: (("howto/functional.rst.txt", "jinja2/compiler.py"), ("tutorial/classes.rst.txt", "werkzeug/test.py"),
           ("tutorial/controlflow.rst.txt", "click/types.py"), ("howto/unicode.rst.txt", "werkzeug/serving.py")),
    7936: (("howto/logging.rst.txt", "click/core.py"), ("howto/clinic.rst.txt", "rich/console.py"),
           ("howto/descriptor.rst.txt", "jinja2/compiler.py"), ("howto/regex.rst.txt", "flask/app.py"),
           ("howto/enum.rst.txt", "jinja2/environment.py"), ("howto/functional.rst.txt", "rich/progress.py")),
}
LENGTHS = tuple(SOURCES)
WINDOWS = ("none", "0:256", "16:128", "16:256", "64:512", "16:1024")


def source_text(kind: str, name: str) -> str:
    if kind == "docs":
        assert name.split("/")[0] in LONG_HELD_OUT["docs"]
        return (PYTHON_DOCS / name).read_text(encoding="utf-8")
    package, _, rest = name.partition("/")
    assert package in LONG_HELD_OUT["code"]
    return (package_root(package) / rest).read_text(encoding="utf-8")


def fit(tokenizer, text: str, question: str, kind: str, length: int) -> list[int]:
    """The longest prompt of whole leading lines of ``text`` plus ``question`` within ``length`` tokens."""
    lines = text.splitlines(keepends=True)
    ids = lambda n: prompt_ids(tokenizer, long_prompt("".join(lines[:n]), question, kind))  # noqa: E731
    lo, hi = 1, len(lines)
    if len(ids(hi)) <= length:
        raise SystemExit(f"{kind} source too short for {length} tokens")
    while lo < hi:  # largest n with len(ids(n)) <= length
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(ids(mid)) <= length else (lo, mid - 1)
    return ids(lo)


def build_prompts(tokenizer, lengths=LENGTHS, per_kind: int = 1) -> list[dict]:
    """``per_kind`` document and code prompts per length: {"name", "kind", "length", "ids"}."""
    prompts = []
    for length in lengths:
        pairs = SOURCES.get(length) or SOURCES[max(k for k in SOURCES if k <= length)]
        if per_kind > len(pairs):
            raise SystemExit(f"--prompts-per-kind {per_kind}: {length} tokens have {len(pairs)} sources per kind")
        for doc, code in pairs[:per_kind]:
            for kind, name, question in (("docs", doc, DOC_QUESTIONS[0]), ("code", code, CODE_QUESTIONS[0])):
                ids = fit(tokenizer, source_text(kind, name), question, kind, length)
                prompts.append({"name": name, "kind": kind, "length": length, "ids": ids})
    return prompts


def parse_window(text: str) -> tuple[int, int] | None:
    return None if text == "none" else tuple(int(x) for x in text.split(":"))


class Prefilled:
    """Each prompt prefilled once per system and handed out again (decode runs only): mlx_lm's
    caches of the prompt minus its last token, copied per plain run, and one ``PromptCache`` per
    drafter window, which a run whose prompt it holds extends by its last token only."""

    def __init__(self, model):
        self.model, self.saved, self.caches = model, (None, None), {}

    def mlx_lm_cache(self, ids: list[int]) -> list:
        if self.saved[0] != ids:
            cache = make_prompt_cache(self.model)
            for i in range(0, len(ids) - 1, 2048):
                self.model(mx.array(ids[i: min(i + 2048, len(ids) - 1)])[None], cache=cache)
                mx.eval([c.state for c in cache])
            self.saved = (ids, [c.state for c in cache])
        cache = make_prompt_cache(self.model)
        for c, (k, v, offset) in zip(cache, self.saved[1]):
            c.state = (k[...], v[...], offset)  # new array objects: updates never reach the saved ones
        return cache

    def prompt_cache(self, window: str) -> PromptCache:
        """The prompt cache of runs with the drafter window ``window`` (entries are kept per window)."""
        return self.caches.setdefault(window, PromptCache(max_entries=1))


def first_token_seconds(responses) -> tuple[float, float, int]:
    """(wall, CPU) seconds to the first response, and its token; CPU time counts only while this
    process runs, the steadier measure on a shared machine (with OPENBLAS_NUM_THREADS=1 no thread spins)."""
    wall, cpu = time.perf_counter(), time.process_time()
    token = next(responses).token
    return time.perf_counter() - wall, time.process_time() - cpu, token


def prefill_section(model, tokenizer, prompts, repeats) -> list[dict]:
    rows = []
    for p in prompts:
        ids, best, first = p["ids"], {}, {}
        runs = {
            "ours": lambda: first_token_seconds(stream_generate(model, tokenizer, ids, 2)),
            "mlx_lm": lambda: first_token_seconds(mlx_lm.stream_generate(model.target.model, tokenizer, ids, max_tokens=2)),
        }
        for r in range(repeats):
            for name in (("ours", "mlx_lm") if r % 2 == 0 else ("mlx_lm", "ours")):
                *seconds, first[name] = runs[name]()
                for clock, t in zip(("wall", "cpu"), seconds):
                    best[name, clock] = min(best.get((name, clock), float("inf")), t)
        if first["ours"] != first["mlx_lm"]:
            raise SystemExit(f"{p['name']}: first token {first['ours']} differs from mlx_lm's {first['mlx_lm']}")
        row = {"prompt": p["name"], "kind": p["kind"], "tokens": len(ids)}
        for clock in ("wall", "cpu"):
            ours, theirs = len(ids) / best["ours", clock], len(ids) / best["mlx_lm", clock]
            row[clock] = {"ours_tps": round(ours, 1), "mlx_lm_tps": round(theirs, 1), "ratio": round(ours / theirs, 3)}
        rows.append(row)
        print("prefill", json.dumps(row), flush=True)
    return rows


def dflash_run(model, tokenizer, ids, max_tokens, block_size, window, copy_proposals, tree_budget="auto",
               prompt_cache=None) -> tuple:
    run, last = _timed(stream_generate(model, tokenizer, ids, max_tokens, block_size=block_size, draft_window=window,
                                       copy_proposals=copy_proposals, tree_budget=tree_budget,
                                       prompt_cache=prompt_cache))
    s = last.stats
    steps = max(len(s.acceptance_lengths), 1)
    plain = sum(b == 1 for b in s.block_sizes) / max(len(s.block_sizes), 1)
    return run, {"tps": round(run.tps, 2), "tau": round(s.tau, 3), "drafted": round(s.drafted / steps, 3),
                 "copied": round(s.copied / steps, 3), "steps": len(s.acceptance_lengths),
                 "plain_steps": round(plain, 3), "tree_steps": s.tree_steps}


def plain_run(model, tokenizer, memo, ids, max_tokens):
    cache = memo.mlx_lm_cache(ids)
    return _timed(mlx_lm.stream_generate(model.target.model, tokenizer, ids[-1:], max_tokens=max_tokens, prompt_cache=cache))[0]


def decode_section(model, tokenizer, memo, prompts, max_tokens, repeats) -> list[dict]:
    rows = []
    # the defaults (block, window and trees auto), the whole context as the drafter's, chains only
    configs = {"defaults": ("auto", "auto", "auto"), "no window": ("auto", None, "auto"),
               "chains": ("auto", "auto", 0)}
    for p in prompts:
        ids = p["ids"]
        base_tps, base_tokens, results = 0.0, None, {}
        for r in range(repeats):
            order = ["plain", *configs] if r % 2 == 0 else [*configs, "plain"]
            for name in order:
                if name == "plain":
                    run = plain_run(model, tokenizer, memo, ids, max_tokens)
                    base_tps, base_tokens = max(base_tps, run.tps), run.tokens
                    continue
                block, win, budget = configs[name]
                run, stats = dflash_run(model, tokenizer, ids, max_tokens, block, win, True, budget,
                                        memo.prompt_cache(str(win)))
                stats["match"] = None
                if name not in results or stats["tps"] > results[name]["tps"]:
                    results[name] = stats
                results[name]["tokens"] = run.tokens
        for name, stats in results.items():
            stats["match"] = stats.pop("tokens") == base_tokens
            stats["speedup"] = round(stats["tps"] / base_tps, 3)
        row = {"prompt": p["name"], "kind": p["kind"], "tokens": len(ids), "plain_tps": round(base_tps, 2), **results}
        rows.append(row)
        print("decode", json.dumps(row), flush=True)
    return rows


def windows_section(model, tokenizer, memo, prompts, max_tokens, windows, modes) -> list[dict]:
    rows = []
    for p in prompts:
        row = {"prompt": p["name"], "kind": p["kind"], "tokens": len(p["ids"])}
        for w in windows:
            for mode in modes:
                block, _, source = mode.partition(":")
                _, stats = dflash_run(model, tokenizer, p["ids"], max_tokens, block if block == "auto" else int(block),
                                      parse_window(w), source == "copies", prompt_cache=memo.prompt_cache(w))
                row[f"{w} {mode}"] = stats
        rows.append(row)
        print("windows", json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="Target folder (default: the built-in pair)")
    p.add_argument("--draft", help="Drafter folder (default: the built-in pair's)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--kinds", nargs="+", default=["docs", "code"])
    p.add_argument("--prompts-per-kind", type=int, default=1,
                   help="Sources per kind and length (up to 2; 4 at 4096, 6 at 7936)")
    p.add_argument("--sections", nargs="+", default=["prefill", "decode", "windows"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--windows", nargs="+", default=list(WINDOWS), help="Windows the windows section sweeps")
    p.add_argument("--modes", nargs="+", default=["8:drafts", "auto:copies"],
                   help="BLOCK:drafts (copy proposals off) or BLOCK:copies (on) runs per window")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)

    print(f"BLAS: {dflash_mlx.BLAS}", flush=True)  # figures taken on the reference BLAS compare with nothing
    model_path, draft_path = pair_paths(args.model, args.draft)
    model, tokenizer = dflash_mlx.load(model_path, draft_path)
    prompts = [q for q in build_prompts(tokenizer, args.lengths, args.prompts_per_kind) if q["kind"] in args.kinds]
    print("prompts:", [(q["name"], len(q["ids"])) for q in prompts], flush=True)
    for _ in stream_generate(model, tokenizer, prompts[0]["ids"][:64], 8):  # warm up both paths
        pass
    for _ in mlx_lm.stream_generate(model.target.model, tokenizer, prompts[0]["ids"][:64], max_tokens=8):
        pass
    report = {"model": model_path, "draft": draft_path, "blas": dflash_mlx.BLAS, "max_tokens": args.max_tokens,
              "prompts": [{k: v for k, v in q.items() if k != "ids"} | {"tokens": len(q["ids"])} for q in prompts]}
    if "prefill" in args.sections:
        report["prefill_chunks"] = prefill_chunks(model).describe()  # ours; mlx_lm's stream_generate: 2048
        report["prefill"] = prefill_section(model, tokenizer, prompts, args.repeats)
    memo = Prefilled(model.target.model)
    if "decode" in args.sections:
        report["decode"] = decode_section(model, tokenizer, memo, prompts, args.max_tokens, args.repeats)
    if "windows" in args.sections:
        report["windows"] = windows_section(model, tokenizer, memo, prompts, args.max_tokens, args.windows, args.modes)
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"written to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
