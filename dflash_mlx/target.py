"""Adapter around an mlx_lm model: hidden-state capture, shared embedding and head.

mlx_lm models return only logits. The adapter swaps thin taps into
``model.layers`` for the duration of one call and restores the originals after,
so the same model object stays untouched (and as fast) for plain mlx_lm use.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cached_property
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .errors import DFlashError
from .cache.ragged import RaggedKVCache
from .cache.rollback import CachePolicy

# mlx_lm's Gemma models scale token embeddings by sqrt(hidden_size) inside the
# forward (Gemma 3 after rounding the scale to bf16, as HF does); the drafter's
# block input is the scaled embedding, what the target's first layer sees.
_BF16_SQRT_H_EMBEDDING = {"gemma3", "gemma3_text"}
_SQRT_H_EMBEDDING = {"gemma", "gemma2"}
# Most pads a batched prefill forward may hold, as a share of its tokens (``even_groups``).
PREFILL_PADDING = 0.25


class _Around:
    """A stand-in for one of ``model.layers`` for the duration of a call."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __getattr__(self, name):
        # Models read per-layer attributes (e.g. ``use_sliding``) while iterating.
        return getattr(self.layer, name)


class _Tap(_Around):
    """Calls a layer and records its output hidden state."""

    def __init__(self, layer: nn.Module, sink: list):
        super().__init__(layer)
        self.sink = sink

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.sink.append(out[0] if isinstance(out, tuple) else out)
        return out


class _FromColumn(_Around):
    """Calls the last layer on the columns before ``start`` and then on the rest, as two forwards
    would: nothing reads its output before ``start``, so MLX computes only their keys and values
    there. Layers given arrays other than their mask (e.g. gemma4's shared keys) run whole."""

    def __init__(self, layer: nn.Module, start: int):
        super().__init__(layer)
        self.start = start

    def __call__(self, x: mx.array, *args, **kwargs):
        n, s = x.shape[1], self.start
        mask = args[0] if args else kwargs.get("mask")
        arrays = [v for v in (*args, *kwargs.values()) if isinstance(v, mx.array)]
        if any(v is not mask for v in arrays) or (arrays and mask.shape[-2] != n):
            return self.layer(x, *args, **kwargs)
        # An array mask (..., n, keys) splits by queries; its keys end n - s earlier for the first part.
        first, rest = (mask[..., :s, : mask.shape[-1] - (n - s)], mask[..., s:, :]) if arrays else (mask, mask)

        def call(part: mx.array, m):
            if args:
                return self.layer(part, m, *args[1:], **kwargs)
            return self.layer(part, **({**kwargs, "mask": m} if "mask" in kwargs else kwargs))

        call(x[:, :s], first)
        out = call(x[:, s:], rest)
        if isinstance(out, tuple):
            return (mx.concatenate([x[:, :s], out[0]], axis=1), *out[1:])
        return mx.concatenate([x[:, :s], out], axis=1)


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
                "with the drafter (supported: mlx_lm decoders that keep them, as Llama, Qwen, Gemma and Mistral do)"
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
    def _tail(self) -> int | None:
        """The layer a scored forward runs from its first scored column (``_FromColumn``): the
        model's last, if this process holds it, unless the drafter taps it or it is recurrent."""
        last = len(self.layers) - 1
        if last == getattr(self.args, "num_hidden_layers", 0) - 1 and self.holds(last):
            return None if last in self.layer_ids or last in self.cache_policy.mixers else last
        return None

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @cached_property
    def dtype(self) -> mx.Dtype:
        """What its embeddings and hidden states are computed in (lazy: nothing is evaluated)."""
        return self.embed(mx.zeros((1, 1), mx.int32)).dtype

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

    # -- caches: one list per forward, a layer's rows along the batch axis ---------

    def make_cache(self, rows: int = 1) -> list:
        """Empty caches of ``rows`` rows (``CachePolicy.make_cache``)."""
        return self.cache_policy.make_cache(rows)

    def stretch(self, cache: list, length: int) -> None:
        """Make every row of ``cache`` (after a forward) attend like a ``length``-token context,
        its attention layers holding repeats of their keys (``RaggedKVCache.stretch``): what
        calibration times a long context's verify rows on, without a forward over that context.
        Recurrent layers keep their state, whose size does not grow with the context."""
        for c in cache:
            if isinstance(c, RaggedKVCache):
                c.stretch(length)

    def rollback(self, cache: list, drops: int | list[int]) -> None:
        """Drop the last ``drops[r]`` positions of row r (its rejected proposals) from the last
        forward on ``cache``; an int drops as many from every row."""
        if isinstance(drops, int):
            drops = [drops] * self.rows(cache)
        self.cache_policy.rollback(cache, drops)

    def rows(self, cache: list) -> int:
        return len(self.lengths(cache))

    def lengths(self, cache: list) -> list[int]:
        """Tokens each row of ``cache`` holds."""
        return next(c.lengths for c in cache if isinstance(c, RaggedKVCache))

    def join(self, cache: list, *others: list) -> None:
        """Append the rows of ``others`` after those of ``cache``, in order (``others`` are used up)."""
        for i, c in enumerate(cache):
            if isinstance(c, RaggedKVCache):
                c.extend(*(o[i] for o in others))
            else:  # recurrent states: a row's is the same size at any length
                for o in others:
                    c.extend(o[i])

    def keep(self, cache: list, rows: list[int]) -> None:
        """Keep only the rows ``rows``, in that order."""
        for c in cache:
            c.filter(rows)

    def take(self, cache: list, row: int, length: int) -> list | None:
        """One-row caches holding row ``row``'s first ``length`` positions (a copy); None where a
        recurrent layer's state is not the one after exactly ``length`` tokens."""
        if self.cache_policy.mixers and length != self.lengths(cache)[row]:
            return None
        return [c.take(row, length) if isinstance(c, RaggedKVCache) else c.extract(row) for c in cache]

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
        with self._tapped() as sinks, self._scoring(logits_at, cache is not None):
            logits = self.model(tokens, cache=cache)
        if logits_at is not None and self._norm_owner is None:
            logits = logits[mx.arange(len(logits_at)), mx.array(logits_at)][:, None]
        return logits, self._hidden({i: sink[0] for i, sink in sinks.items()}, tokens, cache)

    @contextmanager
    def _scoring(self, columns: list[int] | None, cached: bool) -> Iterator[None]:
        # The head is the largest matmul of a prefill (49,152 x 576 per position for SmolLM2):
        # batched prompts need one position per row scored, not every padded position. So is the
        # last layer's output: mlx_lm's prefill scores nothing, so MLX computes only that layer's
        # keys and values; scoring a chunk's last token would cost the layer at every position
        # without ``_FromColumn``, which needs a cache to carry the keys from its first part on.
        if columns is None:
            yield
            return
        swapped = []
        if self._norm_owner is not None:
            swapped.append((self._norm_owner, "norm", _AtColumns(self.final_norm, columns)))
        if cached and self._tail is not None and min(columns) > 0:
            swapped.append((self.layers, self._tail, _FromColumn(self.layers[self._tail], min(columns))))
        originals = [(owner, key, owner[key]) for owner, key, _ in swapped]
        for owner, key, new in swapped:
            owner[key] = new
        try:
            yield
        finally:
            for owner, key, old in originals:
                owner[key] = old

    def _hidden(self, taps: dict[int, mx.array], tokens: mx.array, cache: list) -> mx.array:
        """The drafter's input from this forward's taps; a sharded target gathers them here."""
        return mx.concatenate([taps[i] for i in self.layer_ids], axis=-1)

    def prefill(self, prompt: mx.array, cache: list, step_size: int = 2048) -> tuple[mx.array, mx.array]:
        """One row's prompt through the target in chunks of ``step_size``, as mlx_lm does: the last
        row's logits (1, V) and every prompt row's hidden state (1, P, k*H)."""
        tokens, hidden = prompt.tolist(), []
        for start in range(0, len(tokens), step_size):
            logits, h = self.prefill_rows([cache], [tokens[start : start + step_size]])[0]
            hidden.append(h)
            mx.eval(h, [c.state for c in cache])
        return logits, mx.concatenate(hidden, axis=1)

    def prefill_rows(self, caches: list[list], chunks: list[list[int]]) -> list[tuple[mx.array, mx.array]]:
        """One chunk of prompt per request through one forward: for each (one-row caches, tokens),
        the last token's logits (1, V) and the tokens' hidden states (1, n, k*H); each list of
        caches is extended in place. Not undoable: recording a long chunk's projections would hold
        them in memory.

        The rows are stacked into one ragged cache, each chunk right-padded to the longest (attention
        is causal, so no prompt token sees a pad, and each row's pads are trimmed off after), then
        split back. Chunks of uneven lengths go in several forwards, so that pads stay under a
        quarter of the tokens (``even_groups``): a request whose prompt the prompt cache holds but
        for its last token, padded to a new request's 100 tokens, would cost 100 tokens. Recurrent
        layers would run the pads through their state, so those targets prefill one request at a
        time.
        """
        if len(chunks) > 1 and self.cache_policy.mixers:
            return [self.prefill_rows([c], [t])[0] for c, t in zip(caches, chunks)]
        lengths = [len(tokens) for tokens in chunks]
        groups = even_groups(lengths)
        if len(groups) > 1:
            outputs = [None] * len(chunks)
            for group in groups:
                for i, out in zip(group, self.prefill_rows([caches[i] for i in group], [chunks[i] for i in group])):
                    outputs[i] = out
            return outputs
        width = max(lengths)
        rows = mx.array([tokens + [0] * (width - len(tokens)) for tokens in chunks], mx.int32)
        joint = caches[0]
        if len(chunks) > 1:
            joint = self.make_cache(0)
            self.join(joint, *caches)
        logits, hidden = self._forward(rows, joint, [n - 1 for n in lengths])
        if len(chunks) > 1:
            self.rollback(joint, [width - n for n in lengths])  # attention only: no recurrent layers here
            held = self.lengths(joint)
            for r, cache in enumerate(caches):
                cache[:] = self.take(joint, r, held[r])
        return [(logits[r : r + 1, 0], hidden[r : r + 1, :n]) for r, n in enumerate(lengths)]


def even_groups(lengths: list[int], padding: float = PREFILL_PADDING) -> list[list[int]]:
    """Indices of ``lengths`` in groups of one forward each, longest first: a group takes the next
    longest row while its pads (each row padded to the group's longest) stay within ``padding``
    times its tokens."""
    groups: list[list[int]] = []
    tokens = 0  # of the last group
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= (1 + padding) * (tokens + lengths[i]):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens = lengths[i]
    return groups


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
