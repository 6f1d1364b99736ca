"""The prompt cache: a request that extends an earlier one prefills only what is new.

The next turn of a chat, or an agent's next call after a tool result, repeats the whole
conversation so far. When a request leaves the engine (finished or cancelled) its row's caches are
kept with the tokens they hold; a new request whose prompt starts with some of those tokens starts
from a copy of them, cut to the common prefix. Attention layers cut anywhere; a recurrent layer
(Gated DeltaNet) holds the state after all of an entry's tokens, so its entries serve only prompts
that extend them whole (``Target.take``). Entries are evicted least recently used first, by count
and by bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..target import Target


@dataclass
class _Entry:
    tokens: list[int]  # the tokens whose keys and values the caches hold, in order
    cache: list  # one-row target caches (Target.take)
    draft_cache: list  # one-row drafter context caches

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache + self.draft_cache)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """Caches of requests that left, for the requests that follow. ``max_entries``/``max_bytes``
    bound what is kept (None: no bound of that kind)."""

    def __init__(self, max_entries: int | None = 4, max_bytes: int | None = None):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._ids = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def save(self, tokens: list[int], cache: list, draft_cache: list) -> None:
        """Keep one-row caches holding ``tokens`` (a request's prompt and output so far)."""
        if not tokens or self.max_entries == 0:
            return
        # An entry whose tokens the new one extends has nothing more to give.
        for key, e in list(self.entries.items()):
            if tokens[: len(e.tokens)] == e.tokens:
                del self.entries[key]
        self._ids += 1
        self.entries[self._ids] = _Entry(list(tokens), cache, draft_cache)
        while self.entries and ((self.max_entries is not None and len(self.entries) > self.max_entries)
                                or (self.max_bytes is not None and self.nbytes > self.max_bytes)):
            self.entries.popitem(last=False)

    def fetch(self, prompt: list[int], target: Target) -> tuple[int, list, list] | None:
        """(n, caches holding the first n prompt tokens), copied from the entry that serves the
        longest prefix; at least one prompt token is left to prefill (its logits start the
        generation). None when no entry serves one."""
        best: tuple[int, int, Any] | None = None
        for key, e in self.entries.items():
            n = min(common_prefix(e.tokens, prompt), len(prompt) - 1)
            if n >= 1 and (best is None or n > best[0]):
                cache = target.take(e.cache, 0, n)
                if cache is not None:
                    best = (n, key, cache)
        if best is None:
            return None
        n, key, cache = best
        self.entries.move_to_end(key)
        return n, cache, [c.take(0, n) for c in self.entries[key].draft_cache]
