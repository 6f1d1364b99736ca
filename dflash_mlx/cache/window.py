"""Bounded context caches of the drafter (full-attention layers use mlx_lm's ``KVCache``).

Every drafter forward puts its new context rows and then the block's rows into a
layer's cache and trims the block off afterwards, so ``offset`` is always the
number of context positions seen and new rows get their true absolute RoPE
position. Rows are kept in position order and end at ``offset - 1``: the
attention masks by row index (kernels.block_attention_twin), which is then the
mask by position.
"""

from __future__ import annotations

import mlx.core as mx


class ContextWindowCache:
    """Drafter context K/V bounded to the first ``keep`` and the last ``recent`` rows.

    Only storage is bounded. Rows dropped from the middle change what the
    drafter sees (its acceptance), never the committed output.
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


class SlidingWindowCache(ContextWindowCache):
    """Context K/V of a sliding-window layer: the last ``window - 1`` rows, in position order.

    Block row i sits at ``offset + i`` and sees context positions after
    ``offset + i - window``, so the last ``window - 1`` rows are all any row can
    see. (mlx_lm's ``RotatingKVCache`` would hold the same rows, but in ring
    order once it wraps, which an index-based mask misreads.)
    """

    def __init__(self, window: int):
        super().__init__(keep=0, recent=window - 1)

    def skip(self, n: int) -> None:
        """Advance past ``n`` context positions without storing them.

        Called only when the new rows alone fill the window, so every stored row
        is out of reach too.
        """
        self.keys = self.values = None
        self.offset += n
