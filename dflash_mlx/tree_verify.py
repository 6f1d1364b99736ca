"""Draft-tree verification on an mlx_lm target: one forward over every node, then the accepted
path kept in the caches (tree.py has the trees themselves).

mlx_lm's model classes build their masks and RoPE offsets from the cache (``cache.make_mask``,
``rope(x, offset=cache.offset)``), for a causal run of consecutive positions. For the duration of
a tree forward (and per instance: model classes are never patched):

- each attention cache (``RaggedKVCache``) is seen through a view whose ``make_mask`` gives every
  node the row's cached prefix and its own ancestors (``tree.visibility``); sliding windows apply
  to positions, a node's being ``start + depth``;
- each attention layer's ``rope`` is swapped for one that rotates every token at its own position
  (``mx.fast.rope`` takes one offset per batch row, so the (R, H, N, D) queries and keys go
  through it as R * N rows of one token);
- each Gated DeltaNet layer runs the tree's branch-free runs (``DraftTree.runs``) through mlx_lm's
  own layer, one call per batch of runs, each run starting from the conv window and recurrent
  state its parent node left: every node's state follows its ancestors exactly and is computed
  once. The input projections (most of the layer's weights) run once over all nodes and are
  played back per batch, as rollback.py plays them back; out_proj runs once over all nodes. A
  chain is one call of N steps, as a chain verify; a bushy tree a few calls (as many as runs lie
  above one another). The alternatives cost more: each root-to-leaf path as a row repeats the
  nodes paths share (a bushy tree's recurrence then costs several chains'), one call per depth
  costs a layer call per node of a chain (benchmarks/results/tree_gdn_layouts.json). The layer's
  cache is not touched: ``commit`` advances it along the accepted path with the recorded
  projections (``rollback.replay``), ``len(path)`` steps.

Attention K/V of every node land in the cache after the row's prefix, in node order; ``commit``
gathers the accepted path's rows to the front and drops the rest, so the cache then holds exactly
what a chain of the committed tokens leaves (column = position again).

A tree whose rows are all one branch (``DraftTree.is_chain``, common at small budgets) is
verified as the chain it is, by the target's own causal forward, and committed by
``Target.rollback``: the swapped masks and per-token RoPE make a tree forward dearer than a chain
forward of as many tokens (benchmarks/results/README.md, twenty-first stop).

Families whose tree forward tests/test_tree.py checks node by node against chains are listed in
``FAMILIES``; ``refusal`` says why any other target must verify chains.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache

from .cache.ragged import RaggedKVCache
from .cache.rollback import _projection_names, _swapped, replay
from .errors import DFlashError
from .target import Target
from .tree import DraftTree, visibility

# mlx_lm families whose tree forward equals chains of their paths (tests/test_tree.py).
FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_5", "qwen3_5_moe", "qwen3_next"}


def refusal(target: Target) -> str | None:
    """Why ``target`` cannot verify draft trees (its engine then verifies chains), or None."""
    model_type = target.cache_policy.model_type
    if model_type not in FAMILIES:
        return (f"draft trees are verified exactly only on {', '.join(sorted(FAMILIES))} targets "
                f"(mlx_lm builds masks and RoPE offsets per family), not {model_type!r}")
    if target.cache_policy.batch_refusal:
        return target.cache_policy.batch_refusal
    if any(getattr(m, "sharding_group", None) is not None for m in target.cache_policy.mixers.values()):
        return "a tensor-parallel Gated DeltaNet layer sums its output across ranks after out_proj"
    missing = [i for i, layer in enumerate(target.layers) if layer is not None
               and i not in target.cache_policy.mixers and _attention(layer) is None]
    if missing:
        return f"layer {missing[0]} of {model_type!r} has no attention module with a rope to place nodes"
    return None


def _attention(layer: nn.Module) -> nn.Module | None:
    """The attention module of a decoder layer: the child holding a ``rope``."""
    return next((m for m in layer.values() if isinstance(m, nn.Module) and "rope" in m), None)


@dataclass
class TreeForward:
    """One tree forward: ``logits`` (R, N, V) and the hidden states ``hidden`` (R, N, k*H) of
    every node, and what ``commit`` needs."""

    tree: DraftTree
    logits: mx.array
    hidden: mx.array
    starts: list[int]  # each row's cached length before the forward: the root's position
    # Gated DeltaNet layer index -> the layer's input and its projections' outputs, per node
    projections: dict[int, tuple[mx.array, dict[str, mx.array]]] = field(default_factory=dict)
    chain: bool = False  # run as a chain verify: ``commit`` rolls the rest back


class _TreeCache:
    """A RaggedKVCache as mlx_lm's attention sees it during a tree forward: its own K/V, the
    tree's mask."""

    def __init__(self, cache: RaggedKVCache, masks: "_TreeMasks"):
        self.cache, self.masks = cache, masks

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> mx.array:
        return self.masks(window_size or self.cache.window)

    def __getattr__(self, name):
        return getattr(self.cache, name)


class _TreeMasks:
    """The tree forward's attention masks (R, 1, N, S), one per window size.

    Row r's keys are its cached prefix (columns 0..start-1, positions equal to columns) and then
    its N nodes (column start + j, position start + depth j).
    """

    def __init__(self, tree: DraftTree, starts: list[int]):
        self.R, self.N = tree.shape
        self.vis = visibility(tree)
        self.start = mx.array(starts)[:, None, None]
        self.depths = mx.array(tree.depths)
        self.keys = max(starts) + self.N
        self._made: dict[int | None, mx.array] = {}

    def __call__(self, window: int | None) -> mx.array:
        if window not in self._made:
            column = mx.arange(self.keys)[None, None]
            node = column - self.start  # (R, 1, S): the node a column holds, if >= 0
            in_prefix = node < 0
            j = mx.broadcast_to(mx.clip(node, 0, self.N - 1), (self.R, self.N, self.keys))
            mask = mx.where(in_prefix, True, (node < self.N) & mx.take_along_axis(self.vis, j, axis=2))
            if window is not None:
                query = self.start + self.depths[:, :, None]
                key = mx.where(in_prefix, column, self.start + mx.take_along_axis(
                    mx.broadcast_to(self.depths[:, None], (self.R, self.N, self.N)), j, axis=2))
                mask &= query - key < window
            self._made[window] = mask[:, None]
        return self._made[window]


class _TreeRope:
    """A RoPE that rotates each of the (R, H, N, D) tokens at its own position ``positions`` (R, N)."""

    def __init__(self, rope: nn.Module, positions: mx.array):
        self.rope, self.positions = rope, positions.reshape(-1)

    def __call__(self, x: mx.array, offset=None) -> mx.array:
        R, H, N, D = x.shape
        tokens = x.transpose(0, 2, 1, 3).reshape(R * N, H, 1, D)
        return self.rope(tokens, offset=self.positions).reshape(R, N, H, D).transpose(0, 2, 1, 3)


class _Identity:
    def __call__(self, x: mx.array) -> mx.array:
        return x


class _TreeMixer:
    """A Gated DeltaNet layer over a tree's nodes: its runs through mlx_lm's own layer, batch by
    batch, each run starting from the state its parent node left (``_RunLayout``)."""

    def __init__(self, mixer: nn.Module, layout: "_RunLayout", sink: dict, layer: int):
        self.mixer, self.layout, self.sink, self.layer = mixer, layout, sink, layer
        self.names = _projection_names(mixer)  # before Target's forward swaps recorders in

    def __call__(self, x: mx.array, mask: mx.array | None, cache: ArraysCache) -> mx.array:
        outputs = {name: self.mixer[name](x) for name in self.names}
        self.sink[self.layer] = (x, outputs)
        rows = {name: y.reshape(-1, *y.shape[2:]) for name, y in outputs.items()}
        x_rows, states, outs = x.reshape(-1, x.shape[-1]), (cache[0], cache[1]), []
        with _swapped_item(self.mixer, "out_proj", _Identity()) as out_proj:
            for batch in self.layout.batches:
                runs = ArraysCache(2)
                # each run starts from the state its parent node left (batch 0: the cache's rows)
                runs[0], runs[1] = (None if s is None else s[batch.above] for s in states)
                played = {name: (x_rows[batch.nodes], y[batch.nodes]) for name, y in rows.items()}
                if batch.lengths is not None:  # mlx_lm's batched form: past its end a run's state stays
                    runs.lengths = batch.lengths + 0  # a copy: the layer's cache.advance subtracts in place
                with _swapped(self.mixer, self.names, played, rows=batch.nodes.shape[1]):
                    outs.append(self.mixer(played[self.names[0]][0], batch.mask, runs))
                states = (runs[0], runs[1])
        out = mx.concatenate([o.reshape(-1, o.shape[-1]) for o in outs])[self.layout.slots]
        return out_proj(out.reshape(*x.shape[:2], -1))


@dataclass(frozen=True)
class _Batch:
    nodes: mx.array  # (runs, L): flat node index (row * N + node) along each run, padded with its last
    above: mx.array  # (runs,): the row of the previous batch (batch 0: of the cache) each run starts from
    lengths: mx.array | None  # (runs,): each run's length, None when all are L
    mask: mx.array | None  # (runs, L): steps within each run


class _RunLayout:
    """``DraftTree.runs`` as gathers: each run a row of one mixer call per batch, so a chain is one
    call of N steps and a bushy tree a few calls whose rows hold each node once (plus padding)."""

    def __init__(self, tree: DraftTree):
        R, N = tree.shape
        self.batches, slots, seen = [], np.zeros((R, N), np.int64), 0
        for batch in tree.runs():
            L = max(len(run) for _, run, _ in batch)
            nodes = np.array([[r * N + run[min(j, len(run) - 1)] for j in range(L)] for r, run, _ in batch])
            for k, (r, run, _) in enumerate(batch):
                slots[r, run] = seen + k * L + np.arange(len(run))
            lengths = np.array([len(run) for _, run, _ in batch])
            ragged = bool((lengths < L).any())
            above = [r if a < 0 else a for r, _, a in batch]
            self.batches.append(_Batch(mx.array(nodes), mx.array(above), mx.array(lengths) if ragged else None,
                                       mx.array(np.arange(L) < lengths[:, None]) if ragged else None))
            seen += nodes.size
        self.slots = mx.array(slots.reshape(-1))  # padding nodes read output 0: no real node sees them


@contextmanager
def _tree_mode(target: Target, cache: list, tree: DraftTree, starts: list[int], sink: dict) -> Iterator[list]:
    """Swap the tree's masks, RoPE and Gated DeltaNet paths in; yields the cache list to pass."""
    masks = _TreeMasks(tree, starts)
    positions = mx.array(starts)[:, None] + mx.array(tree.depths)
    mixers = target.cache_policy.mixers
    layout = _RunLayout(tree) if mixers else None
    with ExitStack() as stack:
        for i, layer in enumerate(target.layers):
            if layer is None:
                continue
            if i in mixers:
                name = next(k for k, v in layer.items() if v is mixers[i])
                stack.enter_context(_swapped_item(layer, name, _TreeMixer(mixers[i], layout, sink, i)))
            else:
                attention = _attention(layer)
                stack.enter_context(_swapped_item(attention, "rope", _TreeRope(attention["rope"], positions)))
        yield [_TreeCache(c, masks) if isinstance(c, RaggedKVCache) else c for c in cache]


@contextmanager
def _swapped_item(module: nn.Module, name: str, stand_in) -> Iterator[nn.Module]:
    """``module[name]`` replaced by ``stand_in`` for the block, which gets the original."""
    original = module[name]
    module[name] = stand_in
    try:
        yield original
    finally:
        module[name] = original


def verify(target: Target, cache: list, tree: DraftTree) -> TreeForward:
    """One target forward over every node of ``tree`` (R rows) on the batch caches ``cache``
    (``Target.make_cache``): each row's root at its cached length, every node after its
    ancestors. The attention caches then hold all N nodes per row until ``commit``."""
    reason = refusal(target)
    if reason is not None:
        raise DFlashError(f"cannot verify a draft tree: {reason}")
    attention = [c for c in cache if isinstance(c, RaggedKVCache)]
    if len(attention) + sum(isinstance(c, ArraysCache) for c in cache) != len(cache) or not attention:
        raise DFlashError("draft trees need the engine's caches (Target.make_cache)")
    starts = list(attention[0].lengths)
    if len(starts) != tree.shape[0]:
        raise DFlashError(f"a tree of {tree.shape[0]} rows for a cache of {len(starts)}")
    if tree.is_chain:
        logits, hidden = target(mx.array(tree.tokens), cache)
        return TreeForward(tree, logits, hidden, starts, chain=True)
    sink: dict = {}
    with _tree_mode(target, cache, tree, starts, sink) as tree_cache:
        logits, hidden = target(mx.array(tree.tokens), tree_cache)
    target.cache_policy.forget()  # a tree forward is undone by commit, never by rollback
    return TreeForward(tree, logits, hidden, starts, sink)


def commit(target: Target, cache: list, forward: TreeForward, paths: list[list[int]]) -> mx.array:
    """Keep row r's nodes ``paths[r]`` (the root and the accepted nodes, ``tree.walk``) in the
    caches, as if that chain alone had been verified; returns their hidden states (R, M, k*H),
    M the longest path (the drafter's next context: row r's first ``len(paths[r])``)."""
    M = max(map(len, paths))
    index = mx.array([p + [p[-1]] * (M - len(p)) for p in paths])

    def along(a: mx.array) -> mx.array:
        return mx.take_along_axis(a, index.reshape(*index.shape, *[1] * (a.ndim - 2)), axis=1)

    if forward.chain:
        target.rollback(cache, [forward.tree.shape[1] - len(p) for p in paths])
        return along(forward.hidden)
    attention = [c for c in cache if isinstance(c, RaggedKVCache)]
    for c in attention:
        c.compact(forward.starts, paths)
    # Moved now, on their own: left to the next forward's graph, the same moves cost that step
    # several times more, growing with the context (benchmarks/results/README.md, fourth stop).
    mx.async_eval([x for c in attention for x in (c.keys, c.values)])
    for i, (x, outputs) in forward.projections.items():
        record = {name: (along(x), along(y)) for name, y in outputs.items()}
        replay(target.cache_policy.mixers[i], cache[i], record, [len(p) for p in paths])
    return along(forward.hidden)
