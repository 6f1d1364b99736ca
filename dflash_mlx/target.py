"""Adapter around an mlx_lm model: hidden-state capture, shared embedding and head.

mlx_lm models return only logits. The adapter swaps thin taps into
``model.layers`` for the duration of one call and restores the originals after,
so the same model object stays untouched (and as fast) for plain mlx_lm use.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .errors import DFlashError
from .cache.rollback import CachePolicy

# mlx_lm's Gemma models scale token embeddings by sqrt(hidden_size) inside the
# forward (Gemma 3 after rounding the scale to bf16, as HF does); the drafter's
# block input is the scaled embedding, what the target's first layer sees.
_BF16_SQRT_H_EMBEDDING = {"gemma3", "gemma3_text"}
_SQRT_H_EMBEDDING = {"gemma", "gemma2"}


class _Tap:
    """Calls a layer and records its output hidden state."""

    def __init__(self, layer: nn.Module, sink: list):
        self.layer, self.sink = layer, sink

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.sink.append(out[0] if isinstance(out, tuple) else out)
        return out

    def __getattr__(self, name):
        # Models read per-layer attributes (e.g. ``use_sliding``) while iterating.
        return getattr(self.layer, name)


class _AtColumns:
    """Calls the final norm on one column per row only, so that the head scores just those."""

    def __init__(self, norm: nn.Module, columns: list[int]):
        self.norm, self.rows, self.columns = norm, mx.arange(len(columns)), mx.array(columns)

    def __call__(self, h: mx.array) -> mx.array:
        return self.norm(h[self.rows, self.columns][:, None])


def _owner(model: nn.Module, name: str) -> nn.Module | None:
    """The module holding ``name``: the model or its text backbone (``model.model``, ``language_model.model``)."""
    lm = getattr(model, "language_model", None)
    for owner in (model, getattr(model, "model", None), lm, getattr(lm, "model", None)):
        if owner is not None and name in owner:
            return owner
    return None


def _find(model: nn.Module, name: str) -> Any:
    owner = _owner(model, name)
    return None if owner is None else owner[name]


class Target:
    """The verifier: an mlx_lm model plus the views of it the drafter needs."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model = model
        # Multimodal wrappers (qwen3_5, gemma3) keep the text config on language_model.
        self.args = getattr(getattr(model, "language_model", model), "args", model.args)
        self.layer_ids = list(layer_ids)
        # The list the forward iterates (qwen3_5's ``model.layers`` is a fresh slice).
        layers = _find(model, "layers")
        self.layers = layers if isinstance(layers, list) else model.layers
        self.embed_tokens = _find(model, "embed_tokens")
        self._norm_owner = _owner(model, "norm")
        model_type = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
        if self.embed_tokens is None or not self.layers:
            raise DFlashError(
                f"unsupported target architecture {model_type!r}: no embed_tokens/layers to share "
                "with the drafter (supported: Llama, Qwen2, Qwen3, Mistral-style decoders)"
            )
        self.cache_policy = CachePolicy(model, model.layers, model_type)
        self.embed_scale = _embed_scale(model, model_type, self.hidden_size)
        bad = [i for i in self.layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise DFlashError(
                f"drafter target_layer_ids {bad} out of range for a target with {len(self.layers)} "
                "layers: the drafter was trained for a different target"
            )
        head = getattr(model, "lm_head", None)
        self.lm_head = head if head is not None else self.embed_tokens.as_linear
        self._head_module = head if head is not None else self.embed_tokens

    @property
    def final_norm(self) -> nn.Module | None:
        return None if self._norm_owner is None else self._norm_owner["norm"]

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        return h if self.embed_scale is None else h * self.embed_scale.astype(h.dtype)

    def head(self, rows: mx.array | None = None) -> Callable[[mx.array], mx.array]:
        """The output head, or one that scores only the token ids ``rows`` (a drafter's
        draft vocabulary): the head's rows gathered once, plain or quantized."""
        if rows is None:
            return self.lm_head
        module = self._head_module
        p = {k: v[rows] for k, v in tree_flatten(module.parameters())}
        mx.eval(p)
        if "scales" in p:
            mode = getattr(module, "mode", "affine")
            return lambda h: mx.quantized_matmul(h, p["weight"], p["scales"], p.get("biases"), True,
                                                 module.group_size, module.bits, mode)
        if "bias" in p:
            return lambda h: h @ p["weight"].T + p["bias"]
        return lambda h: h @ p["weight"].T

    def make_cache(self) -> list:
        return self.cache_policy.make_cache()

    def rollback(self, cache: list, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` positions (the rejected proposals) of the last call."""
        self.cache_policy.rollback(cache, num_tokens)

    def make_batch_cache(self, rows: int = 1) -> list:
        """Caches the batch engine joins to its batch (``CachePolicy.make_batch_cache``)."""
        return self.cache_policy.make_batch_cache(rows)

    def rollback_rows(self, cache: list, drops: list[int]) -> None:
        """Batched ``rollback``: drop the last ``drops[r]`` positions of row r."""
        self.cache_policy.rollback_rows(cache, drops)
    def holds(self, layer: int) -> bool:
        """Whether this process holds ``layer``: a pipeline stage holds only its own (mlx_lm
        leaves None before them and nothing after)."""
        return layer < len(self.layers) and self.layers[layer] is not None

    @contextmanager
    def _tapped(self) -> Iterator[dict[int, list]]:
        sinks = {i: [] for i in self.layer_ids if self.holds(i)}
        originals = {i: self.layers[i] for i in sinks}
        for i, sink in sinks.items():
            self.layers[i] = _Tap(originals[i], sink)
        try:
            yield sinks
        finally:
            for i, layer in originals.items():
                self.layers[i] = layer

    def __call__(
        self, tokens: mx.array, cache: list, logits_at: list[int] | None = None
    ) -> tuple[mx.array, mx.array]:
        """Logits (1, L, V) and captured hidden states (1, L, k*H) for ``tokens`` (1, L).

        ``rollback`` can then drop any tail of these L rows. Without a cache (a training
        pass over whole sequences) there is nothing to roll back. ``logits_at`` (one
        column per row) scores only those positions: logits (R, 1, V).
        """
        if cache is None:
            return self._forward(tokens, cache, logits_at)
        with self.cache_policy.undoable(cache, tokens.shape[1]):
            return self._forward(tokens, cache, logits_at)

    def _forward(self, tokens: mx.array, cache: list, logits_at: list[int] | None = None) -> tuple[mx.array, mx.array]:
        with self._tapped() as sinks, self._scoring(logits_at):
            logits = self.model(tokens, cache=cache)
        if logits_at is not None and self._norm_owner is None:
            logits = logits[mx.arange(len(logits_at)), mx.array(logits_at)][:, None]
        return logits, self._hidden({i: sink[0] for i, sink in sinks.items()}, tokens, cache)

    @contextmanager
    def _scoring(self, columns: list[int] | None) -> Iterator[None]:
        # The head is the largest matmul of a prefill (49,152 x 576 per position for SmolLM2):
        # batched prompts need one position per row scored, not every padded position.
        if columns is None or self._norm_owner is None:
            yield
            return
        norm = self.final_norm
        self._norm_owner.norm = _AtColumns(norm, columns)
        try:
            yield
        finally:
            self._norm_owner.norm = norm

    def _hidden(self, taps: dict[int, mx.array], tokens: mx.array, cache: list) -> mx.array:
        """The drafter's input from this forward's taps; a sharded target gathers them here."""
        return mx.concatenate([taps[i] for i in self.layer_ids], axis=-1)

    def prefill(
        self, prompt: mx.array, cache: list, step_size: int = 2048, keep_rows: int | None = None
    ) -> tuple[mx.array, mx.array]:
        """Run the prompt through the target in chunks, as mlx_lm does.

        Returns the last row's logits (1, V) and the hidden states of the prompt
        rows (1, P, k*H), the drafter's first context. With ``keep_rows`` (a
        drafter whose layers all have sliding windows never sees further back)
        earlier rows are dropped as the chunks go: at most keep_rows + 1 remain.
        """
        hidden = []
        rest = prompt
        while rest.size > 1:
            chunk, rest = rest[: min(step_size, rest.size - 1)], rest[min(step_size, rest.size - 1) :]
            # Not undoable: recording a long chunk would hold its projections in memory.
            _, h = self._forward(chunk[None], cache)
            self.cache_policy.forget()
            hidden.append(h)
            if keep_rows is not None:
                h = mx.concatenate(hidden, axis=1)
                hidden = [h[:, max(h.shape[1] - keep_rows, 0) :]]
            mx.eval(hidden, [c.state for c in cache])
        logits, h = self(rest[None], cache)
        hidden.append(h)
        return logits[:, -1], mx.concatenate(hidden, axis=1)


def _embed_scale(model: nn.Module, model_type: str, hidden_size: int) -> mx.array | None:
    inner = getattr(model, "language_model", model)
    inner = getattr(inner, "model", inner)
    if isinstance(getattr(inner, "embed_scale", None), (int, float)):  # gemma4_text
        return mx.array(inner.embed_scale, mx.float32)
    if model_type in _BF16_SQRT_H_EMBEDDING:
        return mx.array(hidden_size**0.5, mx.bfloat16)
    if model_type in _SQRT_H_EMBEDDING:
        return mx.array(hidden_size**0.5, mx.float32)
    return None
