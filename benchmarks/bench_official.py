"""Ours vs the paper authors' MLX implementation (PyPI dflash==0.1.0), same target and drafter weights.

    python benchmarks/bench_official.py                       # built-in SmolLM2 pair, blocks 4/8/16
    python benchmarks/bench_official.py --num-prompts 4 --max-tokens 128 --json out.json

DFlash: the shipped SmolLM2 drafter without its draft vocabulary (the official code scores the
whole vocabulary). DFlash2: the same layers inside a DFlash2 drafter (convolutions near the
identity, a small random candidate selector with the released rank 256 / top-k 16), so both
implementations run the DFlash2 forward and selector. Greedy; both systems draft the same tokens
(checked: the outputs must match). One process, the two systems interleaved per prompt and block
size; tokens/s counts from the first token to the last (prefill excluded); per-step time is that
time over the draft-verify steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dflash_mlx  # noqa: E402  (loads OpenBLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from dflash_mlx import stream_generate  # noqa: E402
from dflash_mlx.benchmark import load_dataset  # noqa: E402
from dflash_mlx.default import default_pair  # noqa: E402
from dflash_mlx.models import load_drafter  # noqa: E402
from dflash_mlx.model import DFlashModel  # noqa: E402
from dflash_mlx.target import Target  # noqa: E402


def released_drafters(draft_dir: str, root: Path) -> dict[str, Path]:
    """The shipped drafter as a full-vocabulary DFlash and as a DFlash2, in the released format."""
    from tiny import make_drafter, save_released, with_layers_of

    config = json.loads((Path(draft_dir) / "config.json").read_text())
    config.pop("draft_vocab_size")
    shipped = load_drafter(draft_dir, mx.float32)  # the target's dtype: both sides compute in it
    dflash = make_drafter(config)
    dflash.load_weights([(k, v) for k, v in tree_flatten(shipped.parameters()) if k != "draft_vocab"])
    dflash2_config = {**config, "architectures": ["DFlash2DraftModel"],
                      "dflash_config": {**config["dflash_config"], "conv_kernel_size": 2, "conv_group_size": 16,
                                        "selector_rank": 256, "selector_top_k": 16}}
    dflash2 = with_layers_of(make_drafter(dflash2_config), dflash)
    selector = dflash2.candidate_selector
    selector.hidden_projection.weight = selector.hidden_projection.weight * 0.03  # rerank some picks, not most
    return {"DFlash": save_released(root / "dflash", dflash, config),
            "DFlash2": save_released(root / "dflash2", dflash2, dflash2_config)}


def run_ours(pair, tokenizer, prompt: list[int], block_size: int, max_tokens: int) -> tuple[list[int], float, int]:
    tokens, first, response = [], None, None
    for response in stream_generate(pair, tokenizer, prompt, max_tokens, block_size=block_size):
        first = first or time.perf_counter()
        tokens.append(response.token)
    return tokens, time.perf_counter() - first, len(response.stats.acceptance_lengths)


def run_official(official, model, draft, tokenizer, prompt, block_size, max_tokens) -> tuple[list[int], float, int]:
    tokens, first, steps = [], None, -1
    for response in official.stream_generate(model, draft, tokenizer, prompt, block_size=block_size,
                                              max_tokens=max_tokens):
        first = first or time.perf_counter()
        tokens += response.tokens
        steps += bool(response.tokens)
    return tokens, time.perf_counter() - first, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=3, help="GSM8K questions")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--rounds", type=int, default=2, help="Passes over the prompts per block size")
    p.add_argument("--json", type=Path, default=None, help="Write the results here too")
    args = p.parse_args()
    try:
        import dflash.model_mlx as official
    except ImportError:
        sys.exit("needs the official implementation: pip install --no-deps dflash==0.1.0")
    official.snapshot_download = lambda repo, **_: repo  # local folders only

    target_dir, draft_dir = default_pair()
    ours_model, tokenizer = mlx_lm.load(target_dir)
    # The official stream_generate hooks its target's layers for good: it gets its own copy.
    their_model, _ = mlx_lm.load(target_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in load_dataset("gsm8k", args.num_prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch, folder in released_drafters(draft_dir, Path(tmp)).items():
            drafter = load_drafter(str(folder))
            pair = DFlashModel(Target(ours_model, drafter.args.target_layer_ids), drafter)
            draft = official.load_draft(str(folder))
            run_ours(pair, tokenizer, prompts[0], 4, 8)  # warm-up, both
            run_official(official, their_model, draft, tokenizer, prompts[0], 4, 8)
            for block in args.block_sizes:
                runs = {"ours": [], "official": []}  # (tokens after the first, seconds, steps) per run
                for r in range(args.rounds):
                    for i, prompt in enumerate(prompts):
                        systems = [("ours", lambda: run_ours(pair, tokenizer, prompt, block, args.max_tokens)),
                                   ("official", lambda: run_official(official, their_model, draft, tokenizer,
                                                                     prompt, block, args.max_tokens))]
                        outputs = {}
                        for name, run in systems if (r + i) % 2 == 0 else systems[::-1]:  # alternate who goes first
                            tokens, seconds, steps = run()
                            outputs[name] = tokens
                            runs[name].append((len(tokens) - 1, seconds, steps))
                        if outputs["ours"] != outputs["official"][: len(outputs["ours"])]:
                            print(f"  warning: outputs differ ({arch}, block {block}, prompt {i})")
                row = {"drafter": arch, "block": block}
                for name, results in runs.items():
                    n, seconds, steps = (sum(x) for x in zip(*results))
                    row[name] = {"tok_s": n / seconds, "tau": n / steps, "ms_per_step": 1e3 * seconds / steps,
                                 "median_ms_per_step": 1e3 * statistics.median(s / k for _, s, k in results)}
                row["ratio"] = row["ours"]["tok_s"] / row["official"]["tok_s"]
                # Per-run ratios of paired runs (same prompt, same round): robust to a busy spell.
                row["median_paired_ratio"] = statistics.median(
                    (a[0] / a[1]) / (b[0] / b[1]) for a, b in zip(runs["ours"], runs["official"]))
                rows.append(row)
                print(f"{arch:8} block {block:2}: ours {row['ours']['tok_s']:6.1f} tok/s "
                      f"(tau {row['ours']['tau']:.2f}, {row['ours']['ms_per_step']:.1f} ms/step)  official "
                      f"{row['official']['tok_s']:6.1f} tok/s (tau {row['official']['tau']:.2f}, "
                      f"{row['official']['ms_per_step']:.1f} ms/step)  ratio {row['ratio']:.2f} "
                      f"(median of paired runs {row['median_paired_ratio']:.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"blas": dflash_mlx.BLAS, "max_tokens": args.max_tokens,
                                         "prompts": args.num_prompts, "rounds": args.rounds, "rows": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
