"""A batched KV cache whose rows hold different numbers of tokens.

mlx_lm's ``BatchKVCache`` left-pads rows to a common end and trims every row by
the same amount. Batched speculative decoding commits a different number of
tokens per row each step, so here every row starts at index 0 (the index of a
key is its absolute position) and ends at its own length:

- a forward writes each row's new K/V at that row's end, in one scatter;
- dropping a row's rejected proposals only lowers its length (no copy);
- the masks hide, per row, whatever lies past its end.

The same cache serves the target (``make_mask``, as mlx_lm models call it) and,
through ``cache/context.py``, the drafter, whose context rows arrive left-padded
to a common count (``prepare``) so that each row's block lands right after its
own context (its length tells the block attention where: ``kernels``).
"""

from __future__ import annotations

import mlx.core as mx


class RaggedKVCache:
    step = 256

    def __init__(self, rows: int = 1, window: int | None = None):
        # Sliding-window layers keep every row and mask by position: exact, and
        # trimming a rejected row never loses context the next query needs.
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths = [0] * rows
        self._padding: list[int] | None = None
        self._offset: int | mx.array | None = None

    @property
    def positions(self) -> list[int]:
        """Per row, the absolute position of its next token: its length, keys being at their positions."""
        return self.lengths

    @property
    def offset(self) -> int | mx.array:
        """The absolute position of the next forward's first key (RoPE offset): per row, or one
        number for a single row (what mlx_lm's own caches give, and cheaper to rotate by)."""
        if self._offset is None:
            pad = self._padding or [0] * len(self.lengths)
            offsets = [n - p for n, p in zip(self.positions, pad)]
            self._offset = offsets[0] if len(offsets) == 1 else mx.array(offsets)
        return self._offset

    def _set_lengths(self, lengths: list[int]) -> None:
        self.lengths, self._offset = lengths, None

    def prepare(self, left_padding: list[int]) -> None:
        """The next forward's first ``left_padding[r]`` rows of row r are padding, not tokens."""
        self._padding, self._offset = list(left_padding), None

    def _steps(self, size: int) -> int:
        """``size`` positions rounded up to whole steps: the capacity that holds them with room."""
        return -(-size // self.step) * self.step

    def _reserve(self, keys: mx.array, values: mx.array, size: int) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if size <= capacity:
            return
        R, H = keys.shape[:2]
        grown = self._steps(size)
        extra = [mx.zeros((R, H, grown - capacity, x.shape[3]), x.dtype) for x in (keys, values)]
        if self.keys is None:
            self.keys, self.values = extra
        else:
            self.keys = mx.concatenate([self.keys, extra[0]], axis=2)
            self.values = mx.concatenate([self.values, extra[1]], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        R, _, N, _ = keys.shape
        pad = self._padding or [0] * R
        starts = [n - p for n, p in zip(self.lengths, pad)]
        ends = [s + N for s in starts]
        end = max(ends)
        if not any(pad) and len(set(starts)) == 1:
            self._reserve(keys, values, end)
            self.keys[..., starts[0] : end, :] = keys
            self.values[..., starts[0] : end, :] = values
        else:
            # Padding rows go to a spare slot past every row's end, which no mask shows.
            self._reserve(keys, values, end + 1)
            spare = self.keys.shape[2] - 1
            index = mx.array(
                [[s + j if j >= p else spare for j in range(N)] for s, p in zip(starts, pad)]
            ).reshape(R, 1, N, 1)
            self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
            self.values = mx.put_along_axis(self.values, index, values, axis=2)
        self._padding = None
        self._set_lengths(ends)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """Causal mask of the target's next forward of ``N`` tokens per row, (R, 1, N, S)."""
        window = window_size or self.window
        if len(self.lengths) == 1 and window is None and not return_array:
            return None if N == 1 else "causal"  # one row: plain causal attention
        query = (mx.array(self.lengths)[:, None] + mx.arange(N))[..., None]
        key = mx.arange(max(self.lengths) + N)
        mask = key <= query
        if window is not None:
            mask &= key > query - window
        return mask[:, None]

    def take(self, row: int, length: int) -> "RaggedKVCache":
        """A one-row cache holding the first ``length`` tokens of row ``row``."""
        out = RaggedKVCache(1, self.window)
        if self.keys is not None:
            out.keys, out.values = self.keys[row : row + 1, :, :length], self.values[row : row + 1, :, :length]
        out._set_lengths([min(length, self.lengths[row])])
        return out

    def stretch(self, length: int) -> None:
        """Hold ``length`` positions in every row by repeating the keys and values it holds: a cache
        that attends like a context that long, for timing verify rows (the keys' values do not
        change what attention costs)."""
        held = min(self.lengths)
        reps = -(-length // held)
        self.keys, self.values = (mx.tile(x[..., :held, :], (1, 1, reps, 1))[..., :length, :] for x in (self.keys, self.values))
        self._set_lengths([length] * len(self.lengths))

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens of every row."""
        self._set_lengths([max(k - n, 0) for k in self.lengths])
        return n

    def trim_rows(self, drops: list[int]) -> None:
        """Drop the last ``drops[r]`` tokens of row r."""
        self._set_lengths([k - d for k, d in zip(self.lengths, drops)])

    def compact(self, starts: list[int], kept: list[list[int]]) -> None:
        """Of row r's tokens from ``starts[r]`` on, keep those at offsets ``kept[r]`` (ascending),
        moved to the front: row r then ends at ``starts[r] + len(kept[r])`` (a draft tree's
        accepted path, tree_verify.commit). Rows whose kept tokens already are their first ones move
        nothing."""
        if all(k == list(range(len(k))) for k in kept):  # a chain's path always is
            self._set_lengths([s + len(k) for s, k in zip(starts, kept)])
            return
        M = max(map(len, kept))
        # Past a row's new end the gather copies columns onto themselves: nothing moves there.
        source = mx.array([[s + (k[j] if j < len(k) else j) for j in range(M)] for s, k in zip(starts, kept)])
        index = source.reshape(len(kept), 1, M, 1)
        to = (mx.array(starts)[:, None] + mx.arange(M)).reshape(len(kept), 1, M, 1)
        for name in ("keys", "values"):
            rows = getattr(self, name)
            setattr(self, name, mx.put_along_axis(rows, to, mx.take_along_axis(rows, index, axis=2), axis=2))
        self._set_lengths([s + len(k) for s, k in zip(starts, kept)])

    def filter(self, keep: list[int]) -> None:
        """Keep only the rows ``keep``, in that order."""
        lengths = [self.lengths[i] for i in keep]
        if self.keys is not None:
            size = self._steps(max(lengths, default=0) + 1)
            rows = mx.array(keep)
            self.keys, self.values = self.keys[rows, :, :size], self.values[rows, :, :size]
        self._set_lengths(lengths)

    def extend(self, *others: "RaggedKVCache") -> None:
        """Append the rows of ``others`` after this cache's rows, copying the batch once (joining rows
        one at a time would copy it once per row), and leave room for the next forward as
        ``filter`` does: rows taken at their exact length (``take``) would otherwise make that
        forward grow, and so copy, the whole batch."""
        caches = (self, *others)
        held = [c for c in caches if c.keys is not None]
        if held:
            room = self._steps(max(n for c in caches for n in c.lengths) + 1)
            widest = max(c.keys.shape[2] for c in held)
            like = {name: getattr(held[0], name) for name in ("keys", "values")}
            if widest >= room:  # a batch with room: the narrower rows padded, all concatenated
                self.keys, self.values = (mx.concatenate([_widened(c, n, like[n], widest) for c in caches])
                                          for n in ("keys", "values"))
            else:  # nothing has room (rows just prefilled): each written once into a roomy batch
                self.keys, self.values = (_gathered(caches, n, like[n], room) for n in ("keys", "values"))
        self._set_lengths([n for c in caches for n in c.lengths])

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def filled(self) -> bool:
        """Whether every row ends where the arrays ``update_and_fetch`` returns end (no row is shorter)."""
        return len(set(self.lengths)) == 1

    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def _zeros(rows: int, like: mx.array, width: int) -> mx.array:
    return mx.zeros((rows, like.shape[1], width, like.shape[3]), like.dtype)


def _widened(cache: RaggedKVCache, name: str, like: mx.array, width: int) -> mx.array:
    """``cache``'s keys or values (``name``) padded to ``width`` positions; zeros shaped like
    ``like`` for a cache that holds none."""
    x = getattr(cache, name)
    if x is None:
        return _zeros(len(cache.lengths), like, width)
    if x.shape[2] == width:  # mx.pad copies even when it pads by nothing
        return x
    return mx.pad(x, [(0, 0), (0, 0), (0, width - x.shape[2]), (0, 0)])


def _gathered(caches: tuple[RaggedKVCache, ...], name: str, like: mx.array, width: int) -> mx.array:
    """The caches' keys or values (``name``) written into one zeroed array ``width`` positions wide
    (each slice assignment updates it in place)."""
    out = _zeros(sum(len(c.lengths) for c in caches), like, width)
    row = 0
    for c in caches:
        x = getattr(c, name)
        if x is not None:
            out[row : row + len(c.lengths), :, : x.shape[2]] = x
        row += len(c.lengths)
    return out
