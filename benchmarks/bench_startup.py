"""Wall time of one `dflash-mlx generate` process, start to exit: what a kept calibration saves.

    python benchmarks/bench_startup.py [--rounds 3] [--max-tokens 32] [--out benchmarks/results/startup.json]

The built-in pair (``dflash_mlx.default``), one short chat prompt, greedy. Per round, interleaved,
each a fresh process:
- ``first``: block size auto with an empty cache folder (``DFLASH_MLX_CACHE``): the process times the
  pair's steps and its target's prefill chunks (``costs.py``) and keeps them;
- ``kept``: block size auto again on that folder: it reads them;
- ``plain``: ``--block-size 1`` on that folder, which needs no step costs (it reads the prefill
  chunks): what the process costs besides decoding.
The table shows each one's median wall time and the ``Step costs:`` and ``Prefill chunks:`` lines it
printed; every run must write the same text (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_mlx.default import default_pair

PROMPT = "Write a haiku about the sea."


def run(folder: str, max_tokens: int, block_size: str) -> tuple[float, str, str]:
    """(wall seconds, the generated text, its Step costs and Prefill chunks lines) of one process."""
    target, draft = default_pair()
    command = [sys.executable, "-m", "dflash_mlx", "generate", "--model", target, "--draft", draft, "--prompt", PROMPT,
               "--max-tokens", str(max_tokens), "--block-size", block_size]
    tic = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "DFLASH_MLX_CACHE": folder},
                          check=True)
    seconds = time.perf_counter() - tic
    text = done.stdout.split("==========")[0]
    costs = " | ".join(line for line in done.stdout.splitlines() if line.startswith(("Step costs:", "Prefill chunks:")))
    return seconds, text, costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    default_pair()  # builds the pair once, before anything is timed
    runs: dict[str, list[float]] = {"first": [], "kept": [], "plain": []}
    said, texts = {}, set()
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as folder:
            for name, block in (("first", "auto"), ("kept", "auto"), ("plain", "1")):
                seconds, text, costs = run(folder, args.max_tokens, block)
                runs[name].append(seconds)
                said[name] = costs
                texts.add(text)
                print(f"{name:6s} {seconds:6.2f} s  {costs}", flush=True)
    table = {name: {"median_seconds": statistics.median(t), "seconds": t, "step_costs": said[name]}
             for name, t in runs.items()}
    result = {"prompt": PROMPT, "max_tokens": args.max_tokens, "rounds": args.rounds, "exact": len(texts) == 1,
              "runs": table,
              "kept_over_first": table["kept"]["median_seconds"] / table["first"]["median_seconds"],
              "kept_over_plain": table["kept"]["median_seconds"] / table["plain"]["median_seconds"]}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
