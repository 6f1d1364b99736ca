"""What the prompt-end snapshot of a recurrent (Gated DeltaNet) target costs, in time and memory.

    python benchmarks/bench_hybrid_snapshot.py [--lengths 512 2048] [--repeats 3] [--out FILE]

A recurrent state cannot be cut back to a prefix, so for such targets the engine saves every prompt
to the prompt cache as soon as it is prefilled (``Engine._join``): the next turn extends the prompt,
while the reply may come back rendered differently. The snapshot copies the attention layers' K/V
of the prompt and every recurrent layer's state. Timed as the engine takes it (``Target.take`` of
the prefilled caches, then ``PromptCache.save``: compact copies, evaluated) against the prompt's
prefill, best of ``--repeats``, on a random fp32 qwen3_5 model (hidden 512, 8 layers, one in four
full attention as Qwen3.5/3.6 lay them out); the snapshot's bytes: attention K/V grow with the
prompt, the recurrent states do not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx runs anything)
from dflash_mlx import DFlashModel, PromptCache
from dflash_mlx.models import Drafter, DrafterArgs
from dflash_mlx.target import Target

CONFIG = dict(model_type="qwen3_5", text_config=dict(
    model_type="qwen3_5_text", hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, vocab_size=4096, max_position_embeddings=8192,
    linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, full_attention_interval=4, tie_word_embeddings=False,
    rope_parameters=dict(type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[1, 1, 0])))


def pair() -> DFlashModel:
    model_cls, args_cls = _get_classes(CONFIG)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(CONFIG))
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    text = CONFIG["text_config"]
    drafter = Drafter(DrafterArgs.from_config(dict(
        hidden_size=512, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1024, vocab_size=text["vocab_size"], rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=8192, block_size=8, num_target_layers=8,
        dflash_config=dict(mask_token_id=3, target_layer_ids=[1, 5]))))
    mx.eval(drafter.parameters())
    return DFlashModel(Target(model, [1, 5]), drafter)


def prefill_then_snapshot(model: DFlashModel, prompt: list[int]) -> tuple[float, float, PromptCache]:
    """Seconds of the prompt's prefill (target and drafter), then of its snapshot, as the engine
    takes it (``Target.take`` and ``PromptCache.save``)."""
    target, drafter = model.target, model.drafter
    cache, draft = target.make_cache(), drafter.make_cache()
    tic = time.perf_counter()
    _, hidden = target.prefill(mx.array(prompt), cache)
    drafter.absorb(hidden, draft)
    mx.eval([c.state for c in cache], [c.state for c in draft])
    prefilled = time.perf_counter()
    prompt_cache = PromptCache()
    prompt_cache.bind(model)
    prompt_cache.save(prompt, target.take(cache, 0, len(prompt)), [c.take(0, len(prompt)) for c in draft])
    return prefilled - tic, time.perf_counter() - prefilled, prompt_cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    model = pair()
    prefill_then_snapshot(model, list(range(5, 69)))  # warm up
    results = []
    print(f"{'tokens':>7} {'prefill s':>10} {'snapshot s':>11} {'ratio':>6} {'snapshot MB':>12} {'state MB':>9}")
    for n in args.lengths:
        prompt = [(7 * i) % 4000 + 5 for i in range(n)]
        runs = [prefill_then_snapshot(model, prompt) for _ in range(args.repeats)]
        entry = next(iter(runs[-1][2].entries.values()))
        state = sum(c.nbytes for c in entry.cache if type(c).__name__ == "ArraysCache")
        row = dict(tokens=n, prefill_seconds=min(r[0] for r in runs), snapshot_seconds=min(r[1] for r in runs),
                   snapshot_bytes=entry.nbytes, recurrent_state_bytes=state)
        results.append(row)
        print(f"{n:>7} {row['prefill_seconds']:>10.3f} {row['snapshot_seconds']:>11.4f} "
              f"{row['snapshot_seconds'] / row['prefill_seconds']:>6.3f} {entry.nbytes / 1e6:>12.2f} {state / 1e6:>9.2f}")
    if args.out:
        args.out.write_text(json.dumps(dict(config=CONFIG, results=results), indent=1))


if __name__ == "__main__":
    main()
