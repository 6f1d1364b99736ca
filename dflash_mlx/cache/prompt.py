"""The prompt cache: a request that extends an earlier one prefills only what is new.

The next turn of a chat, or an agent's next call after a tool result, repeats the whole
conversation so far. When a request leaves the engine (finished or cancelled) its row's caches are
kept with the tokens they hold; a new request whose prompt starts with some of those tokens starts
from a copy of them, cut to the common prefix, whichever client or endpoint sent it, batched or
not. Attention layers cut anywhere; a recurrent layer (Gated DeltaNet) holds the state after all
of an entry's tokens, so its entries serve only prompts that extend them whole (``Layout.usable``):
for such targets the engine also saves every prompt as it finishes prefilling, so the next turn,
which extends the prompt but may render the reply differently, finds it.

Two tiers. RAM: entries least recently used first out, bounded by count and bytes; their arrays
are compact copies (``layout.materialise``). SSD (``directory``): every saved entry is also written
to a file by a background thread (``disk.py``), bounded in bytes, found again after a restart; a
RAM miss that a file serves loads it and keeps it in RAM. Lookups go through a prefix index
(``index.py``). Entries are keyed by the model pair and cache layout (``layout.py``): an engine
``bind``s the cache to its pair, and a cache bound to another pair forgets its RAM entries and
reads only that pair's files.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DFlashError
from .disk import DiskTier
from .index import PrefixIndex
from .layout import Layout, materialise, nbytes

DISK_BYTES = 10 * 2**30  # default bound of the SSD tier (and never more than half the free space)


def ram_bytes() -> int:
    """The server's default bound of the RAM tier: an eighth of physical memory, at most 8 GiB."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        physical = 16 * 2**30
    return min(8 * 2**30, physical // 8)


@dataclass
class _Entry:
    tokens: list[int]  # the tokens whose keys and values the caches hold, in order
    cache: list  # one-row target caches
    draft_cache: list  # one-row drafter context caches
    nbytes: int


class PromptCache:
    """Caches of requests that left, for the requests that follow.

    ``max_entries``/``max_bytes`` bound the RAM tier (None: no bound of that kind). ``directory``
    adds the SSD tier, bounded by ``max_disk_bytes``. Counters: ``ram_hits``, ``disk_hits``,
    ``misses``; ``nbytes`` and ``disk_bytes`` what each tier holds.
    """

    def __init__(self, max_entries: int | None = 4, max_bytes: int | None = None, directory: str | None = None,
                 max_disk_bytes: int = DISK_BYTES):
        if max_disk_bytes < 1:
            raise DFlashError(f"max_disk_bytes must be at least 1, got {max_disk_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.directory, self.max_disk_bytes = directory, max_disk_bytes
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self.index = PrefixIndex()
        self.nbytes = 0
        self.layout: Layout | None = None
        self.disk: DiskTier | None = None
        self.ram_hits = self.disk_hits = self.misses = 0
        _open.add(self)

    @property
    def disk_bytes(self) -> int:
        return self.disk.nbytes if self.disk is not None else 0

    def bind(self, model: Any, draft_window: tuple[int, int] | None = None) -> "PromptCache":
        """Serve ``model``'s requests (a ``DFlashModel`` whose drafter context is bounded by
        ``draft_window``); entries of another pair or layout are dropped from RAM and never read.
        Returns the cache."""
        layout = Layout.of(model, draft_window)
        if self.layout is None or layout.key != self.layout.key:
            self.close()
            self.entries.clear()
            self.index, self.nbytes = PrefixIndex(), 0
        self.layout = layout
        # A sharded target's caches live on every rank: a file here would hold rank 0's part only.
        if self.disk is None and self.directory is not None and not hasattr(model.target, "on_all_ranks"):
            self.disk = DiskTier(self.directory, self.max_disk_bytes, layout)
        return self

    def _layout(self) -> Layout:
        if self.layout is None:
            raise DFlashError("this PromptCache is not bound to a model: pass it to an Engine (or stream_generate), "
                              "which binds it")
        return self.layout

    def _key(self, tokens: list[int]) -> str:
        digest = hashlib.sha256(self._layout().key.encode())
        digest.update(np.asarray(tokens, np.int64).tobytes())
        return digest.hexdigest()[:32]

    def fetch(self, prompt: list[int]) -> tuple[int, list, list] | None:
        """(n, caches holding the first n prompt tokens), cut from the entry that serves the longest
        prefix; at least one prompt token is left to prefill (its logits start the generation).
        None when no entry serves one."""
        layout = self._layout()
        ram = self.index.longest(prompt, layout.usable)
        while self.disk is not None and (found := self.disk.longest(prompt)) and (ram is None or found[0] > ram[0]):
            n, key = found
            loaded = self.disk.load(key)
            if loaded is not None:
                tokens, cache, draft = loaded
                entry = _Entry(tokens, cache, draft, nbytes(cache, draft))
                self._insert(key, entry)
                return self._count(self._cut(entry, n), "disk_hits")
        if ram is None:
            self.misses += 1
            return None
        n, key = ram
        self.entries.move_to_end(key)
        if self.disk is not None and key in self.disk:
            self.disk.touch(key)
        return self._count(self._cut(self.entries[key], n), "ram_hits")

    def _count(self, cut: tuple[int, list, list] | None, tier: str) -> tuple[int, list, list] | None:
        """Count ``cut`` as a hit of ``tier`` (``ram_hits``, ``disk_hits``), or as a miss when
        nothing was left of it (``_cut``)."""
        if cut is None:
            self.misses += 1
        else:
            setattr(self, tier, getattr(self, tier) + 1)
        return cut

    def _cut(self, entry: _Entry, n: int) -> tuple[int, list, list] | None:
        """``entry`` cut to its first ``n`` tokens. A windowed drafter context dropped rows as the
        entry grew: cut back, it would hold fewer recent rows than a prefill to ``n`` leaves (same
        output, other drafts), so the cut goes back by the window's recent rows as well, and
        prefilling those tokens again fills the window exactly. None when nothing is left."""
        short = [c.recent for c in entry.draft_cache if not c.holds_window(0, n)]
        if short:
            n -= max(short)
            if n < 1:
                return None
        return n, self.layout.model.target.take(entry.cache, 0, n), [c.take(0, n) for c in entry.draft_cache]

    def save(self, tokens: list[int], cache: list, draft_cache: list) -> None:
        """Keep one-row caches holding ``tokens`` (a request's prompt and output so far, or a prompt
        just prefilled); they become compact copies, owned by the cache."""
        layout = self._layout()
        if not tokens or (self.max_entries == 0 and self.disk is None):
            return
        materialise(cache, draft_cache)
        key = self._key(tokens)
        entry = _Entry(list(tokens), cache, draft_cache, nbytes(cache, draft_cache))
        if layout.cuts:  # an entry the new one extends has nothing more to give
            for old in self.index.prefixes(entry.tokens):
                self._remove(old)
        self._insert(key, entry)
        if self.disk is not None:
            if key in self.disk:
                self.disk.touch(key)
            else:
                superseded = self.disk.prefixes(entry.tokens) if layout.cuts else []
                self.disk.put(key, entry.tokens, cache, draft_cache, superseded)

    def prefilled(self, prompt: list[int], cache: list, draft_cache: list) -> None:
        """A prompt's one-row caches as its prefill ends. Kept when a recurrent layer's state
        cannot be cut back: the next turn extends the prompt, not necessarily the reply as it will
        be rendered. An attention target's entry, saved as the request leaves, serves any prefix."""
        if not self._layout().cuts:
            self.save(prompt, self.layout.model.target.take(cache, 0, len(prompt)),
                      [c.take(0, c.positions[0]) for c in draft_cache])

    def _insert(self, key: str, entry: _Entry) -> None:
        self._remove(key)
        if self.max_entries == 0 or (self.max_bytes is not None and entry.nbytes > self.max_bytes):
            return
        self.entries[key] = entry
        self.index.add(key, entry.tokens)
        self.nbytes += entry.nbytes
        while self.entries and ((self.max_entries is not None and len(self.entries) > self.max_entries)
                                or (self.max_bytes is not None and self.nbytes > self.max_bytes)):
            self._remove(next(iter(self.entries)))

    def _remove(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.index.remove(key)
            self.nbytes -= entry.nbytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the SSD tier has written what was saved (at most ``timeout`` seconds)."""
        return self.disk.flush(timeout) if self.disk is not None else True

    def close(self, timeout: float | None = 60.0) -> None:
        """Finish the queued writes and let go of the folder (the cache can be bound again)."""
        if self.disk is not None:
            self.disk.close(timeout)
            self.disk = None


_open: "weakref.WeakSet[PromptCache]" = weakref.WeakSet()


@atexit.register
def _finish_writes() -> None:
    """Entries saved just before the interpreter exits still reach the disk (up to a bound)."""
    for cache in list(_open):
        cache.flush(30.0)
