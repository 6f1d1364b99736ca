"""Copy proposals: the continuation of the latest earlier occurrence of what was just written.

Text repeats itself: code, lists, numbers quoted from the question, an answer that loops. An
index of the prompt and the output so far, extended as tokens are committed (never rebuilt),
finds the longest earlier match of the text's last tokens; what followed it there is proposed for
the next positions. A continuation may run into the text being matched (a loop with a short
period), so it always has the length asked for.

Copied tokens are verified like drafted ones, so the output never changes: greedy keeps the
target's argmax, and under sampling a copied token is drawn from a point mass (q = 1 at the copied
id): it is accepted with probability p(id), and on rejection the residual is p without that id.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

MIN_MATCH = 2  # tokens of context a copy must match (the index key)
MAX_MATCH = 32  # longer matches are not told apart
CANDIDATES = 8  # most recent occurrences of the key compared for the longest match


@dataclass(frozen=True)
class Copy:
    """A suggested continuation and how many tokens of context it matched."""

    tokens: list[int]
    match: int


class CopyIndex:
    """An incremental index of every ``MIN_MATCH``-gram of the text, by where it ended."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # key -> positions the key ended before
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Add committed tokens; each makes the key that ended just before it copyable."""
        text, ends = self.tokens, self.ends
        for t in tokens:
            end = len(text)
            if end >= MIN_MATCH:
                ends.setdefault(tuple(text[end - MIN_MATCH : end]), []).append(end)
            text.append(t)

    def suggest(self, length: int) -> Copy | None:
        """``length`` tokens after the longest recent earlier match of the text's end, or None."""
        text, L = self.tokens, len(self.tokens)
        if length < 1 or L < MIN_MATCH:
            return None
        found = self.ends.get(tuple(text[L - MIN_MATCH :]))
        if not found:
            return None
        best, best_match = -1, 0
        for end in reversed(found[-CANDIDATES:]):
            match = MIN_MATCH
            while match < MAX_MATCH and end - match > 0 and text[end - match - 1] == text[L - match - 1]:
                match += 1
            if match > best_match:
                best, best_match = end, match
        out: list[int] = []
        for i in range(length):  # past the end of the text, the continuation copies itself
            j = best + i
            out.append(text[j] if j < L else out[j - L])
        return Copy(out, best_match)


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
