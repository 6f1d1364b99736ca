"""Exact rollback of a target's cache after a partly rejected block.

The verify forward appends all ``B`` block rows to every layer's cache; when only
``n + 1`` of them are committed, each cache must end exactly where plain
decoding of the committed tokens would leave it. How depends on the cache type:

- Attention layers, sliding-window ones included, hold ``RaggedKVCache``: every row
  of every row kept (a sliding window is a mask by position), so dropping a row's
  newest entries only lowers its length and any tail can be undone. mlx_lm's own
  ``RotatingKVCache`` could not: its ring buffer overwrites rows that are still
  inside the window.
- ``ArraysCache`` of a Gated DeltaNet layer (``linear_attn``: qwen3_next,
  qwen3_5, qwen3_5_moe): conv and recurrent state cannot be un-applied. Before
  each forward we keep references to the two state arrays (free: mlx_lm replaces
  them, it never writes in place) and record what the layer's input projections
  returned. Rollback restores the snapshot and replays the accepted rows through
  mlx_lm's own layer with the projections played back from the record, so a
  replay costs the short conv and ``n + 1`` recurrence steps, no matmul.
  A replay costs a fraction of the verify forward (benchmarks/bench_rollback.py);
  re-running the target on the accepted rows instead costs most of one. Keeping every per-step recurrent
  state would make rollback free but costs ``B * Hv * Dv * Dk`` fp32 per layer
  (Qwen3-Next-80B, 36 such layers of 32 x 128 x 128: 1.2 GB at B = 16, and it
  needs a recurrence of our own); the record holds ``B`` projection rows
  (about 14 MB there in bf16).

Everything is per instance: model classes are never patched. The layer and
cache attributes this relies on are checked when the policy is built, so an
mlx_lm release that changes them fails at load with a clear error instead of
decoding wrong tokens.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack, contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..errors import DFlashError
from .ragged import RaggedKVCache

SUPPORTED = (
    "attention (KVCache), sliding-window (RotatingKVCache, keep=0) and Gated DeltaNet "
    "(qwen3_next, qwen3_5) layers"
)


class _Projection:
    """Stands in for one input projection of a recurrent layer.

    Recording: calls the real projection and keeps its input and output.
    Playback: returns the first rows of the recorded output, skipping the matmul.
    """

    def __init__(self, module: nn.Module, record: dict[str, tuple[mx.array, mx.array]], name: str, rows: int = 0):
        self.module, self.record, self.name, self.rows = module, record, name, rows

    def __call__(self, x: mx.array) -> mx.array:
        if self.rows:
            return self.record[self.name][1][:, : self.rows]
        y = self.module(x)
        self.record[self.name] = (x, y)
        return y


@contextmanager
def _swapped(mixer: nn.Module, names: list[str], record: dict, rows: int = 0) -> Iterator[None]:
    originals = {name: mixer[name] for name in names}
    for name, module in originals.items():
        mixer[name] = _Projection(module, record, name, rows)
    try:
        yield
    finally:
        for name, module in originals.items():
            mixer[name] = module


def _projection_names(mixer: nn.Module) -> list[str]:
    return [k for k, v in mixer.items() if k.startswith("in_proj") and isinstance(v, nn.Module)]


def _check_gated_deltanet(layer_index: int, layer: nn.Module, model_type: str) -> nn.Module:
    """The Gated DeltaNet mixer of ``layer``, or a DFlashError naming what changed."""
    mixer = layer.get("linear_attn") if isinstance(layer, nn.Module) else None
    if mixer is None:
        raise DFlashError(
            f"unsupported target architecture {model_type!r}: layer {layer_index} keeps a recurrent "
            f"state (ArraysCache) that DFlash cannot roll back; supported: {SUPPORTED}"
        )
    params = list(inspect.signature(mixer.__call__).parameters)
    if (
        params[:3] != ["inputs", "mask", "cache"]
        or not _projection_names(mixer)
        or "conv1d" not in mixer
        or not isinstance(getattr(mixer, "conv_kernel_size", None), int)
    ):
        raise DFlashError(
            f"mlx_lm {mlx_lm.__version__} changed the Gated DeltaNet layer of {model_type!r} "
            f"({type(mixer).__name__}: expected __call__(inputs, mask, cache), in_proj* "
            "projections and conv1d): DFlash's rollback needs updating; install the "
            "mlx-lm version dflash-mlx pins"
        )
    return mixer


class CachePolicy:
    """Per-layer rollback for one target model, chosen from its mlx_lm cache types."""

    def __init__(self, model: nn.Module, layers: list, model_type: str):
        self.model = model
        self.model_type = model_type
        # layer index -> Gated DeltaNet mixer, for ArraysCache layers
        self.mixers: dict[int, nn.Module] = {}
        # layer index -> window, for RotatingKVCache layers (attention masked by position)
        self.windows: dict[int, int] = {}
        for i, c in enumerate(self._model_cache()):
            if type(c) is RotatingKVCache:
                if getattr(c, "keep", None) != 0 or not isinstance(getattr(c, "max_size", None), int):
                    raise DFlashError(
                        f"unsupported target architecture {model_type!r}: layer {i} uses a rotating "
                        f"cache that keeps its first {getattr(c, 'keep', '?')} tokens (attention "
                        f"sinks), which DFlash cannot roll back; supported: {SUPPORTED}"
                    )
                self.windows[i] = c.max_size
            elif type(c) is ArraysCache:
                self.mixers[i] = _check_gated_deltanet(i, layers[i], model_type)
            elif isinstance(c, RotatingKVCache) or not c.is_trimmable():
                raise DFlashError(
                    f"unsupported target architecture {model_type!r}: layer {i} uses "
                    f"{type(c).__name__}, which DFlash cannot roll back after a rejected block; "
                    f"supported: {SUPPORTED}"
                )
        # Why the batch engine must serve this target one request at a time, if it must.
        self.batch_refusal = next(
            (f"mlx_lm's {type(m).__name__} of {model_type!r} ignores per-row lengths, which a "
             "batched rollback needs" for m in self.mixers.values()
             if "cache.lengths" not in inspect.getsource(type(m).__call__)),
            None,
        )
        # Whether rollback reaches only into the last forward; a sharded target sets it
        # when any rank holds such layers, so that every rank refuses the same rollbacks.
        self.restricted = bool(self.mixers)
        self._records: list[tuple[int, ArraysCache, tuple, dict]] = []
        self._rows = 0
        self._cache: list | None = None

    def _model_cache(self) -> list:
        make = getattr(self.model, "make_cache", None)
        return make() if make is not None else [KVCache() for _ in self.model.layers]

    def make_cache(self, rows: int = 1) -> list:
        """Caches of ``rows`` rows, joined with others along the batch axis.

        Attention layers get ``RaggedKVCache`` (each row trims its own rejected
        tail); Gated DeltaNet layers keep mlx_lm's ``ArraysCache``, whose batched
        form ``rollback`` replays per row.
        """
        cache = self._model_cache()
        return [c if i in self.mixers else RaggedKVCache(rows, self.windows.get(i)) for i, c in enumerate(cache)]

    @contextmanager
    def undoable(self, cache: list, rows: int) -> Iterator[None]:
        """Run one forward of ``rows`` tokens so that ``rollback`` can undo its tail."""
        self._records, self._rows, self._cache = [], rows, cache
        with ExitStack() as stack:
            for i, mixer in self.mixers.items():
                record: dict = {}
                self._records.append((i, cache[i], (cache[i][0], cache[i][1]), record))
                stack.enter_context(_swapped(mixer, _projection_names(mixer), record))
            yield

    def forget(self) -> None:
        """The next rollback may not reach into the previous forward (e.g. prefill)."""
        self._records, self._rows, self._cache = [], 0, None

    def rollback(self, cache: list, drops: list[int]) -> None:
        """Drop the last ``drops[r]`` rows of row r, all from the last undoable forward on ``cache``."""
        if self.restricted and (cache is not self._cache or max(drops) > self._rows):
            raise DFlashError(
                f"cannot roll back {max(drops)} tokens on a {self.model_type!r} target: its recurrent "
                f"layers can only drop the {self._rows} rows the last forward on this cache added"
            )
        if any(drops):  # a block accepted whole leaves every state as it is
            for i, c in enumerate(cache):
                if i not in self.mixers:
                    c.trim_rows(drops)
            self._replay([self._rows - d for d in drops])
        self.forget()

    def _replay(self, keep: list[int]) -> None:
        """Restore each recurrent layer's state from before the last forward, then run
        its first ``keep[r]`` rows again (row r; one ``keep`` for all rows alike)."""
        for i, c, (conv, state), record in self._records:
            c[0], c[1] = conv, state
            replay(self.mixers[i], c, record, keep)


def replay(mixer: nn.Module, cache: ArraysCache, record: dict, keep: list[int]) -> None:
    """Advance a Gated DeltaNet layer's state ``cache`` by the first ``keep[r]`` rows of row r
    of ``record`` (projection name -> (its input, its output), (R, L, ...)), through mlx_lm's
    own layer with the projections played back."""
    rows = max(keep)
    if not rows:
        return
    mask = None
    if min(keep) < rows:
        # mlx_lm's batched form: masked steps leave the recurrent state as it
        # was, and the conv state is read at each row's own length.
        cache.lengths = mx.array(keep)
        mask = mx.arange(rows) < cache.lengths[:, None]
    # Only the cache updates are evaluated later: the replayed output,
    # its gate projection and out_proj stay unused graph nodes.
    x = next(iter(record.values()))[0][:, :rows]
    with _swapped(mixer, list(record), record, rows=rows):
        mixer(x, mask, cache)
    cache.lengths = None
