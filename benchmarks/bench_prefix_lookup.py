"""Finding the longest cached prefix: the block-hash index (cache/index.py) against a linear scan.

    python benchmarks/bench_prefix_lookup.py [--out benchmarks/results/prefix_lookup.json]

Entries are agent sessions: every one starts with the same 4096-token system prompt and goes on
with its own 4096 tokens (the hard case for a scan: each comparison runs through the shared part).
The prompt extends one entry by 200 tokens. The scan is what PromptCache did before the index: for
every entry, count the common prefix token by token and keep the longest. Times are the best of
several runs, in one process, side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from dflash_mlx.cache.index import PrefixIndex


def scan(entries: dict[int, list[int]], prompt: list[int]) -> tuple[int, int] | None:
    best = None
    for key, tokens in entries.items():
        n = 0
        for x, y in zip(tokens, prompt):
            if x != y:
                break
            n += 1
        n = min(n, len(prompt) - 1)
        if n >= 1 and (best is None or n > best[0]):
            best = (n, key)
    return best


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--entries", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(49152) for _ in range(4096)]
    results = []
    print(f"{'entries':>8} {'scan ms':>9} {'index ms':>9} {'add ms':>8}")
    for count in args.entries:
        entries = {k: system + [rng.randrange(49152) for _ in range(4096)] for k in range(count)}
        index = PrefixIndex()
        add = best_of(lambda: index.add(-1, entries[0]), 5)
        index.remove(-1)
        for k, tokens in entries.items():
            index.add(k, tokens)
        prompt = entries[count // 2] + [rng.randrange(49152) for _ in range(200)]
        anything = lambda n, length: n >= 1  # noqa: E731
        assert scan(entries, prompt) == index.longest(prompt, anything) == (len(entries[0]), count // 2)
        repeats = max(3, 300 // count)
        row = dict(entries=count, scan_seconds=best_of(lambda: scan(entries, prompt), repeats),
                   index_seconds=best_of(lambda: index.longest(prompt, anything), repeats), add_seconds=add)
        results.append(row)
        print(f"{count:>8} {row['scan_seconds'] * 1e3:>9.2f} {row['index_seconds'] * 1e3:>9.2f} "
              f"{row['add_seconds'] * 1e3:>8.2f}")
    if args.out:
        args.out.write_text(json.dumps(dict(prompt_tokens=8192 + 200, results=results), indent=1))


if __name__ == "__main__":
    main()
