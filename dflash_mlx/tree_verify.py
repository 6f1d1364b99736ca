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
- each Gated DeltaNet layer runs each root-to-leaf path as a row of its own through mlx_lm's own
  layer, so every node's conv window and recurrent state follow its ancestors exactly. The input
  projections (most of the layer's weights) run once per node and are played back along the
  paths, as rollback.py plays them back; out_proj runs once per node. Paths repeat the nodes they
  share: the recurrence and conv see ``P * T`` rows (P leaves, T the deepest path) instead of
  ``N``, cheap beside the projections; a parent-indexed recurrence would save them at the price
  of a kernel of our own. The layer's cache is not touched: ``commit`` advances it along the
  accepted path with the recorded projections (``rollback.replay``), ``len(path)`` steps.

Attention K/V of every node land in the cache after the row's prefix, in node order; ``commit``
gathers the accepted path's rows to the front and drops the rest, so the cache then holds exactly
what a chain of the committed tokens leaves (column = position again).

Families whose tree forward tests/test_tree.py checks node by node against chains are listed in
``FAMILIES``; ``refusal`` says why any other target must verify chains.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from .cache.ragged import RaggedKVCache
from .cache.rollback import _projection_names, _swapped, replay
from .errors import DFlashError
from .target import Target
from .tree import DraftTree, visibility

# mlx_lm families whose tree forward equals chains of their paths (tests/test_tree.py).
FAMILIES = {"llama", "qwen3", "gemma3_text", "qwen3_5", "qwen3_5_moe", "qwen3_next"}


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
    """A Gated DeltaNet layer over a tree's nodes: each root-to-leaf path a row through the layer."""

    def __init__(self, mixer: nn.Module, tree: DraftTree, sink: dict, layer: int):
        self.mixer, self.sink, self.layer = mixer, sink, layer
        self.names = _projection_names(mixer)  # before Target's forward swaps recorders in
        paths, slots = tree.paths()
        R, self.P, self.T = paths.shape
        N = tree.shape[1]
        rows = mx.arange(R)[:, None, None] * N
        self.along = (rows + mx.array(paths)).reshape(-1)  # flat node of each path position
        self.slots = (mx.arange(R)[:, None] * self.P * self.T + mx.array(slots)).reshape(-1)

    def __call__(self, x: mx.array, mask: mx.array | None, cache: ArraysCache) -> mx.array:
        R, N, _ = x.shape
        names = self.names
        outputs = {name: self.mixer[name](x) for name in names}
        self.sink[self.layer] = (x, outputs)

        def along(a: mx.array) -> mx.array:
            return a.reshape(R * N, *a.shape[2:])[self.along].reshape(R * self.P, self.T, *a.shape[2:])

        played = {name: (along(x), along(y)) for name, y in outputs.items()}
        paths = ArraysCache(2)
        for k in (0, 1):  # each path starts from its row's state; None: a fresh one
            paths[k] = None if cache[k] is None else mx.repeat(cache[k], self.P, axis=0)
        out_proj = self.mixer["out_proj"]
        self.mixer["out_proj"] = _Identity()
        try:
            with _swapped(self.mixer, names, played, rows=self.T):
                out = self.mixer(played[names[0]][0], None, paths)
        finally:
            self.mixer["out_proj"] = out_proj
        nodes = out.reshape(R * self.P * self.T, -1)[self.slots].reshape(R, N, -1)
        return out_proj(nodes)


@contextmanager
def _tree_mode(target: Target, cache: list, tree: DraftTree, starts: list[int], sink: dict) -> Iterator[list]:
    """Swap the tree's masks, RoPE and Gated DeltaNet paths in; yields the cache list to pass."""
    masks = _TreeMasks(tree, starts)
    positions = mx.array(starts)[:, None] + mx.array(tree.depths)
    mixers = target.cache_policy.mixers
    with ExitStack() as stack:
        for i, layer in enumerate(target.layers):
            if layer is None:
                continue
            if i in mixers:
                name = next(k for k, v in layer.items() if v is mixers[i])
                stack.enter_context(_swapped_item(layer, name, _TreeMixer(mixers[i], tree, sink, i)))
            else:
                attention = _attention(layer)
                stack.enter_context(_swapped_item(attention, "rope", _TreeRope(attention["rope"], positions)))
        yield [_TreeCache(c, masks) if isinstance(c, RaggedKVCache) else c for c in cache]


@contextmanager
def _swapped_item(module: nn.Module, name: str, stand_in) -> Iterator[None]:
    original = module[name]
    module[name] = stand_in
    try:
        yield
    finally:
        module[name] = original


def verify(target: Target, cache: list, tree: DraftTree) -> TreeForward:
    """One target forward over every node of ``tree`` (R rows) on the batch caches ``cache``
    (``Target.make_batch_cache``): each row's root at its cached length, every node after its
    ancestors. The attention caches then hold all N nodes per row until ``commit``."""
    reason = refusal(target)
    if reason is not None:
        raise DFlashError(f"cannot verify a draft tree: {reason}")
    attention = [c for c in cache if isinstance(c, RaggedKVCache)]
    if len(attention) + sum(isinstance(c, ArraysCache) for c in cache) != len(cache) or not attention:
        raise DFlashError("draft trees need the batch engine's caches (Target.make_batch_cache)")
    starts = list(attention[0].lengths)
    if len(starts) != tree.shape[0]:
        raise DFlashError(f"a tree of {tree.shape[0]} rows for a cache of {len(starts)}")
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
    for c in cache:
        if isinstance(c, RaggedKVCache):
            c.compact(forward.starts, paths)

    def along(a: mx.array) -> mx.array:
        return mx.take_along_axis(a, index.reshape(*index.shape, *[1] * (a.ndim - 2)), axis=1)

    for i, (x, outputs) in forward.projections.items():
        record = {name: (along(x), along(y)) for name, y in outputs.items()}
        replay(target.cache_policy.mixers[i], cache[i], record, [len(p) for p in paths])
    return along(forward.hidden)
