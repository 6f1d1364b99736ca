"""Training speed: one process against two ranks, interleaved in one run.

Each trial runs ``dflash-mlx train`` with the given flags for ``--steps`` steps in a fresh folder
that links a prepared run's data (``--data``: a train ``--out`` holding ``data.jsonl`` and
``cache/``, so no trial generates or encodes anything), alternately as one process and as two ranks
started without the launcher (docs/sharding.md), ``--rounds`` times, every process with one OpenBLAS
thread. A trial's time is the ``train_seconds`` of its ``train_result.json`` (the steps alone).

    python benchmarks/bench_train_ranks.py --data runs/smollm2-drafter --steps 40 -- \\
        --prompts gsm8k stdlib sharegpt --num-prompts 2517 ...   # the flags the data was made with
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from side_by_side import free_port


def trial(data: Path, folder: Path, flags: list[str], steps: int, ranks: int) -> float:
    """Seconds per training step of one run on ``ranks`` processes."""
    out = folder / f"ranks{ranks}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copy(data / "data.jsonl", out / "data.jsonl")
    shutil.copytree(data / "cache", out / "cache", copy_function=os.link)
    argv = [sys.executable, "-m", "dflash_mlx", "train", *flags, "--steps", str(steps), "--out", str(out), "--resume",
            "--eval-prompts", "0"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    if ranks > 1:
        hostfile = folder / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
        env["MLX_HOSTFILE"] = str(hostfile)
    runs = [subprocess.Popen(argv, env=dict(env, MLX_RANK=str(r)) if ranks > 1 else env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True) for r in reversed(range(ranks))]
    for run in runs:
        _, err = run.communicate()
        if run.returncode:
            sys.exit(f"a trial failed:\n{err[-2000:]}")
    result = json.loads((out / "train_result.json").read_text())
    shutil.rmtree(out)
    return result["train_seconds"] / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output", type=Path)
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: the train flags the data was made with")
    args = p.parse_args()
    flags = [f for f in args.flags if f != "--"]
    times: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(dir=args.data.parent) as folder:  # beside the data: links need one disk
        for r in range(args.rounds):
            for ranks in (1, 2):
                times[ranks].append(round(trial(args.data, Path(folder), flags, args.steps, ranks), 3))
                print(f"round {r}: {ranks} rank(s) {times[ranks][-1]} s/step", flush=True)
    best = {ranks: min(t) for ranks, t in times.items()}
    summary = {"steps": args.steps, "seconds_per_step": times, "speedup_two_ranks": round(best[1] / best[2], 3),
               "flags": flags}
    print(json.dumps(summary))
    if args.output:
        args.output.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
