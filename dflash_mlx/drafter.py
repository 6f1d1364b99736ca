"""The DFlash block drafter: Qwen3-style layers that attend over target context.

One forward proposes a whole block. The fused target hidden states enter every
layer only as extra keys/values ("KV injection"); queries come from the block,
whose input is ``[anchor, MASK, ..., MASK]``. Embeddings and LM head are the
target's, so a checkpoint holds neither.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from . import kernels
from .checkpoint import load_weights, read_config, resolve
from .errors import DFlashError
from .ragged import RaggedKVCache

REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "num_target_layers",
)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread target layers, as the released drafters were trained."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    num_target_layers: int
    head_dim: int | None = None
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = 0
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # Some released drafters (Gemma targets) rescale their block input and logits.
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # Our extension: the drafter proposes only these many (frequent) token ids.
    draft_vocab_size: int | None = None

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(
                self.num_target_layers, self.num_hidden_layers
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DrafterArgs":
        missing = [k for k in REQUIRED_KEYS if k not in config]
        if missing:
            raise DFlashError(
                f"drafter config.json is missing {', '.join(missing)}: "
                "is this a DFlash drafter checkpoint (it needs a dflash_config)?"
            )
        dflash = config.get("dflash_config") or {}
        known = cls.__dataclass_fields__
        args = {k: v for k, v in config.items() if k in known}
        args.update({k: v for k, v in dflash.items() if k in known})
        if args.get("rope_theta") is None:
            rope = config.get("rope_parameters") or {}
            args["rope_theta"] = rope.get("rope_theta", 1e6)
        return cls(**args)

    def sliding_window_of(self, layer: int) -> int | None:
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


def is_drafter_config(config: dict[str, Any]) -> bool:
    return "dflash_config" in config or ("block_size" in config and "num_target_layers" in config)


class Attention(nn.Module):
    def __init__(self, args: DrafterArgs, sliding_window: int | None):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = hd**-0.5
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def __call__(
        self, x: mx.array, context: mx.array, cache: KVCache, ops: kernels.KernelOps
    ) -> mx.array:
        # The cache holds context K/V only; the block's K/V go in for this forward
        # and are trimmed off by the caller, so positions stay absolute.
        B, L, _ = x.shape
        start = cache.offset + context.shape[1]
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        kv_in = mx.concatenate([context, x], axis=1)
        S = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).reshape(B, S, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(kv_in).reshape(B, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        k = self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        if isinstance(cache, RaggedKVCache):
            # Batch engine: each row's context has its own length, so the mask is per row.
            mask = cache.block_mask(L, self.sliding_window)
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        else:
            out = ops.block_attention(q, k, v, scale=self.scale, sliding_window=self.sliding_window)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class ContextWindowCache:
    """Drafter context K/V bounded to the first ``keep`` and the last ``recent`` rows.

    ``offset`` still counts every position seen, so new rows get their true
    absolute RoPE position; only storage is bounded. Rows dropped from the middle
    change what the drafter sees (its acceptance), never the committed output.
    Sliding-window layers mask by row index, which stays exact because the last
    ``recent >= sliding_window`` rows are contiguous.
    """

    def __init__(self, keep: int, recent: int):
        self.keep, self.recent = keep, recent
        self.keys = self.values = None
        self.offset = 0
        self.head = 0  # stored rows that are positions 0..head-1; the rest end at offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        if self.keys.shape[2] == self.offset:  # nothing dropped yet: storage starts at 0
            self.head = min(self.keep, self.offset)
        return self.keys, self.values

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions, then shed middle rows beyond the window."""
        n = min(n, self.offset)
        if self.keys is None:
            return 0
        self.offset -= n
        tail = self.keys.shape[2] - self.head
        if n <= tail:
            stored = self.keys.shape[2] - n
        else:  # trimmed past the stored tail: only start rows before offset survive
            self.head = stored = min(self.head, self.offset)
        excess = stored - self.head - self.recent
        keep = [slice(0, self.head), slice(self.head + max(excess, 0), stored)]
        self.keys = mx.concatenate([self.keys[:, :, s] for s in keep], axis=2)
        self.values = mx.concatenate([self.values[:, :, s] for s in keep], axis=2)
        return n


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: DrafterArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, args.sliding_window_of(layer))
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, context, cache, ops):
        x = x + self.self_attn(self.input_layernorm(x), context, cache, ops)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        n_in = len(args.target_layer_ids) * args.hidden_size
        self.fc = nn.Linear(n_in, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.draft_vocab_size:
            # Scoring every draft row against the whole vocabulary is most of a draft's
            # cost on small targets; the verify step still scores all V, so restricting
            # what the drafter may propose changes acceptance, never the output.
            self.draft_vocab = mx.zeros((args.draft_vocab_size,), mx.int32)
            self.freeze(recurse=False, keys=["draft_vocab"])

    @property
    def vocab_rows(self) -> mx.array | None:
        """Token ids the drafter scores (None: all of them); ``Target.head`` takes it."""
        return self.get("draft_vocab")

    def full_vocab(self, logits: mx.array) -> mx.array:
        """Scores over the draft vocabulary -> (..., V), -inf for ids it never proposes."""
        rows = self.vocab_rows
        if rows is None:
            return logits
        full = mx.full((*logits.shape[:-1], self.args.vocab_size), -mx.inf, logits.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(rows, logits.shape), logits, axis=-1)

    def make_cache(self, window: tuple[int, int] | None = None) -> list:
        """Context caches, one per layer; ``window=(keep, recent)`` bounds them.

        Unbounded, every drafter forward attends over the whole prompt, so its
        cost grows with context while acceptance does not improve. A windowed
        cache keeps the first ``keep`` rows and the last ``recent`` ones.
        """
        if window is None:
            return [KVCache() for _ in self.layers]
        keep, recent = window
        sliding = max((a.self_attn.sliding_window or 0 for a in self.layers), default=0)
        if keep < 0 or recent < max(1, sliding):
            raise DFlashError(
                f"drafter window keep={keep} recent={recent} is invalid: need keep >= 0 and "
                f"recent >= {max(1, sliding)} (the drafter's sliding window)"
            )
        return [ContextWindowCache(keep, recent) for _ in self.layers]

    def __call__(
        self,
        block_embeddings: mx.array,
        context_hidden: mx.array,
        cache: list[KVCache],
        lm_head: Callable[[mx.array], mx.array],
        ops: kernels.KernelOps,
    ) -> mx.array:
        """Logits (L-1, V) for the block positions after the anchor (batch 1).

        block_embeddings: (1, L, H) target embeddings of ``[anchor, MASK...]``.
        context_hidden: (1, n, k*H) target hidden states of the context rows not
        yet in ``cache`` (the concatenated outputs of ``target_layer_ids``).
        lm_head: the target's output head restricted to ``vocab_rows``
        (``Target.head``). The new context K/V stay in ``cache``; the block's do not.
        """
        return self.draft_rows(block_embeddings, context_hidden, cache, lm_head, ops)[0]

    def draft_rows(
        self,
        block_embeddings: mx.array,
        context_hidden: mx.array,
        cache: list,
        lm_head: Callable[[mx.array], mx.array],
        ops: kernels.KernelOps,
    ) -> mx.array:
        """``__call__`` for R rows at once: (R, L, H) blocks, (R, n, k*H) context -> (R, L-1, V).

        With ``RaggedKVCache`` caches the rows may hold different context lengths;
        row r's new context is its last ``n - left_padding[r]`` rows (``prepare``).
        """
        a = self.args
        context = self.hidden_norm(self.fc(context_hidden))
        h = block_embeddings if a.input_embedding_scale == 1 else block_embeddings * a.input_embedding_scale
        for layer, c in zip(self.layers, cache):
            h = layer(h, context, c, ops)
        L = block_embeddings.shape[1]
        for c in cache:
            c.trim(L)
        logits = lm_head(self.norm(h)[:, 1:])
        if a.output_multiplier != 1:
            logits = logits * a.output_multiplier
        if a.final_logit_softcapping:
            logits = mx.tanh(logits / a.final_logit_softcapping) * a.final_logit_softcapping
        return self.full_vocab(logits)


def load_drafter(path_or_repo: str, dtype: mx.Dtype | None = None) -> Drafter:
    """Load a DFlash drafter (released layout or our MLX conversion, quantized or not)."""
    path = resolve(str(path_or_repo), "drafter")
    config = read_config(path, "drafter")
    if not is_drafter_config(config):
        raise DFlashError(
            f"{path} is not a DFlash drafter (config.json has no dflash_config): "
            "pass the drafter with --draft and the target with --model"
        )
    args = DrafterArgs.from_config(config)
    model = Drafter(args)
    weights = load_weights(path)
    if (q := config.get("quantization")) is not None:
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
            # Mixed recipes store per-layer settings under the layer's path, as mlx_lm does.
            class_predicate=lambda p, m: f"{p}.scales" in weights and (q.get(p) if isinstance(q.get(p), dict) else True),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DFlashError(
            f"drafter weights in {path} do not match its config.json ({e}): "
            "the checkpoint is incomplete or the config belongs to another model"
        ) from None
    rows = model.vocab_rows
    if rows is not None and not (rows.size and 0 <= rows.min().item() and rows.max().item() < args.vocab_size):
        raise DFlashError(f"drafter draft_vocab in {path} holds ids outside its vocab_size {args.vocab_size}: the checkpoint is corrupt")
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def drafter_config(args: DrafterArgs) -> dict:
    """config.json of a drafter in the released layout (plus our draft vocabulary)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "max_position_embeddings": args.max_position_embeddings,
        "block_size": args.block_size,
        "num_target_layers": args.num_target_layers,
        "torch_dtype": "float32",
        "dflash_config": {"target_layer_ids": args.target_layer_ids, "mask_token_id": args.mask_token_id},
        **({"draft_vocab_size": args.draft_vocab_size} if args.draft_vocab_size else {}),
    }


def save_drafter(drafter: Drafter, out: Path, dtype: mx.Dtype = mx.float32) -> None:
    """config.json + model.safetensors, loadable by ``load_drafter`` and the converter."""
    out.mkdir(parents=True, exist_ok=True)
    config = drafter_config(drafter.args)
    config["torch_dtype"] = str(dtype).split(".")[-1]
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
