"""Draft trees: the builder, visibility and walk (tree.py), and tree verification on every target
family it claims (tree_verify.py), checked against mlx_lm running each path as plain text."""

import itertools
from typing import Sequence

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_hybrid import CONFIGS, PROMPT, build as build_hybrid

from dflash_mlx import tree as trees
from dflash_mlx.cache.ragged import RaggedKVCache
from dflash_mlx.errors import DFlashError
from dflash_mlx.kernels import get_ops
from dflash_mlx.sampling import Coupled, Greedy, SamplingParams
from dflash_mlx.target import Target
from dflash_mlx.tree_verify import FAMILIES, commit, refusal, verify

# -- trees by hand --------------------------------------------------------------------------


def ancestry(parents: np.ndarray, node: int) -> list[int]:
    """Node indices from the root down to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def chain(roots: Sequence[int], proposals: Sequence[Sequence[int]],
          from_copy: Sequence[Sequence[bool]] | None = None) -> trees.DraftTree:
    """A block of proposals as a tree: per row the root and its proposals, each the child of the one
    before. Rows may hold different numbers of proposals. ``from_copy`` marks proposals taken
    from a copy (``copying.merge``); the others are the drafter's top choices (rank 0)."""
    rows = []
    for r, (root, tokens) in enumerate(zip(roots, proposals)):
        copies = from_copy[r] if from_copy is not None else [False] * len(tokens)
        rows.append([(int(root), -1, 0, trees.NOT_DRAFTED, False)]
                    + [(int(t), i, i + 1, trees.NOT_DRAFTED if c else 0, bool(c))
                       for i, (t, c) in enumerate(zip(tokens, copies))])
    return trees._assemble(rows)


# -- the builder -----------------------------------------------------------------------------


def random_logits(R: int, D: int, V: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=(R, D, V)).astype(np.float32) * 2)


def rank_paths(tree: trees.DraftTree, r: int = 0) -> list[tuple[int, ...]]:
    """Each real non-root node as the ranks along its path, in node order."""
    return [tuple(int(tree.ranks[r, j]) for j in ancestry(tree.parents[r], i)[1:])
            for i in range(1, tree.sizes[r])]


def path_score(logprobs: np.ndarray, ranks: tuple[int, ...]) -> float:
    return float(sum(logprobs[d, k] for d, k in enumerate(ranks)))


def test_candidates_are_each_depths_likeliest_tokens():
    """Per row and depth, the K likeliest ids of a draft vocabulary (its columns mapped back to
    token ids) and their log-probabilities under the softmax over that vocabulary, best first;
    half-precision scores are ranked as well."""
    V, K = 50, 4
    columns = mx.array(np.random.default_rng(1).permutation(200)[:V].astype(np.int32))
    logits = random_logits(2, 3, V)
    expected = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    best = np.argsort(-expected, axis=-1)[..., :K]
    for scores in (logits, logits.astype(mx.float16)):
        ids, logprobs = trees.candidates(scores, K, columns)
        assert ids.shape == logprobs.shape == (2, 3, K) and ids.dtype == np.int32
        assert (ids == np.array(columns)[best]).all()
        tolerance = 2e-2 if scores.dtype == mx.float16 else 1e-5
        assert np.allclose(logprobs, np.take_along_axis(expected, best, axis=-1), atol=tolerance)


def test_build_is_the_budget_best_prefix_closed_tree():
    D, K, V, budget = 3, 2, 10, 5
    logits = random_logits(2, D, V)
    tree = trees.build(logits, budget, [4, 5], width=K)
    assert tree.shape == (2, budget + 1) and list(tree.sizes) == [budget + 1] * 2
    ids, logprobs = trees.candidates(logits, K)
    for r in range(2):
        assert tree.parents[r, 0] == -1 and tree.depths[r, 0] == 0
        for i in range(1, budget + 1):  # parents first, one level up, tokens the drafter's candidates
            p = tree.parents[r, i]
            assert 0 <= p < i and tree.depths[r, i] == tree.depths[r, p] + 1
            assert tree.tokens[r, i] == ids[r, tree.depths[r, i] - 1, tree.ranks[r, i]]
        got = rank_paths(tree, r)
        scores = [path_score(logprobs[r], g) for g in got]
        assert scores == sorted(scores, reverse=True)  # popped best first
        # Brute force: every prefix-closed set of `budget` candidates; the tree has the best total
        # path probability (the expected accepted length under the drafter's own surrogate).
        every = [c for d in range(1, D + 1) for c in itertools.product(range(K), repeat=d)]
        best = max(
            (s for s in itertools.combinations(every, budget) if all(len(c) == 1 or c[:-1] in s for c in s)),
            key=lambda s: sum(np.exp(path_score(logprobs[r], c)) for c in s),
        )
        assert set(got) == set(best)


def test_budgets_per_row_and_draft_vocabulary_columns():
    columns = mx.array([40, 41, 42, 43, 44, 45])
    tree = trees.build(random_logits(2, 4, 6, seed=3), [3, 6], [1, 2], columns=columns, width=3)
    assert list(tree.sizes) == [4, 7] and tree.shape == (2, 7)
    assert set(tree.tokens[0, 1:4].tolist()) <= set(range(40, 46))
    assert (tree.parents[0, 4:] == -1).all() and (tree.ranks[0, 4:] == trees.NOT_DRAFTED).all()  # padding


def test_a_chain_is_a_one_branch_tree():
    logits = random_logits(2, 5, 12, seed=1)
    top = np.array(mx.argmax(logits, axis=-1))
    built = trees.build(logits, 5, [3, 4], width=1)
    chained = chain([3, 4], top.tolist())
    for field in ("tokens", "parents", "depths", "ranks", "copied", "sizes"):
        assert np.array_equal(getattr(built, field), getattr(chained, field)), field
    ragged = chain([3, 4], [[7, 8, 9], [5]], from_copy=[[False, True, True], [False]])
    assert list(ragged.sizes) == [4, 2] and ragged.parents[1, 2:].tolist() == [-1, -1]
    assert ragged.ranks[0].tolist() == [-1, 0, -1, -1] and ragged.copied[0].tolist() == [False, False, True, True]


def test_copy_branch_merges_with_drafted_nodes():
    V = 10
    logits = np.full((1, 4, V), -9.0, np.float32)
    for d, t in enumerate([5, 6, 7, 8]):  # the drafter is sure of 5 6 7 8
        logits[0, d, t] = 9.0
    copy = [5, 6, 2, 3]  # shares 5 6, then differs
    tree = trees.build(mx.array(logits), 7, [1], width=2, copies=[copy], copy_rates=[[0.9, 0.9, 0.8, 0.8]])
    path = {tuple(int(tree.tokens[0, j]) for j in ancestry(tree.parents[0], i)[1:]): i
            for i in range(1, tree.sizes[0])}
    assert tree.sizes[0] == 8 and len(path) == 7  # merged: no token twice under one parent
    for shared in [(5,), (5, 6)]:
        assert tree.copied[0, path[shared]] and tree.ranks[0, path[shared]] == 0
    for own in [(5, 6, 2), (5, 6, 2, 3)]:
        assert tree.copied[0, path[own]] and tree.ranks[0, path[own]] == trees.NOT_DRAFTED
    # The drafter's own candidates grow from the copy's nodes too (scored from the copy's path).
    for drafted in [(5, 6, 7), (5, 6, 7, 8), (5, 6, 2, 8)]:
        assert not tree.copied[0, path[drafted]] and tree.ranks[0, path[drafted]] == 0
    with pytest.raises(DFlashError, match="copy_rates"):
        trees.build(mx.array(logits), 6, [1], copies=[copy])


def test_calibration_table_orders_by_measured_acceptance():
    # The drafter prefers rank 0 everywhere; the table says depth 2 is hopeless: its budget goes wide.
    table = np.array([[0.9, 0.5, 0.4], [0.05, 0.01, 0.01], [0.9, 0.9, 0.9]])
    tree = trees.build(random_logits(1, 3, 8, seed=2), 3, [0], width=3, calibration=table)
    assert rank_paths(tree) == [(0,), (1,), (2,)]


# -- visibility and the walk -----------------------------------------------------------------


def example_tree() -> trees.DraftTree:
    """Row 0: root 1; children 5 (top) and 6; 5 -> 7 (top) and 8 (copied); 7 -> 9. Row 1: a chain."""
    return trees._assemble([
        [(1, -1, 0, -1, False), (5, 0, 1, 0, False), (6, 0, 1, 1, False), (7, 1, 2, 0, False),
         (8, 1, 2, -1, True), (9, 3, 3, 0, False)],
        [(2, -1, 0, -1, False), (3, 0, 1, 0, False), (4, 1, 2, 0, True)],
    ])


def test_visibility_is_ancestors_and_self():
    tree = example_tree()
    vis = np.array(trees.visibility(tree))
    R, N = tree.shape
    for r in range(R):
        for i in range(N):
            seen = set(ancestry(tree.parents[r], i)) if i < tree.sizes[r] else {i}
            assert set(np.flatnonzero(vis[r, i])) == seen, (r, i)


def test_walk_follows_the_target_and_never_reaches_padding():
    tree = example_tree()
    picks = np.zeros((2, 6), np.int32)
    picks[0, [0, 1, 4]] = [5, 8, 30]  # 5, then 8 (copied, off the top chain), bonus 30
    picks[1, [0, 1, 2]] = [3, 4, 0]  # the whole chain; 0 is also padding's token
    w = trees.walk(tree, picks)
    assert w.paths == [[0, 1, 4], [0, 1, 2]] and w.bonus == [30, 0]
    assert w.committed(tree) == [[5, 8, 30], [3, 4, 0]]
    assert w.accepted == [2, 2] and w.left_chain == [True, False]
    assert w.drafted == [1, 2] and w.copied == [1, 1]
    none = trees.walk(tree, np.full((2, 6), 50))
    assert none.paths == [[0], [0]] and none.bonus == [50, 50] and none.left_chain == [False, False]


def test_extend_appends_several_caches_in_one_call():
    """Rows joining a batch together: each keeps its own keys, values and length whatever the other
    caches' capacities, and an empty cache joins as rows of nothing."""
    def cache(lengths):
        c = RaggedKVCache(len(lengths))
        if max(lengths):
            k = mx.random.normal((len(lengths), 2, max(lengths), 4))
            c.update_and_fetch(k, -k)
            c._set_lengths(lengths)
        return c

    parts = [cache([3]), cache([300, 5]), cache([0]), cache([7])]
    rows = [(None if c.keys is None else c.keys[i, :, :n], n) for c in parts for i, n in enumerate(c.lengths)]
    joined = parts[0]
    joined.extend(*parts[1:])
    assert joined.lengths == [3, 300, 5, 0, 7]
    for r, (keys, n) in enumerate(rows):
        assert n == 0 or mx.array_equal(joined.keys[r, :, :n], keys)
        assert mx.array_equal(joined.values[r, :, :n], -joined.keys[r, :, :n])


@pytest.mark.parametrize("kept", [[[0, 2, 4], [0, 1]], [[0, 1, 2], [0]], [[0], [0]]])
def test_compact_leaves_each_row_its_path_at_the_front(kept):
    """Rows whose path is already at the front (a chain, or a tree walked along its first nodes)
    keep their columns; any other row's path moves there; either way the row ends after its path."""
    cache = RaggedKVCache(2)
    prefix = mx.random.normal((2, 2, 3, 4))
    cache.update_and_fetch(prefix, -prefix)
    cache._set_lengths([3, 2])  # ragged: row 1 holds one column fewer
    nodes = mx.random.normal((2, 2, 5, 4))
    cache.update_and_fetch(nodes, -nodes)
    cache.compact([3, 2], kept)
    assert cache.lengths == [3 + len(kept[0]), 2 + len(kept[1])]
    for r, (start, path) in enumerate(zip([3, 2], kept)):
        expected = mx.concatenate([prefix[r, :, :start], nodes[r][:, mx.array(path)]], axis=1)
        assert mx.array_equal(cache.keys[r, :, : start + len(path)], expected)
        assert mx.array_equal(cache.values[r, :, : start + len(path)], -expected)


def test_coupled_picks_share_noise_by_depth():
    """A node at depth d is picked with the noise of position + d: what a chain at that
    position would draw, so siblings draw alike."""
    tree = example_tree()
    rule = Coupled(SamplingParams(temp=1.0), get_ops(), seed=7, vocab_size=40).at(11)
    logits = random_logits(2, 6, 40, seed=5)
    picks = trees.target_tokens([rule, rule.at(20)], logits, tree)
    for r, base in enumerate([11, 20]):
        for i in range(6):
            expected = rule.at(base + int(tree.depths[r, i])).first(logits[r, i])
            assert picks[r, i].item() == expected.item()
    greedy = trees.target_tokens([Greedy(get_ops())] * 2, logits, tree)
    assert mx.array_equal(greedy, mx.argmax(logits, axis=-1)).item()


def test_coupled_drafts_rank_candidates_by_their_perturbed_scores():
    """Under coupled sampling a tree's top chain is the chain's coupled proposals."""
    rule = Coupled(SamplingParams(temp=0.8, top_p=0.9), get_ops(), seed=3, vocab_size=40).at(6)
    draft = random_logits(1, 5, 16, seed=6)
    columns = mx.arange(24, 40)  # a draft vocabulary
    chained = trees.build(rule.scores(draft, columns), 5, [1], columns=columns, width=1)
    assert chained.tokens[0, 1:].tolist() == columns[rule.propose(draft, columns=columns)[0][0]].tolist()


# -- verification on the target ---------------------------------------------------------------

ALL = ["qwen3", "qwen2", "llama", "mistral", "gemma3_text", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
V = 64  # token ids below every family's vocabulary
# fp32 rounding: the tree forward multiplies other matrix shapes than plain text's (logits up to ~10)
TOL = dict(atol=5e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=ALL)
def family(request, tiny_pair):
    name = request.param
    model = build_hybrid(name) if name in CONFIGS else mlx_lm.load(str(tiny_pair(name)[0]))[0]
    return name, model, Target(model, [0, 2])


def test_every_verified_family_is_tested():
    assert FAMILIES == set(ALL)


def joined_cache(target: Target, prompts: list[list[int]]) -> tuple[list, list[mx.array]]:
    """A batch cache of one row per prompt, each prefilled on its own and joined (as the batch
    engine does), and each prompt's last logits."""
    cache, last = None, []
    for prompt in prompts:
        row = target.make_cache(1)
        last.append(target.prefill(mx.array(prompt), row, 8)[0])
        if cache is None:
            cache = row
        else:
            for joined, c in zip(cache, row):
                joined.extend(c)
    return cache, last


def plain_logits(model, text: list[int]) -> mx.array:
    """mlx_lm's logits over ``text``, no cache: the reference for every node and step."""
    return model(mx.array([text]))[0]


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("shape", ["tree", "deep", "chain"])
def test_tree_forward_equals_its_paths_as_chains(family, rows, shape):
    """Every node's logits equal mlx_lm's at the end of prompt + its path; after committing a
    path (off the top chain where there is one), the caches are what that text leaves: the next
    token's logits equal mlx_lm's, and the returned hidden states are the path's. ``deep``: a
    chain and a two-branch tree deeper than gemma3_text's sliding window. ``chain``: every row one
    branch of the same length, run as a chain verify, each row committing its own prefix."""
    name, model, target = family
    prompts = [PROMPT, PROMPT[3:16]][:rows]  # ragged: 20 and 13 tokens
    cache, _ = joined_cache(target, prompts)
    if shape == "tree":
        tree = trees.build(random_logits(rows, 5, V, seed=4), [9, 6][:rows], [7, 11][:rows], width=3)
        assert tree.depths.max() >= 2 and (tree.ranks > 0).any()
    elif shape == "chain":
        tree = trees._assemble([[(7 + r, -1, 0, -1, False)] + [(10 + i, i, i + 1, 0, False) for i in range(5)]
                                for r in range(rows)])
    else:
        deep = [(7, -1, 0, -1, False)] + [(10 + i, i, i + 1, 0, False) for i in range(9)]
        # Nodes 10..15: a second branch leaving the chain under node 3, down to depth 9.
        branch = [(40 + i, 9 + i if i else 3, 4 + i, 0 if i else 1, False) for i in range(6)]
        tree = trees._assemble([deep + branch, deep[:8]][:rows])
        assert tree.depths.max() > CONFIGS["gemma3_text"]["sliding_window"]
    forward = verify(target, cache, tree)
    assert forward.chain == (shape == "chain")  # a ragged one-branch batch (deep, 2 rows) pads: a tree
    for r, prompt in enumerate(prompts):
        for leaf in range(1, tree.sizes[r]):
            path = ancestry(tree.parents[r], leaf)
            ref = plain_logits(model, prompt + [int(tree.tokens[r, j]) for j in path])[-len(path):]
            assert mx.allclose(forward.logits[r, mx.array(path)], ref, **TOL).item(), (name, r, leaf)
    # Commit a path through a second-ranked node where there is one, then one plain token.
    paths = [ancestry(tree.parents[r], 2 + 3 * r if shape == "chain" else
                      max(range(tree.sizes[r]), key=lambda i: (tree.ranks[r, i] > 0, tree.depths[r, i])))
             for r in range(rows)]
    hidden = commit(target, cache, forward, paths)
    for r, prompt in enumerate(prompts):
        hidden_plain = target(mx.array([prompt + [int(tree.tokens[r, j]) for j in paths[r]]]), None)[1][0]
        assert mx.allclose(hidden[r, : len(paths[r])], hidden_plain[-len(paths[r]):], **TOL).item()
    for c in cache:
        if isinstance(c, RaggedKVCache):
            assert c.lengths == [len(p) + len(q) for p, q in zip(prompts, paths)]
    nxt = [13, 30][:rows]
    logits, _ = target(mx.array([[t] for t in nxt]), cache)
    for r, prompt in enumerate(prompts):
        ref = plain_logits(model, prompt + [int(tree.tokens[r, j]) for j in paths[r]] + [nxt[r]])[-1]
        assert mx.allclose(logits[r, 0], ref, **TOL).item(), (name, r)


def planted_logits(rng, references: list[list[int]], starts: list[int], D: int, Vd: int) -> mx.array:
    """Drafter scores whose candidates hold the true next tokens at random ranks (0, 1, 2, or
    missing), so trees get accepted along the top chain, off it, and not at all."""
    logits = rng.normal(size=(len(starts), D, Vd)).astype(np.float32)
    for r, (ref, start) in enumerate(zip(references, starts)):
        for d in range(D):
            pos = start + d + 1
            rank = rng.choice([0, 0, 1, 2, 3])
            if pos >= len(ref) or rank == 3:
                continue
            row = logits[r, d]
            row[ref[pos]] = -np.inf
            row[ref[pos]] = np.sort(row)[::-1][rank] + 1e-3
    return mx.array(logits)


def coupled_reference(model, prompt: list[int], rule: Coupled, n: int) -> list[int]:
    """Plain coupled decoding with mlx_lm's cache: the token at position t is the pick with t's noise."""
    cache, text, out = make_prompt_cache(model), list(prompt), []
    logits = model(mx.array([text]), cache=cache)[0, -1]
    for _ in range(n):
        out.append(rule.at(len(text)).first(logits).item())
        text.append(out[-1])
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("sampling", ["greedy", "coupled"])
def test_tree_decoding_equals_mlx_lm(family, sampling):
    """30 tokens by tree verify for two ragged rows (every third step a chain), equal to mlx_lm's
    greedy output, or under coupled sampling to plain decoding with the same seed."""
    name, model, target = family
    prompts, n = [PROMPT, PROMPT[5:12]], 30
    if sampling == "greedy":
        strategy = Greedy(get_ops())
        refs = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n + 8)] for p in prompts]
    else:
        strategy = Coupled(SamplingParams(temp=1.0), get_ops(), seed=11, vocab_size=target.vocab_size)
        refs = [coupled_reference(model, p, strategy, n + 8) for p in prompts]
    cache, last = joined_cache(target, prompts)
    out = [[strategy.at(len(p)).first(logits[0]).item()] for p, logits in zip(prompts, last)]
    rng, step, seen = np.random.default_rng(0), 0, set()
    while min(map(len, out)) < n:
        roots = [o[-1] for o in out]
        starts = [len(p) + len(o) - 1 for p, o in zip(prompts, out)]
        logits = planted_logits(rng, [p + r for p, r in zip(prompts, refs)], starts, 5, target.vocab_size)
        if step % 3 == 2:
            tree = chain(roots, np.array(mx.argmax(logits, axis=-1)).tolist())
        else:
            tree = trees.build(logits, [10, 7], roots, width=3)
        forward = verify(target, cache, tree)
        rules = [strategy.at(s + 1) for s in starts]
        w = trees.walk(tree, trees.target_tokens(rules, forward.logits, tree))
        commit(target, cache, forward, w.paths)
        for o, tokens in zip(out, w.committed(tree)):
            o.extend(tokens)
        seen |= {"left chain" if lc else "top chain" for lc, a in zip(w.left_chain, w.accepted) if a}
        seen |= {"rejected" for a in w.accepted if a == 0}
        step += 1
    for o, ref in zip(out, refs):
        assert o[:n] == ref[:n], name
    assert seen == {"left chain", "top chain", "rejected"}, seen


def test_unverified_family_is_refused():
    target = Target(build_hybrid("olmo3"), [0, 2])
    assert "olmo3" in refusal(target)
    cache, _ = joined_cache(target, [PROMPT])
    with pytest.raises(DFlashError, match="cannot verify a draft tree: .*olmo3"):
        verify(target, cache, chain([1], [[2, 3]]))
