"""Data-parallel training: one drafter per rank of ``mlx.launch``, each step's batch split between them.

Every rank holds the whole drafter, the target and the hidden-state cache, runs its rows of
the step's batch, and the ranks average their gradients before the update, so every rank
applies the same update to the same weights: the run computes what one process computes
over the whole batch, up to the order of float sums. For that each rank's loss is its rows'
part of the batch's weighted sum over the whole batch's weight sum, times the number of
ranks (averaging the gradients then sums the parts).

Rank 0 prepares the data (the target's answers and hidden states, cached in ``--out``) while
the other ranks wait on the control channel, where waiting costs no CPU (inside an MLX ring
collective a waiting rank spins a core); they then read what rank 0 wrote. So every rank
must see ``--out`` (ranks on one machine, or a shared disk). Rank 0 alone writes to it, shows
progress and runs the held-out evaluation; the others follow it until it ends.

In one process (no launcher) the group has one rank and every collective here is the identity.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from ..errors import DFlashError


def share(batch: tuple[mx.array, ...], rank: int, size: int) -> tuple[mx.array, ...]:
    """Rank ``rank``'s contiguous share of the batch rows (``all_gather`` puts the shares back in order).

    An epoch's last batch may hold fewer rows than the ranks can split evenly (or fewer rows than
    ranks): it is padded with copies of its first row whose label mask (the batch's last array) is
    all false, so every rank runs a share of the same shape and the padding adds nothing to the
    loss or the gradients. The gathered rows then end with the padding.
    """
    n = batch[0].shape[0]
    rows = -(-n // size)
    if rows * size > n:
        pad = [mx.repeat(x[:1], rows * size - n, axis=0) for x in batch]
        pad[-1] = mx.zeros_like(pad[-1])
        batch = tuple(mx.concatenate([x, p]) for x, p in zip(batch, pad))
    return tuple(x[rank * rows : (rank + 1) * rows] for x in batch)


class Ranks:
    """This process's place among the training ranks (one rank without a launcher)."""

    def __init__(self, batch_seqs: int):
        self.group = mx.distributed.init()
        self.rank, self.size = self.group.rank(), self.group.size()
        if batch_seqs % self.size:
            raise DFlashError(f"--batch-seqs {batch_seqs} does not split evenly over {self.size} ranks: "
                              f"use a multiple of {self.size}")
        self.control = None
        if self.size > 1:
            from ..distributed.control import Control

            self.control = Control.connect(self.group)

    @contextmanager
    def rank0_first(self, made: Path) -> Iterator[None]:
        """Rank 0 runs the block first and writes what it makes to ``--out``; the other ranks run
        it once rank 0 is through, and find everything made (``made``, a file it writes, tells)."""
        if self.rank:
            self.control.next_order()
            if not made.exists():
                raise DFlashError(f"rank {self.rank} does not see {made}, which rank 0 wrote: give every rank "
                                  "the same --out, on one machine or a shared disk")
        yield
        if self.control is not None and self.rank == 0:
            self.control.send({"op": "prepared"})

    def rows(self, batch: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        return share(batch, self.rank, self.size)

    def broadcast(self, model: nn.Module) -> None:
        """Rank 0's trainable weights on every rank (same seed, same data: a guard, not a fix)."""
        if self.size > 1:
            model.update(tree_map(lambda p: mx.distributed.all_sum(p if self.rank == 0 else mx.zeros_like(p), group=self.group),
                                  model.trainable_parameters()))
            mx.eval(model.parameters())  # here, so that the ranks start training together

    def average(self, grads: dict) -> dict:
        return nn.average_gradients(grads, group=self.group)

    def mean(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x, group=self.group) / self.size

    def gather(self, x: mx.array, rows: int) -> mx.array:
        """Every rank's share of ``x`` in row order, the first ``rows`` (without ``share``'s padding)."""
        return mx.distributed.all_gather(x, group=self.group)[:rows]

    def follow(self) -> None:
        """Another rank, its training done: wait for rank 0 to end (it then ends this process)."""
        while True:
            self.control.next_order()
