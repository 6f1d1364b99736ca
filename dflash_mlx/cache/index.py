"""Finding the cached token sequences that share the longest prefix with a prompt.

Sequences are indexed by the chained hashes of their block-aligned prefixes (``BLOCK`` tokens per
block: hash k covers the first k blocks), so a lookup costs one hash per block of the prompt and a
few comparisons, however many sequences are cached; a linear scan compares the prompt with every
one (benchmarks/results/prefix_lookup.json). Hashes only narrow the candidates: every prefix length
returned is counted token by token, so a collision can cost a hit, never return a wrong one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable

BLOCK = 16
_ROOT = 0  # the chain hash of the empty prefix


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """The number of leading tokens ``a`` and ``b`` share; ``start``: a length they are believed to share."""
    if a[:start] != b[:start]:
        start = 0
    n, i = min(len(a), len(b)), start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _chain(tokens: list[int]) -> list[int]:
    """Hash k (k = 0.. len // BLOCK) covers the first k blocks of ``tokens``."""
    hashes = [_ROOT]
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        hashes.append(hash((hashes[-1], tuple(tokens[end - BLOCK : end]))))
    return hashes


class PrefixIndex:
    """Keys of token sequences, by prefix."""

    def __init__(self):
        self.tokens: dict[Hashable, list[int]] = {}
        self._sharing: dict[int, set] = defaultdict(set)  # chain hash -> keys whose sequences have that prefix
        self._ending: dict[int, set] = defaultdict(set)  # chain hash of a sequence's last whole block -> keys

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.tokens

    def add(self, key: Hashable, tokens: list[int]) -> None:
        self.remove(key)
        self.tokens[key] = tokens
        chain = _chain(tokens)
        for h in chain[1:]:
            self._sharing[h].add(key)
        self._ending[chain[-1]].add(key)

    def remove(self, key: Hashable) -> None:
        tokens = self.tokens.pop(key, None)
        if tokens is None:
            return
        chain = _chain(tokens)
        for h in chain[1:]:
            self._discard(self._sharing, h, key)
        self._discard(self._ending, chain[-1], key)

    @staticmethod
    def _discard(table: dict[int, set], h: int, key: Hashable) -> None:
        keys = table.get(h)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del table[h]

    def longest(self, prompt: list[int], usable: Callable[[int, int], bool]) -> tuple[int, Hashable] | None:
        """(n, key) of the sequence that serves the most prompt tokens: n is the common prefix, at most
        ``len(prompt) - 1`` (a prompt token is left to prefill: its logits start the generation), and
        ``usable(n, len(sequence))`` must hold. None if no sequence serves any."""
        chain, seen = _chain(prompt), set()
        # Deepest shared block first: any usable sequence there beats every shallower one.
        for level in range(len(chain) - 1, -1, -1):
            keys = self._sharing.get(chain[level], ()) if level else list(self.tokens)
            best = None
            for key in keys:
                if key in seen:
                    continue
                seen.add(key)
                tokens = self.tokens[key]
                n = min(common_prefix(tokens, prompt, level * BLOCK), len(prompt) - 1)
                if usable(n, len(tokens)) and (best is None or n > best[0]):
                    best = (n, key)
            if best is not None:
                return best
        return None

    def prefixes(self, tokens: list[int]) -> list[Hashable]:
        """Keys of the sequences that ``tokens`` starts with (itself included)."""
        found = []
        for h in _chain(tokens):
            for key in self._ending.get(h, ()):
                t = self.tokens[key]
                if len(t) <= len(tokens) and tokens[: len(t)] == t:
                    found.append(key)
        return found
