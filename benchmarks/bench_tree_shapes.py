"""Offline: how many proposals would trees of each kind get accepted, at equal node budgets?

    python benchmarks/bench_tree_shapes.py [--prompts 12] [--tokens 96] [--out benchmarks/results/tree_shapes.json]

The built-in pair (SmolLM2-135M fp32 and its drafter, block 8) on GSM8K train questions: the
target writes its greedy answer; then at every position of the answer the drafter drafts a block
from the target's hidden states of the text before it (teacher forcing: what decoding would see
had it committed exactly that text). A tree's accepted length is then known without the target:
the walk follows the true continuation as far as the tree holds it. Per budget, trees are:

- ``chain``: the drafter's top choice at each depth (today's block; at most 7 deep);
- ``drafter``: best-first on the drafter's own log-probs (``tree.build``);
- ``calibrated``: best-first on a (depth, rank) acceptance table measured on the first half of
  the prompts (``build(calibration=...)``), scored on the second half like the others.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from dflash_mlx import tree as trees
from dflash_mlx.default import default_pair
from dflash_mlx.kernels import get_ops

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
WIDTH = 8


def steps(pair, tokenizer, question: str, tokens: int):
    """Per answer position: the drafter's scores (1, D, V') over its draft vocabulary and the
    true next D tokens."""
    target, drafter = pair.target, pair.drafter
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    answer = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=tokens)]
    text = prompt + answer
    _, hidden = target(mx.array([text]), None)
    B, rows = drafter.args.block_size, drafter.vocab_rows
    head, ops, cache, seen = target.head(rows), get_ops(), drafter.make_cache(), 0
    mask = drafter.args.mask_token_id
    for anchor in range(len(prompt) - 1, len(text) - B):
        block = mx.array([text[anchor]] + [mask] * (B - 1))
        logits = drafter(target.embed(block)[None], hidden[:, seen:anchor], cache, head, ops)
        seen = anchor
        yield mx.take(logits, rows, axis=-1), np.array(text[anchor + 1 : anchor + B])


def accepted(tree: trees.DraftTree, truth: np.ndarray) -> int:
    """Proposals a greedy target accepts: on the true path its pick at depth d is truth[d]."""
    picks = np.where(tree.depths < len(truth), truth[np.minimum(tree.depths, len(truth) - 1)], -1)
    return trees.walk(tree, picks).accepted[0]


def table(ids: np.ndarray, truths: np.ndarray) -> np.ndarray:
    """(D, K) chance that depth d's truth is the rank-k candidate, given depths < d were held."""
    D, K = ids.shape[1:]
    hits = (ids == truths[:, :, None])  # (steps, D, K)
    reached = np.concatenate([np.ones((len(ids), 1), bool), np.cumprod(hits.any(-1), axis=1)[:, :-1].astype(bool)], 1)
    counts = (hits & reached[:, :, None]).sum(0)
    # Ranks never seen keep a small floor, so that their log stays finite, and stay ordered.
    rates = (counts + 0.01) / (reached.sum(0)[:, None] + 1.0)
    return np.minimum.accumulate(rates, axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 7, 12, 20])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pair, tokenizer = dflash_mlx.load(*default_pair())
    rows = pair.drafter.vocab_rows
    questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[: args.prompts]]
    half = len(questions) // 2
    ids, truths = [], []
    for q in questions[:half]:
        for scores, truth in steps(pair, tokenizer, q, args.tokens):
            ids.append(trees.candidates(scores, WIDTH, rows)[0][0])
            truths.append(truth)
    calibration = table(np.array(ids), np.array(truths))
    kinds = {(b, k): [] for b in args.budgets for k in ("chain", "drafter", "calibrated")}
    for q in questions[half:]:
        for scores, truth in steps(pair, tokenizer, q, args.tokens):
            for b in args.budgets:
                top = np.array(rows[mx.argmax(scores[0], axis=-1)])[:b].tolist()
                kinds[b, "chain"].append(accepted(trees.chain([0], [top]), truth))
                kinds[b, "drafter"].append(accepted(trees.build(scores, b, [0], rows, WIDTH), truth))
                kinds[b, "calibrated"].append(
                    accepted(trees.build(scores, b, [0], rows, WIDTH, calibration=calibration), truth))
    results = {"prompts": args.prompts, "tokens": args.tokens, "steps_scored": len(kinds[args.budgets[0], "chain"]),
               "width": WIDTH, "calibration": np.round(calibration, 3).tolist(), "mean_accepted": {}}
    for b in args.budgets:
        results["mean_accepted"][b] = {k: round(float(np.mean(kinds[b, k])), 3) for k in ("chain", "drafter", "calibrated")}
        print(f"budget {b:>2}: " + "  ".join(f"{k} {v:.3f}" for k, v in results["mean_accepted"][b].items()))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
