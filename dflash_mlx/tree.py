"""Draft trees (DDTree): the proposals of one drafter forward as a tree, verified in one target forward.

A block drafter scores every block position at once, so besides its top choice at each depth it
also offers runners-up. A tree holds several of them: per row, node 0 is the root (the last
committed token, not yet in the target's cache) and every other node a proposal for the position
``start + depth``, its parent the proposal before it. The target verifies all nodes in one forward
(each node sees the cached prefix and its own ancestors, ``visibility``) and the walk from the root
follows, at each node, the child holding the target's own token there (``walk``): what is committed
is the target's choice at every step, whatever the tree held, so the output is exactly the
target's (greedy: its argmax; coupled sampling: its Gumbel-max pick with the noise of the node's
position, which siblings share).

``build`` grows the tree best-first (Ringel et al., arXiv 2604.12989): a node's score is the sum of
the drafter's log-probabilities along its path (the chance the whole path is accepted if the
drafter were calibrated), and a max-heap pops candidates in score order, each pop pushing its next
sibling and its first child, until the node budget is spent. Since no candidate scores above its
parent or its better-ranked sibling, the pops are the budget's best-scoring candidates and form a
prefix-closed tree: the one maximising the expected accepted length under the surrogate. A chain
(a block of proposals) is a tree with one branch.

Rows of a batch hold different numbers of nodes; all are padded to a common width ``N``. A padding
node has no parent: no real node sees it (``visibility``), the walk never reaches it, and its
cache rows are dropped at commit.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from .errors import DFlashError

NOT_DRAFTED = -1  # ``ranks`` of the root, padding and nodes only a copy proposed


@dataclass(frozen=True)
class DraftTree:
    """R rows of flattened trees, parents before children; numpy arrays (R, N) on the host.

    ``tokens``: each node's token (the root's is the last committed token). ``parents``: the
    parent's node index, -1 for the root and padding. ``depths``: 0 for the root, its position
    is ``start + depth``. ``ranks``: the node's rank among its depth's drafted candidates
    (0: the drafter's top choice), ``NOT_DRAFTED`` if the drafter did not propose it.
    ``copied``: whether a copy proposed it. ``sizes`` (R,): real nodes per row, root included;
    nodes ``sizes[r]..N-1`` of row r are padding. ``scores``: the path score each node was
    grown by (``build``; 0 elsewhere), its exponential the surrogate's chance the path is accepted.
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray
    copied: np.ndarray
    sizes: np.ndarray
    scores: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    @property
    def is_chain(self) -> bool:
        """Whether every row is one branch of all N nodes (no padding): the tree a chain verify of
        its tokens checks."""
        return bool((self.parents[:, 1:] == np.arange(self.shape[1] - 1)).all())

    def first(self, n: int) -> "DraftTree":
        """Each row's first ``n`` nodes: ``build``'s tree for a smaller budget (it adds nodes best
        first, parents before children, so any prefix is the budget-best tree of its size)."""
        return DraftTree(*(a[:, :n] for a in (self.tokens, self.parents, self.depths, self.ranks, self.copied)),
                         np.minimum(self.sizes, n), self.scores[:, :n])

    def runs(self) -> list[list[tuple[int, list[int], int]]]:
        """The trees cut into runs without branches, batched by how many runs lie above them.

        A run starts at a root or at a child of a branching node and goes on while its last
        node has exactly one child; the runs under it start at that last node's children.
        Returns, per batch k, its runs as (row, nodes, index in batch k - 1 of the run above,
        -1 in batch 0). A chain is one run; padding is in none.
        """
        children = [[[] for _ in range(n)] for n in self.sizes]
        for r, n in enumerate(self.sizes):
            for i in range(1, n):
                children[r][self.parents[r, i]].append(i)
        batches, heads = [], [(r, 0, -1) for r in range(len(self.sizes))]
        while heads:
            batch = []
            for r, node, above in heads:
                run = [node]
                while len(children[r][run[-1]]) == 1:
                    run.append(children[r][run[-1]][0])
                batch.append((r, run, above))
            batches.append(batch)
            heads = [(r, c, k) for k, (r, run, _) in enumerate(batch) for c in children[r][run[-1]]]
        return batches


def _assemble(rows: list[list[tuple]]) -> DraftTree:
    """A DraftTree from each row's nodes (token, parent, depth, rank, copied[, score]), padded."""
    R, N = len(rows), max(map(len, rows))
    tokens, parents = np.zeros((R, N), np.int32), np.full((R, N), -1, np.int32)
    depths, ranks = np.zeros((R, N), np.int32), np.full((R, N), NOT_DRAFTED, np.int32)
    copied, scores = np.zeros((R, N), bool), np.zeros((R, N), np.float32)
    for r, nodes in enumerate(rows):
        for i, (token, parent, depth, rank, copy, *score) in enumerate(nodes):
            tokens[r, i], parents[r, i], depths[r, i], ranks[r, i], copied[r, i] = token, parent, depth, rank, copy
            scores[r, i] = score[0] if score else 0.0
    return DraftTree(tokens, parents, depths, ranks, copied, np.array([len(n) for n in rows]), scores)


def candidates(draft_logits: mx.array, width: int, columns: mx.array | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each depth's ``width`` best tokens and their log-probabilities, best first: (R, D, K) ids
    and (R, D, K) log-probs on the host. ``draft_logits`` (R, D, V'): one drafter forward's scores
    at block positions 1..D (any constant per row cancels), over the vocabulary ids ``columns``
    (a draft vocabulary; None: the whole vocabulary).

    The scores come to the host whole and are ranked there: the tree is built on the host anyway,
    and on a CPU backend numpy's exponentials over the draft vocabulary cost a small part of MLX's
    (benchmarks/results/tree_candidates_host_2026-12-08.json)."""
    scores = np.array(draft_logits.astype(mx.float32))
    peak = scores.max(axis=-1, keepdims=True)
    logprobs = scores - (peak + np.log(np.exp(scores - peak).sum(axis=-1, keepdims=True)))
    K = min(width, logprobs.shape[-1])
    top = np.argpartition(-logprobs, K - 1, axis=-1)[..., :K]
    values = np.take_along_axis(logprobs, top, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")
    top, values = np.take_along_axis(top, order, axis=-1), np.take_along_axis(values, order, axis=-1)
    ids = top if columns is None else np.array(columns)[top]
    return ids.astype(np.int32), values


def build(draft_logits: mx.array, budget: int | Sequence[int], roots: Sequence[int], columns: mx.array | None = None,
          width: int | None = None, calibration: np.ndarray | None = None,
          copies: Sequence[Sequence[int]] | None = None,
          copy_rates: Sequence[Sequence[float]] | None = None) -> DraftTree:
    """The budget-best tree per row from one drafter forward (see the module notes).

    ``draft_logits`` (R, D, V'): the drafter's scores at block positions 1..D over vocabulary ids
    ``columns`` (None: all); ``budget``: nodes besides the root, for every row or per row;
    ``roots`` (R,): the last committed tokens; ``width``: candidates per depth (default
    ``min(max budget, V')``).
    ``calibration`` (D, K): measured acceptance of the candidate of each (depth, rank) given its
    parent was accepted; when given, scores sum its logs instead of the drafter's log-probs (it
    must not rise along ranks, nor above 1, for the pops to come best first).
    ``copies``: per row, tokens copied from earlier text (may be empty), a branch from the root,
    its node at depth d scored ``sum_{j<=d} log copy_rates[r][j-1]`` (per row: each row's copies
    are accepted at their own measured rates); where a copied token equals a
    drafted candidate under the same parent they are one node.
    """
    budgets = [budget] * len(roots) if isinstance(budget, int) else list(budget)
    if min(budgets) < 0:
        raise DFlashError(f"tree budget {min(budgets)} is negative: give the number of proposals to verify")
    ids, logprobs = candidates(draft_logits, width or max(max(budgets), 1), columns)
    if calibration is not None:
        logprobs = np.broadcast_to(np.log(np.asarray(calibration)[: ids.shape[1], : ids.shape[2]]), logprobs.shape)
    rows = []
    for r, root in enumerate(roots):
        copy = list(copies[r]) if copies is not None else []
        if copy and copy_rates is None:
            raise DFlashError("copy proposals need copy_rates: their measured acceptance per position")
        copy_scores = None if copy_rates is None else np.concatenate([[0.0], np.cumsum(np.log(copy_rates[r]))])
        rows.append(_grow(int(root), ids[r], logprobs[r], budgets[r], copy[: len(copy_scores) - 1] if copy else [],
                          copy_scores))
    return _assemble(rows)


def _grow(root: int, ids: np.ndarray, logprobs: np.ndarray, budget: int, copy: list[int],
          copy_scores: np.ndarray | None) -> list[tuple[int, int, int, int, bool, float]]:
    """One row's best-first growth. A heap entry is a candidate: (-score, order, parent node,
    depth, rank) for a drafted one, rank ``NOT_DRAFTED`` for the copy's node at that depth."""
    D, K = ids.shape
    nodes = [(root, -1, 0, NOT_DRAFTED, False, 0.0)]
    where: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    heap: list[tuple[float, int, int, int, int]] = []
    order = itertools.count()  # ties pop in the order pushed

    def push(score: float, parent: int, depth: int, rank: int) -> None:
        if depth <= (D if rank != NOT_DRAFTED else len(copy)) and rank < K:
            heapq.heappush(heap, (-score, next(order), parent, depth, rank))

    push(float(logprobs[0, 0]), 0, 1, 0)
    if copy:
        push(float(copy_scores[1]), 0, 1, NOT_DRAFTED)
    while heap and len(nodes) <= budget:
        negative, _, parent, depth, rank = heapq.heappop(heap)
        score, drafted = -negative, rank != NOT_DRAFTED
        token = int(ids[depth - 1, rank]) if drafted else copy[depth - 1]
        node = where.get((parent, token))
        if node is None:
            node = where[(parent, token)] = len(nodes)
            nodes.append((token, parent, depth, rank if drafted else NOT_DRAFTED, not drafted, score))
            # A node's first entry to pop scores highest (pops come in score order): its drafted
            # children hang from that score.
            if depth < D:
                push(score + float(logprobs[depth, 0]), node, depth + 1, 0)
        else:  # the same token under the same parent, from the other source
            t, p, d, k, c, first = nodes[node]
            nodes[node] = (t, p, d, rank if drafted else k, c or not drafted, first)
        if drafted and rank + 1 < K:
            push(score - float(logprobs[depth - 1, rank]) + float(logprobs[depth - 1, rank + 1]), parent, depth, rank + 1)
        elif not drafted and depth < len(copy):
            push(float(copy_scores[depth + 1]), node, depth + 1, NOT_DRAFTED)
    return nodes


def visibility(tree: DraftTree) -> mx.array:
    """(R, N, N) bool: which new nodes each node attends to, its ancestors and itself
    (``vis[i, :i] = vis[parent(i), :i]``, ``vis[i, i]``); padding nodes see only themselves."""
    R, N = tree.shape
    vis = np.zeros((R, N, N), bool)
    rows = np.arange(R)
    for i in range(N):
        parent = tree.parents[:, i]
        has = parent >= 0
        vis[rows[has], i, :i] = vis[rows[has], parent[has], :i]
        vis[:, i, i] = True
    return mx.array(vis)


@dataclass(frozen=True)
class Walk:
    """What one verified tree commits, per row.

    ``paths``: node indices from the root down the accepted path (the root included: its cache
    row and those of the accepted nodes are kept); ``bonus``: the target's token at the path's
    last node, committed after the accepted proposals; ``accepted``: proposals accepted
    (``len(path) - 1``); ``left_chain``: whether the path left the drafter's top choices;
    ``drafted`` / ``copied``: accepted nodes the drafter / a copy proposed (a node both proposed
    counts in both).
    """

    paths: list[list[int]]
    bonus: list[int]
    accepted: list[int]
    left_chain: list[bool]
    drafted: list[int]
    copied: list[int]

    def committed(self, tree: DraftTree) -> list[list[int]]:
        """Per row the committed tokens: the accepted proposals, then the bonus token."""
        return [[int(tree.tokens[r, i]) for i in path[1:]] + [b]
                for r, (path, b) in enumerate(zip(self.paths, self.bonus))]


def walk(tree: DraftTree, picks: mx.array | np.ndarray) -> Walk:
    """Follow from each row's root the child holding the target's token at the current node
    (``picks`` (R, N): the target's token at every node, see ``target_tokens``), stopping at a
    node without one."""
    picks = np.array(picks)
    paths, bonus = [], []
    for r, n in enumerate(tree.sizes):
        children: dict[tuple[int, int], int] = {(int(tree.parents[r, i]), int(tree.tokens[r, i])): i
                                                for i in range(1, n)}
        path = [0]
        while (path[-1], int(picks[r, path[-1]])) in children:
            path.append(children[(path[-1], int(picks[r, path[-1]]))])
        paths.append(path)
        bonus.append(int(picks[r, path[-1]]))
    return Walk(
        paths, bonus, [len(p) - 1 for p in paths],
        [any(tree.ranks[r, i] != 0 for i in p[1:]) for r, p in enumerate(paths)],
        [sum(tree.ranks[r, i] != NOT_DRAFTED for i in p[1:]) for r, p in enumerate(paths)],
        [sum(bool(tree.copied[r, i]) for i in p[1:]) for r, p in enumerate(paths)],
    )


def target_tokens(rules: Sequence, logits: mx.array, tree: DraftTree) -> mx.array:
    """The target's pick at every node (R, N) from the tree forward's logits (R, N, V): per row
    ``rules[r]``, a sampling strategy bound to the row's root position + 1 (``strategy.at``),
    greedy or coupled (``pick_nodes``); a node at depth d predicts that position + d."""
    if any(not hasattr(rule, "pick_nodes") for rule in rules):
        names = sorted({rule.name for rule in rules if not hasattr(rule, "pick_nodes")})
        raise DFlashError(f"draft trees verify greedy or coupled sampling only, not {', '.join(names)}: "
                          "use a chain (block) for this strategy")
    depths = mx.array(tree.depths)
    return mx.stack([rule.pick_nodes(logits[r], depths[r]) for r, rule in enumerate(rules)])
