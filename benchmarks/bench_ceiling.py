"""The engine's ceiling: fixed vs adaptive block size with an oracle drafter, short vs long prompt.

(Kept from the first ``bench_long_context.py``, which now measures real long prompts.)

Prints one row per configuration: tau (tokens per step), generation tokens/s,
share of steps decoded plainly, and the block sizes used. Greedy throughout, so
every row produces the same text.

    python benchmarks/bench_ceiling.py                          # tiny fabricated models
    python benchmarks/bench_ceiling.py --model M --draft D       # real pair

Blocks: fixed 16; "auto" (what ``--block-size auto`` does: the calibrated
cost curve and the running acceptance). Each row is the best of ``--repeats`` runs: on a
shared machine noise only ever slows a run down.

Drafters: "random" is the given drafter (tau near 1 when untrained: speculation
cannot pay), "oracle" (the tests' ``OracleDrafter``) proposes the target's own
greedy continuation with every ``--wrong-every``-th token wrong (a stand-in for a
well-trained drafter on a machine without one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dflash_mlx  # noqa: E402  (loads OpenBLAS before mlx.core)
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from dflash_mlx import DFlashModel, stream_generate  # noqa: E402
from dflash_mlx.costs import costs  # noqa: E402
from tiny import OracleDrafter  # noqa: E402
from side_by_side import pair_paths  # noqa: E402

TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun. "
)


def make_tiny(root: Path) -> tuple[str, str]:
    from tiny import TARGETS, drafter_config, save_drafter, save_target

    target = save_target(root / "target", "qwen3")
    draft = save_drafter(root / "draft", drafter_config(TARGETS["qwen3"]))
    return str(target), str(draft)


def prompt_of(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT * (n // 20 + 2))
    return ids[:n]


def run(model, tokenizer, prompt, max_tokens, block_size, window) -> dict:
    tic, r = time.perf_counter(), None
    for r in stream_generate(model, tokenizer, prompt, max_tokens, block_size=block_size, draft_window=window, stop_tokens=[]):
        pass
    s = r.stats
    return dict(
        tau=s.tau,
        tps=r.generation_tps,
        plain=sum(b == 1 for b in s.block_sizes) / max(len(s.block_sizes), 1),
        sizes=sorted(set(s.block_sizes)),
        seconds=time.perf_counter() - tic,
        tokens=r.generation_tokens,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--short", type=int, default=64, help="Short prompt length (tokens)")
    p.add_argument("--long", type=int, default=4000, help="Long prompt length (tokens)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--window", default="64:1024", help="Drafter window KEEP:RECENT for the windowed rows")
    p.add_argument("--wrong-every", type=int, default=9)
    p.add_argument("--blocks", default="16,auto", help="Block sizes to run (comma-separated: integers or auto)")
    p.add_argument("--repeats", type=int, default=3, help="Runs per row; the fastest is reported")
    p.add_argument("--drafters", default="random,oracle", help="Drafters to run (comma-separated)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model_path, draft_path = pair_paths(args.model, args.draft) if args.model or args.draft else make_tiny(Path(tmp))
        model, tokenizer = dflash_mlx.load(model_path, draft_path)
    curve = costs(model).ready(1)
    print("verify+draft cost relative to one plain step:", {b: round(c, 2) for b, c in curve.relative().items()})
    window = tuple(int(x) for x in args.window.split(":"))

    header = f"{'prompt':>6} {'drafter':>7} {'block':>6} {'window':>9} {'tau':>6} {'tok/s':>8} {'plain%':>6}  sizes"
    print(header)
    print("-" * len(header))
    for length in (args.short, args.long):
        prompt = prompt_of(tokenizer, length)
        ref = [int(t) for t, _ in generate_step(mx.array(prompt), model.target.model, max_tokens=args.max_tokens)]
        plain = max((run(model, tokenizer, prompt, args.max_tokens, 1, None) for _ in range(args.repeats)), key=lambda x: x["tps"])
        print(f"{length:>6} {'-':>7} {1:>6} {'-':>9} {plain['tau']:>6.2f} {plain['tps']:>8.1f} {100:>6.0f}  [1]")
        oracle = DFlashModel(model.target, OracleDrafter(model.drafter, prompt + ref, args.wrong_every))
        for name, pair in (("random", model), ("oracle", oracle)):
            if name not in args.drafters.split(","):
                continue
            for block in args.blocks.split(","):
                for win in (None, window):
                    runs = []
                    for _ in range(args.repeats):
                        runs.append(run(pair, tokenizer, prompt, args.max_tokens, int(block) if block.isdigit() else block, win))
                    r = max(runs, key=lambda x: x["tps"])
                    w = "-" if win is None else f"{win[0]}:{win[1]}"
                    print(
                        f"{length:>6} {name:>7} {block!s:>6} {w:>9} {r['tau']:>6.2f} {r['tps']:>8.1f} "
                        f"{100 * r['plain']:>6.0f}  {r['sizes']}"
                    )


if __name__ == "__main__":
    main()
