"""Copy proposals: the continuation of the latest earlier occurrence of what was just written.

Text repeats itself: code, lists, numbers quoted from the question, an answer that loops. An
index of the prompt and the output so far, extended as tokens are committed (never rebuilt),
finds the longest earlier match of the text's last tokens; what followed it there is proposed for
the next positions. A continuation may run into the text being matched (a loop with a short
period), so it always has the length asked for.

A drafter may ship a corpus: the target's own answers to its training prompts (``corpus.npy``
beside its weights, written by ``dflash-mlx train``). Its index is built once and shared; where the
text's end matches the corpus for longer than anything earlier in the text, what followed it in the
corpus is proposed instead (retrieval as in REST, He et al. 2023). Answers reuse their phrasing.

Copied tokens are verified like drafted ones, so the output never changes: greedy keeps the
target's argmax, and under sampling a copied token is drawn from a point mass (q = 1 at the copied
id): it is accepted with probability p(id), and on rejection the residual is p without that id.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

MIN_MATCH = 2  # tokens of context a copy must match (the index key)
MAX_MATCH = 32  # longer matches are not told apart
CANDIDATES = 8  # most recent occurrences of the key compared for the longest match
CORPUS_MIN_MATCH = 6  # shorter corpus matches guess too rarely to pay for their verify rows (README)
CORPUS_FILE = "corpus.npy"  # a drafter folder's corpus: token ids of the target's answers, one run


@dataclass(frozen=True)
class Copy:
    """A suggested continuation and how many tokens of context it matched."""

    tokens: list[int]
    match: int
    from_corpus: bool = False

    def cut(self, length: int) -> "Copy":
        return replace(self, tokens=self.tokens[:length])


class CopyIndex:
    """An incremental index of every ``key_length``-gram of the text, by where it ended; with a
    ``corpus`` (another, fixed index), matches in it are proposed too."""

    def __init__(self, tokens: list[int], corpus: "CopyIndex | None" = None, key_length: int = MIN_MATCH):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # key -> positions the key ended before
        self.corpus, self.key_length = corpus, key_length
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Add committed tokens; each makes the key that ended just before it copyable."""
        text, ends, k = self.tokens, self.ends, self.key_length
        for t in tokens:
            end = len(text)
            if end >= k:
                ends.setdefault(tuple(text[end - k : end]), []).append(end)
            text.append(t)

    def match(self, text: list[int]) -> tuple[int, int]:
        """(where the continuation starts in this index's tokens, how many tokens matched) for the
        longest recent match of the end of ``text``; (-1, 0) when there is none."""
        L, own, k = len(text), self.tokens, self.key_length
        found = self.ends.get(tuple(text[L - k :])) if L >= k else None
        best, best_match, longest = -1, 0, min(MAX_MATCH, L)
        for end in reversed((found or [])[-CANDIDATES:]):
            match = k
            while match < longest and end - match > 0 and own[end - match - 1] == text[L - match - 1]:
                match += 1
            if match > best_match:
                best, best_match = end, match
        return best, best_match

    def suggest(self, length: int) -> Copy | None:
        """``length`` tokens after the longest recent earlier match of the text's end, or None."""
        if length < 1:
            return None
        start, match = self.match(self.tokens)
        source = self.tokens
        if self.corpus is not None:
            corpus_start, corpus_match = self.corpus.match(self.tokens)
            if corpus_match > match:
                start, match, source = corpus_start, corpus_match, self.corpus.tokens
        if not match:
            return None
        out: list[int] = []
        for i in range(length):  # past the end of the text, the continuation copies itself
            j = start + i
            out.append(source[j] if j < len(source) else out[j - len(source)])
        return Copy(out, match, source is not self.tokens)


def corpus_index(tokens: list[int]) -> CopyIndex:
    """A corpus's index, keyed on whole ``CORPUS_MIN_MATCH``-grams, so that no shorter match is
    found in it, and because in a large corpus a short key recurs so often that its ``CANDIDATES``
    latest occurrences would hide the longer matches."""
    return CopyIndex(tokens, key_length=CORPUS_MIN_MATCH)


def load_corpus(folder: Path) -> CopyIndex | None:
    """The corpus a drafter folder ships (``CORPUS_FILE``), indexed; None without one."""
    path = Path(folder) / CORPUS_FILE
    return corpus_index(np.load(path).tolist()) if path.is_file() else None


def corpus_tokens(drafter) -> int:
    """How many tokens the drafter's corpus holds (0 without one)."""
    return len(drafter.corpus.tokens) if drafter.corpus is not None else 0


def save_corpus(folder: Path, tokens: list[int]) -> None:
    """Write token ids (the target's answers, one after another) as a drafter folder's corpus."""
    np.save(Path(folder) / CORPUS_FILE, np.array(tokens, np.int32))


def merge(drafted: mx.array, confidence: mx.array, copied: mx.array, copy_rates: mx.array) -> tuple[mx.array, mx.array]:
    """One block of proposals from the drafter's and a copy's, and which positions hold copied tokens.

    Where the two agree the block holds their common tokens; from the first position where they
    differ on, it follows the source expected to get more tokens accepted from there:
    ``sum_k prod_{j<=i<=k} rate_i`` with the drafter's own probability of its token as its rate and
    the copies' measured acceptance as theirs. Once the sources differ, the later tokens of the
    one not followed were guesses for another text, so the block never switches back. All on
    device: the choice costs no host sync. Only for deterministic proposals (greedy, or a sampler
    verified by matching): a choice depending on sampled tokens would change the proposal
    distribution the rejection rule needs.
    """
    n = drafted.shape[0]
    differ = drafted != copied
    split = mx.where(differ.any(), mx.argmax(differ), n)
    after = mx.arange(n) >= split

    def expected(rates: mx.array) -> mx.array:
        return mx.where(after, mx.cumprod(mx.where(after, rates, 1.0)), 0.0).sum()

    from_copy = after & (expected(copy_rates) > expected(confidence))
    return mx.where(from_copy, copied, drafted), from_copy


def common_run(proposed: list[int], committed: list[int]) -> tuple[int, int]:
    """(tested, accepted): how far a run of proposals would have got against what was committed.

    ``accepted`` proposals equal the committed tokens; one more was tested (and missed) unless the
    run or the committed tokens ran out first. Under greedy verification this is exactly what
    the target would have accepted; under sampling a point-mass proposal equals the committed
    token with probability p(token), its acceptance probability, so the estimate is unbiased.
    """
    accepted = 0
    for p, c in zip(proposed, committed):
        if p != c:
            break
        accepted += 1
    return accepted + (accepted < min(len(proposed), len(committed))), accepted
