"""Cost of rolling back a hybrid target after a partly rejected block, against verify.

    python benchmarks/bench_rollback.py [--hidden 512] [--layers 8] [--iters 20]

Builds random fp32 models (no weights are downloaded) of a Gated DeltaNet family
(qwen3_5) and a sliding-window family (gemma3_text) and times, per step:

- verify: the target forward over the block (B rows), caches evaluated;
- rollback: ``Target.rollback`` keeping ``keep`` of the B rows (ours: restore the
  recurrent-state snapshot and replay ``keep`` rows of conv + recurrence from the
  recorded projections; sliding/full attention rows are sliced off);
- re-forward: the obvious alternative, restore every layer to before the verify and
  run the target again on the ``keep`` accepted rows.

Prints one line per (family, B, keep) with milliseconds and the rollback / verify ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache
from mlx_lm.utils import _get_classes

from dflash_mlx.target import Target


def build(family: str, hidden: int, layers: int, vocab: int = 4096) -> nn.Module:
    heads = hidden // 64
    if family == "qwen3_5":
        text = dict(
            model_type="qwen3_5_text", hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64, rms_norm_eps=1e-6,
            vocab_size=vocab, linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2),
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
            rope_parameters=dict(type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 2, 4]),
        )
        config = dict(model_type="qwen3_5", text_config=text)
    else:
        config = dict(
            model_type="gemma3_text", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=3 * hidden,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64, query_pre_attn_scalar=64,
            vocab_size=vocab, sliding_window=128, sliding_window_pattern=min(6, layers),
        )
    return random_model(config)


def random_model(config: dict) -> nn.Module:
    """An mlx_lm model of ``config`` with its random initial weights, fp32."""
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model


def _evaluate(cache: list) -> None:
    mx.eval([c.state for c in cache])


def measure(target: Target, block: int, keep: int, iters: int, context: int = 256) -> tuple[float, float, float]:
    """Median ms of verify, our rollback and the re-forward alternative."""
    cache = target.make_cache()
    target.prefill(mx.random.randint(0, target.vocab_size, (context,)), cache, 512)
    _evaluate(cache)
    verify, rollback, reforward = [], [], []
    for _ in range(iters):
        tokens = mx.random.randint(0, target.vocab_size, (1, block))
        before = [(c[0], c[1]) if isinstance(c, ArraysCache) else None for c in cache]

        tic = time.perf_counter()
        logits, hidden = target(tokens, cache)
        mx.eval(logits, hidden)
        _evaluate(cache)
        verify.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        target.rollback(cache, block - keep)
        _evaluate(cache)
        rollback.append(time.perf_counter() - tic)

        # The alternative, from the same start: undo the whole block, re-run the kept rows.
        for c, b in zip(cache, before):
            if b is None:
                c.trim(keep)
            else:
                c[0], c[1] = b
        tic = time.perf_counter()
        mx.eval(target(tokens[:, :keep], cache))
        _evaluate(cache)
        reforward.append(time.perf_counter() - tic)
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return ms(verify), ms(rollback), ms(reforward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(f"fp32 random models, hidden {args.hidden}, {args.layers} layers, 256-token context, median of {args.iters}")
    print(f"{'family':12} {'B':>3} {'keep':>4} {'verify ms':>10} {'rollback ms':>12} {'ratio':>6} {'re-forward ms':>14}")
    for family in ("qwen3_5", "gemma3_text"):
        target = Target(build(family, args.hidden, args.layers), [1, args.layers - 2])
        for block in (4, 16):
            for keep in (1, block // 2, block - 1):
                v, r, f = measure(target, block, keep, args.iters)
                print(f"{family:12} {block:>3} {keep:>4} {v:>10.2f} {r:>12.2f} {r / v:>6.2f} {f:>14.2f}")


if __name__ == "__main__":
    main()
