"""The DFlash architecture (``DFlashDraftModel``): Qwen3-style layers that attend over target context.

One forward proposes a whole block. The fused target hidden states enter every
layer only as extra keys/values ("KV injection"); queries come from the block,
whose input is ``[anchor, MASK, ..., MASK]``. Embeddings and LM head are the
target's, so a checkpoint holds neither.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..cache.context import ContextCache
from ..errors import DFlashError

LAYER_TYPES = ("full_attention", "sliding_attention")
# The drafter context window (keep, recent) of checkpoints that record none and have full-attention
# layers; the best measured on the built-in pair after 1k-4k-token prompts (benchmarks/results/README.md).
DEFAULT_DRAFT_WINDOW = (16, 256)
# Sizes that must be positive integers; the rest of the fields are checked by type only.
_POSITIVE = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "num_target_layers", "head_dim", "max_position_embeddings", "block_size",
    "sliding_window", "draft_vocab_size",
}
_KIND_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "dict": "an object",
               "str": "a string", "None": "null"}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread target layers, as the released drafters were trained."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _is_kind(value: Any, kind: str) -> bool:
    if kind.startswith("list["):
        return isinstance(value, list) and all(_is_kind(v, kind[5:-1]) for v in value)
    if kind in ("int", "float") and isinstance(value, bool):
        return False
    return {"int": isinstance(value, int), "float": isinstance(value, (int, float)), "bool": isinstance(value, bool),
            "dict": isinstance(value, dict), "str": isinstance(value, str), "None": value is None}[kind]


def _kind_name(kind: str) -> str:
    return f"a list of {_KIND_NAMES[kind[5:-1]].split(' ', 1)[1]}s" if kind.startswith("list[") else _KIND_NAMES[kind]


def config_error(key: str, problem: str, fix: str = "correct it in config.json") -> DFlashError:
    return DFlashError(f"drafter config.json: {key} {problem}; fix: {fix}")


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
    # The official loader's default when neither rope_theta nor rope_parameters gives one.
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = 0
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # None: causal inside the block in sliding-window layers only (the official default);
    # true / false applies to every layer.
    is_causal: bool | None = None
    # Some released drafters (Gemma targets) rescale their block input and logits.
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # Our extension: the drafter proposes only these many (frequent) token ids.
    draft_vocab_size: int | None = None
    # Our extension (``dflash_config.draft_window``): [keep, recent], the context window the drafter
    # reads by default (the first ``keep`` and the last ``recent`` context rows before a block):
    # the one ``train --draft-window`` trained it with, or one chosen by measured acceptance.
    draft_window: list[int] | None = None

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DrafterArgs":
        """Arguments from a config.json in any released layout, checked key by key.

        ``dflash_config`` entries win over top-level ones (the 2026 layouts keep
        ``block_size`` and the Gemma scalings there); RoPE comes from
        ``rope_parameters`` (transformers 5) or ``rope_scaling``.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        no_default = dataclasses.MISSING
        required = [n for n, f in fields.items() if f.default is no_default and f.default_factory is no_default]
        missing = [k for k in required if k not in config]
        if missing:
            raise DFlashError(
                f"drafter config.json is missing {', '.join(missing)}: "
                "is this a DFlash drafter checkpoint (it needs a dflash_config)?"
            )
        dflash = config.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise config_error("dflash_config", "is not an object")
        args = {k: (k, v) for k, v in config.items() if k in fields}
        args.update({k: (f"dflash_config.{k}", v) for k, v in dflash.items() if k in fields})
        rope_key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
        rope = config.get(rope_key)
        args["rope_scaling"] = (rope_key, rope)
        if args.get("rope_theta", (None, None))[1] is None:
            args["rope_theta"] = (f"{rope_key}.rope_theta", (rope or {}).get("rope_theta", 10000.0))
        values = {}
        for name, (key, value) in args.items():
            kinds = fields[name].type.replace(" ", "").split("|")
            if not any(_is_kind(value, kind) for kind in kinds):
                expected = " or ".join(_kind_name(kind) for kind in kinds)
                raise config_error(key, f"is {value!r}, not {expected}", f"write {expected} for {key} in config.json")
            if name in _POSITIVE and value is not None and value < 1:
                raise config_error(key, f"is {value}, not a positive integer")
            values[name] = float(value) if kinds[0] == "float" and value is not None else value
        out = cls(**values)
        out.check(config)
        return out

    def check(self, config: dict[str, Any]) -> None:
        """Cross-field checks; ``config`` only names the keys in messages."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise config_error("num_attention_heads", f"({self.num_attention_heads}) is not a multiple of "
                               f"num_key_value_heads ({self.num_key_value_heads})")
        if self.rms_norm_eps <= 0:
            raise config_error("rms_norm_eps", f"is {self.rms_norm_eps}, not positive")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise config_error("layer_types", f"has {len(self.layer_types)} entries for "
                                   f"{self.num_hidden_layers} layers (num_hidden_layers)", "give one type per layer")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise config_error("layer_types", f"has unknown layer types {unknown}",
                                   f"use {' or '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise config_error("sliding_window", "is missing but layer_types has sliding_attention layers",
                                   "set sliding_window (the window in tokens)")
        if self.draft_window is not None:
            w = self.draft_window
            if len(w) != 2 or w[0] < 0 or w[1] < 1:
                raise config_error("dflash_config.draft_window", f"is {w}, not [keep, recent] with keep >= 0 and "
                                   "recent >= 1", "write the window the drafter was trained with, e.g. [16, 256]")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise config_error("dflash_config.target_layer_ids", f"is {self.target_layer_ids}, not a list of "
                               "target layer indices")
        rope_key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
        try:
            make_rope(self)
        except (ValueError, KeyError, TypeError) as e:
            raise config_error(rope_key, f"is not a RoPE setting mlx_lm supports ({type(e).__name__}: {e})") from None

    def context_window(self) -> tuple[int, int]:
        """The drafter context window (keep, recent) to use by default: the one recorded in the
        checkpoint (``train`` writes the window it trained with); for a drafter whose every layer
        has a sliding window, (0, window - 1), the most any block row sees; else
        ``DEFAULT_DRAFT_WINDOW``."""
        if self.draft_window is not None:
            return tuple(self.draft_window)
        windows = [self.sliding_window_of(i) for i in range(self.num_hidden_layers)]
        if None not in windows:
            return 0, max(windows) - 1
        return DEFAULT_DRAFT_WINDOW

    def sliding_window_of(self, layer: int) -> int | None:
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def is_causal_layer(self, layer: int) -> bool:
        return self.sliding_window_of(layer) is not None if self.is_causal is None else self.is_causal


def make_rope(args: DrafterArgs) -> nn.Module:
    return initialize_rope(
        args.head_dim,
        base=args.rope_theta,
        traditional=False,
        scaling_config=args.rope_scaling,
        max_position_embeddings=args.max_position_embeddings,
    )


class Attention(nn.Module):
    def __init__(self, args: DrafterArgs, layer: int):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = hd**-0.5
        self.sliding_window = args.sliding_window_of(layer)
        self.causal = args.is_causal_layer(layer)
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = make_rope(args)

    def _context_kv(self, rows: mx.array, cache: ContextCache) -> tuple[mx.array, mx.array]:
        """K/V of ``rows`` (context, then block) at positions from the cache's offset on, stored."""
        B, S, _ = rows.shape
        k = self.k_norm(self.k_proj(rows).reshape(B, S, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(rows).reshape(B, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return cache.update_and_fetch(self.rope(k, offset=cache.offset), v)

    def absorb(self, context: mx.array, cache: ContextCache) -> None:
        """Take in context rows without a block (a prompt's rows, chunk by chunk)."""
        self._context_kv(context, cache)
        cache.trim(0)

    def __call__(self, x: mx.array, context: mx.array, cache: ContextCache, ops: kernels.KernelOps) -> mx.array:
        # The cache holds context K/V only; the block's K/V go in for this forward
        # and are trimmed off by the caller, so positions stay absolute.
        B, L, _ = x.shape
        start = cache.offset + context.shape[1]  # each row's block follows its own (left-padded) context
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        k, v = self._context_kv(mx.concatenate([context, x], axis=1), cache)
        # Ragged rows: each row's block sits at its own end.
        lengths = None if cache.filled() else mx.array(cache.lengths, mx.int32)
        out = ops.block_attention(q, k, v, scale=self.scale, sliding_window=self.sliding_window, causal=self.causal,
                                  lengths=lengths)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


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
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, context, cache, ops):
        x = x + self.self_attn(self.input_layernorm(x), context, cache, ops)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """``DFlashDraftModel``: proposals are the argmax (or a sample) of each block row."""

    architecture = "DFlashDraftModel"
    decoder_layer = DecoderLayer
    corpus = None  # copying.CopyIndex of the answers its folder ships (corpus.npy), if any

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        n_in = len(args.target_layer_ids) * args.hidden_size
        self.fc = nn.Linear(n_in, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.decoder_layer(args, i) for i in range(args.num_hidden_layers)]
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

    def reach(self, window: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """(sink, recent): the context rows any layer can ever see with ``window`` (None: all of them).

        A sliding-window layer sees at most its last ``sliding_window - 1`` rows; a full-attention
        layer everything, or its ``window`` (first ``keep``, last ``recent`` rows)."""
        windows = [layer.self_attn.sliding_window for layer in self.layers]
        if window is None and None in windows:
            return None
        sliding = max((w - 1 for w in windows if w is not None), default=0)
        keep, recent = window if None in windows else (0, 0)
        return keep, max(recent, sliding)

    def full_vocab(self, values: mx.array, fill: float = -mx.inf) -> mx.array:
        """Values over the draft vocabulary -> (..., V), ``fill`` for ids it never proposes
        (-inf for scores, 0 for probabilities)."""
        rows = self.vocab_rows
        if rows is None:
            return values
        full = mx.full((*values.shape[:-1], self.args.vocab_size), fill, values.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(rows, values.shape), values, axis=-1)

    def make_cache(self, window: tuple[int, int] | None = None, rows: int = 1) -> list[ContextCache]:
        """Context caches of ``rows`` rows, one per layer; ``window=(keep, recent)`` bounds the
        full-attention ones to the first ``keep`` and the last ``recent`` context rows.

        Unbounded, every drafter forward attends over the whole prompt, so its cost grows with
        context while acceptance does not improve. Sliding-window layers always keep just the last
        ``sliding_window - 1`` rows: the most any block row can see.
        """
        if window is not None and (window[0] < 0 or window[1] < 1):
            raise DFlashError(f"drafter window keep={window[0]} recent={window[1]} is invalid: "
                              "need keep >= 0 and recent >= 1")
        caches = []
        for layer in self.layers:
            sliding = layer.self_attn.sliding_window
            keep, recent = (0, sliding - 1) if sliding is not None else window or (0, None)
            caches.append(ContextCache(rows, keep, recent))
        return caches

    def _context(self, context_hidden: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(context_hidden))

    def absorb(self, context_hidden: mx.array, cache: list[ContextCache]) -> None:
        """Take in context rows (B, n, k*H) without drafting: each layer stores their K/V."""
        if not context_hidden.shape[1]:
            return
        context = self._context(context_hidden)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.absorb(context, c)

    def hidden(
        self, block_embeddings: mx.array, context_hidden: mx.array, cache: list, ops: kernels.KernelOps
    ) -> mx.array:
        """Final-normed states (B, L-1, H) of the block positions after the anchor.

        block_embeddings: (B, L, H) target embeddings of ``[anchor, MASK...]``.
        context_hidden: (B, n, k*H) target hidden states of the context rows not
        yet in ``cache`` (the concatenated outputs of ``target_layer_ids``), left-padded
        when rows have different counts (``ContextCache.prepare``). The new context K/V
        stay in ``cache``; the block's do not.
        """
        context = self._context(context_hidden)
        scale = self.args.input_embedding_scale
        h = block_embeddings if scale == 1 else block_embeddings * scale
        for layer, c in zip(self.layers, cache):
            h = layer(h, context, c, ops)
        L = block_embeddings.shape[1]
        for c in cache:
            c.trim(L)
        return self.norm(h[:, 1:])

    def head_scores(self, hidden: mx.array, lm_head: Callable[[mx.array], mx.array]) -> mx.array:
        """Drafter scores over its draft vocabulary (``vocab_rows``; all ids if it has none) from
        ``hidden`` (the output of ``hidden``)."""
        a = self.args
        logits = lm_head(hidden)
        if a.output_multiplier != 1:
            logits = logits * a.output_multiplier
        if a.final_logit_softcapping is not None and a.final_logit_softcapping > 0:  # 0 or less: none
            logits = mx.tanh(logits / a.final_logit_softcapping) * a.final_logit_softcapping
        return logits

    def scores(
        self,
        block_embeddings: mx.array,
        context_hidden: mx.array,
        cache: list,
        lm_head: Callable[[mx.array], mx.array],
        ops: kernels.KernelOps,
    ) -> mx.array:
        """Scores (B, L-1, V') for the block positions after the anchor over the draft vocabulary
        (see ``hidden``): what proposals are picked from and trees ranked by.

        lm_head: the target's output head restricted to ``vocab_rows`` (``Target.head``).
        """
        return self.head_scores(self.hidden(block_embeddings, context_hidden, cache, ops), lm_head)

    def __call__(
        self,
        block_embeddings: mx.array,
        context_hidden: mx.array,
        cache: list,
        lm_head: Callable[[mx.array], mx.array],
        ops: kernels.KernelOps,
    ) -> mx.array:
        """Logits (B, L-1, V) over the whole vocabulary: ``scores``, -inf where it never proposes."""
        return self.full_vocab(self.scores(block_embeddings, context_hidden, cache, lm_head, ops))

    def propose(
        self,
        block_embeddings: mx.array,
        anchor: mx.array,
        context_hidden: mx.array,
        cache: list,
        lm_head: Callable[[mx.array], mx.array],
        strategy: Any,
    ) -> tuple[mx.array, mx.array | None, mx.array]:
        """Proposals (B, L-1), the distribution q (B, L-1, V) they were drawn from (None when
        they are a deterministic pick) and the drafter's probability of its top token at each
        position (B, L-1), which weighs a copy proposal against it (copying.merge).

        ``strategy`` (sampling.py) picks from each row's scores; a DFlash drafter's
        rows are independent, so the whole block is picked at once. ``anchor`` (B,)
        is unused here; DFlash2 conditions each pick on the one before.
        """
        scores = self.scores(block_embeddings, context_hidden, cache, lm_head, strategy.ops)
        return self.pick(scores, strategy.propose)

    def pick(self, scores: mx.array, propose: Callable[[mx.array], tuple[mx.array, mx.array | None]]
             ) -> tuple[mx.array, mx.array | None, mx.array]:
        """``propose`` (a strategy's) over ``scores`` (from ``scores``: the draft vocabulary's
        columns): the picks as token ids, the distribution they were drawn from placed in the
        vocabulary (None for a deterministic pick), and the softmax probability of each row's top
        score, the drafter's confidence in its pick (lazy: read only where a copy is weighed
        against it). Picking over the draft vocabulary, not over all V ids with the rest at -inf:
        a sampler's softmax, top-p sort and draw over all V cost several times more, the
        confidence's exponentials likewise."""
        rows = self.vocab_rows
        picks, q = propose(scores, columns=rows)
        confidence = mx.exp(scores.max(axis=-1) - mx.logsumexp(scores, axis=-1))
        if rows is not None:
            picks, q = rows[picks], None if q is None else self.full_vocab(q, 0.0)
        return picks, q, confidence
