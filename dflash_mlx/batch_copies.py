"""Copy proposals in the batch engine: each row's own copy index, weighed against its draft.

Every request keeps a ``copying.CopyIndex`` of its prompt and output and an ``adaptive.Acceptance``
of its own. Rows share one drafter forward and one block size per step, so a row cannot skip the
drafter; instead each row's block holds the likelier continuation: all of the copy when its
measured run rates promise at least the drafter's (chosen before the draft is looked at, so under
rejection sampling the copied tokens are verified as point masses, q = None, and the rule stays
exact); otherwise, for deterministic proposals (greedy, coupled sampling, or a sampler verified
by matching), the draft and the copy merged at their first disagreement (``copying.merge``), and
for rejection-sampled ones the draft alone.
"""

from __future__ import annotations

import mlx.core as mx

from .adaptive import Acceptance
from .copying import Copy, CopyIndex, merge


class RowCopies:
    def __init__(self, prompt: list[int], block_size: int, corpus: CopyIndex | None = None):
        self.index = CopyIndex(prompt, corpus)
        self.acceptance = Acceptance(max(block_size - 1, 1), max(block_size - 1, 1), prior=0.6, decay=0.8, optimism=0.3)
        self.copy: Copy | None = None  # this step's, until ``record``

    def propose(
        self, drafted: mx.array, confidence: mx.array, q: mx.array | None, deterministic: bool
    ) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """(proposals, the q to verify them against, which positions were copied) for one row."""
        n = drafted.shape[0]
        self.copy = copy = self.index.suggest(n)
        if copy is None:
            return drafted, q, None
        if self.acceptance.copy_goes_further(copy, n):
            return mx.array(copy.tokens, mx.int32), None, mx.ones((n,), mx.bool_)
        if deterministic:
            rates = self.acceptance.copy_rates(copy)
            proposals, from_copy = merge(drafted, confidence, mx.array(copy.tokens, mx.int32),
                                         mx.array([rates.rate(i) for i in range(n)]))
            return proposals, q, from_copy
        return drafted, q, None

    @property
    def from_corpus(self) -> bool:
        """Whether this step's copy came from the drafter's corpus."""
        return self.copy is not None and self.copy.from_corpus

    def record(self, drafted: list[int], committed: list[int]) -> None:
        """What the drafter and the copy proposed this step against what the row committed."""
        self.acceptance.record(drafted, self.copy, committed)
        self.copy = None


def propose_rows(
    rows: list, drafted: mx.array, qs: list[mx.array | None], confidence: mx.array
) -> tuple[mx.array, list[mx.array | None], list[mx.array | None]]:
    """Every row's block: its draft, or with copy proposals on (``row.copies``) the likelier of
    draft and copy (``RowCopies.propose``); with the q to verify each by and its copied positions."""
    proposals, qs, from_copy = [], list(qs), [None] * len(rows)
    for i, row in enumerate(rows):
        p = drafted[i]
        if row.copies:
            p, qs[i], from_copy[i] = row.copies.propose(p, confidence[i], qs[i], row.strategy.deterministic)
        proposals.append(p)
    return mx.stack(proposals), qs, from_copy
