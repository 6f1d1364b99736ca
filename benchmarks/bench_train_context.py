"""Cost of one drafter training step after long prompts, with and without a context window.

The built-in drafter's training step (forward, backward, AdamW) on ``--batch-seqs`` sequences of a
P-token prompt and a ``--answer``-token answer with ``--anchors`` anchors each in the answer, for
each P: the whole context (what ``dflash-mlx train`` did before ``--draft-window``) against a
window (``make_batch`` then keeps only the rows some block sees). Hidden states are random: only
shapes matter for time and memory. Prints seconds per step (best of ``--repeats``) and MLX's peak
memory.

    python benchmarks/bench_train_context.py --output benchmarks/results/train_context.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import dflash_mlx
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from dflash_mlx.default import default_pair
from dflash_mlx.train import block_tokens, label_columns, label_weights, loss_fn
from dflash_mlx.train.data import make_batch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[200, 1024, 2048, 4096, 7936])
    p.add_argument("--answer", type=int, default=256)
    p.add_argument("--batch-seqs", type=int, default=4)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--window", default="16:256")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    window = tuple(int(x) for x in args.window.split(":"))

    model, _ = dflash_mlx.load(*default_pair())
    drafter, target = model.drafter, model.target
    B = drafter.args.block_size
    weights = mx.exp(-mx.arange(B - 1, dtype=mx.float32) / 4.0)
    head, columns = target.head(drafter.vocab_rows), label_columns(drafter.vocab_rows, drafter.args.vocab_size)
    width = len(drafter.args.target_layer_ids) * drafter.args.hidden_size
    rows = []
    for prompt in args.prompts:
        T = prompt + args.answer
        rng = np.random.default_rng(0)
        seqs = [(rng.integers(0, drafter.args.vocab_size, T).astype(np.int32), prompt) for _ in range(args.batch_seqs)]
        hidden = [mx.random.normal((T, width)).astype(mx.bfloat16) for _ in seqs]
        mx.eval(hidden)
        row = {"prompt": prompt, "answer": args.answer}
        for name, win in (("full", None), ("window", window)):
            optimizer = optim.AdamW(learning_rate=1e-4)
            grad_fn = nn.value_and_grad(drafter, lambda *a: loss_fn(drafter, target, head, *a, weights, win))
            best = float("inf")
            mx.reset_peak_memory()
            for r in range(args.repeats):
                tic = time.perf_counter()
                context, tail, first, anchors, labels, valid = make_batch(seqs, hidden, list(range(len(seqs))),
                                                                          np.random.default_rng(r), args.anchors, B, win)
                norm = label_weights(weights, valid, columns[labels]).sum()
                (loss, _), grads = grad_fn(context, tail, block_tokens(first, B, drafter.args.mask_token_id), anchors,
                                           columns[labels], valid, norm)
                optimizer.update(drafter, grads)
                mx.eval(loss, drafter.parameters(), optimizer.state)
                best = min(best, time.perf_counter() - tic)
            row[name] = {"seconds": round(best, 3), "context_rows": int(context.shape[1]),
                         "peak_gb": round(mx.get_peak_memory() / 1e9, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.output:
        args.output.write_text(json.dumps({"window": list(window), "batch_seqs": args.batch_seqs,
                                           "anchors": args.anchors, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
