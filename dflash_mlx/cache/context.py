"""The drafter's context caches: per layer, the K/V of the target hidden rows it has taken in.

Every drafter forward puts each row's new context rows, then the block's rows, into a layer's cache
(``update_and_fetch``) and trims the block off afterwards (``trim``), so only context persists. Rows
are ragged as in ``RaggedKVCache``: each starts at index 0 and ends at its own length, and a forward's
context arrives left-padded to a common count (``prepare``).

A window bounds what is stored: the first ``keep`` rows (a sink) and the last ``recent`` ones. RoPE
positions keep counting over the rows dropped between the two (``positions``), so new rows get their
true absolute positions. Sliding-window layers store the last ``sliding_window - 1`` rows, all that
any block row can see. Stored rows stay in position order and the only gap is at index ``keep``, so
attention masks by index are masks by position: within the stored tail, index distance is position
distance. Rows dropped from the middle change what the drafter sees (its acceptance), never the
committed output.
"""

from __future__ import annotations

import mlx.core as mx

from .ragged import RaggedKVCache


class ContextCache(RaggedKVCache):
    def __init__(self, rows: int = 1, keep: int = 0, recent: int | None = None):
        super().__init__(rows)
        self.keep, self.recent = keep, recent
        self.dropped = [0] * rows  # positions no longer stored (between the sink and the tail), per row

    @property
    def positions(self) -> list[int]:
        """Per row, the absolute position of its next context row."""
        return [n + d for n, d in zip(self.lengths, self.dropped)]

    def trim(self, n: int) -> int:
        """Drop the last ``n`` rows of every row (a forward's block), then what the window no longer holds."""
        super().trim(n)
        self._bound()
        return n

    def skip(self, counts: list[int]) -> None:
        """Advance row r past ``counts[r]`` positions without storing them: rows the window would drop
        at once (the middle of a long prompt). Only past a full sink, so the gap stays at ``keep``."""
        assert all(not c or n >= self.keep for c, n in zip(counts, self.lengths)), "skip into the sink"
        self.dropped = [d + c for d, c in zip(self.dropped, counts)]
        self._offset = None

    def _bound(self) -> None:
        if self.recent is None or self.keys is None:
            return
        limit = self.keep + self.recent
        excess = [max(n - limit, 0) for n in self.lengths]
        if not any(excess):
            return
        if len(excess) == 1:
            # Compacted with room for the next rows: a full window drops rows at every step, and an
            # exact-size buffer would be copied again to grow at the next one.
            tail = slice(self.keep + excess[0], self.lengths[0])
            self.keys, self.values = (
                mx.concatenate([x[:, :, : self.keep], x[:, :, tail], mx.zeros((*x.shape[:2], self.step, x.shape[3]), x.dtype)],
                               axis=2)
                for x in (self.keys, self.values))
        else:  # each row keeps its sink and its own last ``recent`` rows, moved up to the sink
            index = mx.array([list(range(self.keep)) + list(range(self.keep + e, self.keep + e + self.recent))
                              for e in excess]).reshape(len(excess), 1, limit, 1)
            self.keys = mx.take_along_axis(self.keys, index, axis=2)
            self.values = mx.take_along_axis(self.values, index, axis=2)
        self.dropped = [d + e for d, e in zip(self.dropped, excess)]
        self._set_lengths([min(n, limit) for n in self.lengths])

    def holds_window(self, row: int, length: int) -> bool:
        """Whether row ``row`` cut back to ``length`` (``take``) holds every row a prefill to
        ``length`` leaves: not when the rows its window needs there were dropped as it grew."""
        d = self.dropped[row]
        return not d or self.recent is None or length <= self.keep or length - self.recent >= self.keep + d

    def take(self, row: int, length: int) -> "ContextCache":
        """A one-row cache holding row ``row``'s context before position ``length``."""
        d = self.dropped[row]
        stored = min(length, self.lengths[row]) if not d or length <= self.keep else max(self.keep, length - d)
        out = ContextCache(1, self.keep, self.recent)
        if self.keys is not None:
            out.keys, out.values = self.keys[row : row + 1, :, :stored], self.values[row : row + 1, :, :stored]
        out._set_lengths([stored])
        out.dropped = [min(length, self.positions[row]) - stored]
        return out

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self.dropped = [self.dropped[i] for i in keep]

    def extend(self, *others: "ContextCache") -> None:
        dropped = [d for c in (self, *others) for d in c.dropped]
        super().extend(*others)
        self.dropped = dropped
