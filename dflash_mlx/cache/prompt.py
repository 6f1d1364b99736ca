"""Prompt caches of the batch engine: a request that extends an earlier one prefills only what is new.

The next turn of a chat, or an agent's next call after a tool result, repeats the whole
conversation so far. When a request leaves the engine (finished or cancelled) its row's caches are
kept, with the tokens they hold; a new request whose prompt starts with those tokens starts from a
copy of them, trimmed to the common prefix. Ragged caches trim by lowering a length, so any prefix
can be reused; targets with recurrent layers (Gated DeltaNet) cannot be trimmed back and keep none.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ragged import RaggedKVCache


@dataclass
class _Entry:
    tokens: list[int]  # the tokens whose keys and values the caches hold, in order
    cache: list[RaggedKVCache]
    draft_cache: list[RaggedKVCache]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """The caches of the last ``size`` requests that left, newest last."""

    def __init__(self, size: int):
        self.size = size
        self.entries: list[_Entry] = []

    def save(self, tokens: list[int], cache: list[RaggedKVCache], draft_cache: list[RaggedKVCache], row: int) -> None:
        """Keep row ``row`` of the caches of a request whose tokens (prompt and output) are ``tokens``."""
        if not self.size:
            return
        held = min(c.lengths[row] for c in cache + draft_cache)
        if not held:
            return
        entry = _Entry(tokens[:held], [c.take(row, held) for c in cache], [c.take(row, held) for c in draft_cache])
        # An entry whose tokens the new one extends has nothing more to give.
        kept = [e for e in self.entries if entry.tokens[: len(e.tokens)] != e.tokens]
        self.entries = (kept + [entry])[-self.size :]

    def fetch(self, prompt: list[int]) -> tuple[int, list[RaggedKVCache], list[RaggedKVCache]] | None:
        """(n, caches holding the first n prompt tokens) from the entry sharing the longest prefix;
        at least one prompt token is left to prefill (its logits start the generation)."""
        shared, best = max(((_common_prefix(e.tokens, prompt), e) for e in self.entries), key=lambda x: x[0],
                           default=(0, None))
        n = min(shared, len(prompt) - 1)
        if n < 1:
            return None
        return n, [c.take(0, n) for c in best.cache], [c.take(0, n) for c in best.draft_cache]
