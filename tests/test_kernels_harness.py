"""Run the Metal kernels on the CPU harness (tests/kernel_harness) and compare
them with the pure-MLX twins that define their semantics."""

from __future__ import annotations

import shutil

import pytest

if shutil.which("g++") is None:
    pytest.skip("the kernel harness needs g++ (C++20)", allow_module_level=True)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import kernel_harness as H  # noqa: E402
from dflash_mlx import kernels  # noqa: E402

# Small threadgroups keep the thread count (one std::thread each) cheap and make
# V=100 cover a partial last stride; one test runs the shipping 512.
OPS = H.harness_ops(accept_threads=64)
TOL = {mx.float32: 2e-5, mx.float16: 2e-2, mx.bfloat16: 6e-2}


def _assert_same(got: tuple[mx.array, mx.array], want: tuple[mx.array, mx.array]) -> None:
    """Tokens (R, B) and num_accepted (R,) equal."""
    assert got[0].dtype == mx.int32 and got[0].shape == want[0].shape
    assert got[1].shape == want[1].shape == want[0].shape[:1]
    assert got[1].tolist() == want[1].tolist() and got[0].tolist() == want[0].tolist()


# -- block attention ----------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, D, heads, kv_heads, L, lengths, window, causal",
    [
        (mx.float32, 64, 4, 2, 4, [19], None, False),  # GQA, full attention
        (mx.float32, 64, 4, 2, 4, [19], None, True),  # full attention, causal block (is_causal)
        (mx.float32, 64, 4, 2, 4, [19], 5, True),  # sliding window reaching into context
        (mx.float32, 64, 4, 2, 6, [19], 3, False),  # window shorter than the block, bidirectional block
        (mx.float32, 128, 2, 2, 3, [7], 1, True),  # window 1: no context, causal block
        (mx.float32, 128, 2, 1, 3, [7], 50, True),  # window wider than everything
        (mx.float16, 64, 2, 1, 4, [9], 3, True),
        (mx.bfloat16, 64, 2, 2, 4, [9], None, False),
        # Ragged rows: a full row, a block-only row (no context), rows in between.
        (mx.float32, 64, 4, 2, 4, [19, 4, 11], None, False),
        (mx.float32, 64, 4, 2, 4, [19, 4, 11], None, True),
        (mx.float32, 64, 4, 2, 4, [6, 19, 12], 5, True),
        (mx.float32, 128, 2, 1, 3, [7, 3, 5], 2, False),
        (mx.float16, 128, 4, 1, 4, [15, 9], 6, True),
        (mx.bfloat16, 64, 2, 2, 4, [5, 9], None, True),
        # Rows without lengths: every row fills all S.
        (mx.float32, 64, 4, 2, 4, [10, 10], 3, True),
        # 9 rows: the lengths buffer is bound as `device` (under 8 elements: `constant`).
        (mx.float32, 64, 2, 1, 2, [2, 3, 4, 5, 6, 7, 8, 9, 10], 3, True),
    ],
)
def test_block_attention_matches_twin(dtype, D, heads, kv_heads, L, lengths, window, causal) -> None:
    mx.random.seed(D + len(lengths) + (window or 0))
    R, S = len(lengths), max(lengths)
    q = mx.random.normal((R, heads, L, D)).astype(dtype)
    k = mx.random.normal((R, kv_heads, S, D)).astype(dtype)
    v = mx.random.normal((R, kv_heads, S, D)).astype(dtype)
    rule = {"scale": D**-0.5, "sliding_window": window, "causal": causal}
    if len(set(lengths)) > 1 or R > 2:
        rule["lengths"] = mx.array(lengths, mx.int32)
    got = OPS.block_attention(q, k, v, **rule)
    want = kernels.block_attention_twin(q, k, v, **rule)
    assert got.shape == want.shape and got.dtype == dtype
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert err < TOL[dtype], err


def test_block_attention_never_reads_padding() -> None:
    """NaN past a row's length would poison any softmax that touched it."""
    mx.random.seed(4)
    lengths = [9, 5]
    q = mx.random.normal((2, 2, 3, 64))
    real = (mx.arange(9) < mx.array(lengths)[:, None])[:, None, :, None]
    k, v = (mx.where(real, mx.random.normal((2, 1, 9, 64)), mx.nan) for _ in range(2))
    got = OPS.block_attention(q, k, v, scale=0.125, sliding_window=None, lengths=mx.array(lengths))
    for r, n in enumerate(lengths):
        want = kernels.block_attention_twin(q[r : r + 1], k[r : r + 1, :, :n], v[r : r + 1, :, :n],
                                            scale=0.125, sliding_window=None)
        assert mx.abs(got[r : r + 1] - want).max().item() < 2e-5


def test_block_attention_unsupported_head_dim_falls_back_to_twin() -> None:
    q, kv = mx.ones((1, 2, 2, 48)), mx.ones((1, 2, 5, 48))
    out = OPS.block_attention(q, kv, kv, scale=0.1, sliding_window=None)
    assert out.shape == q.shape
    assert any("head_dim 48" in reason for reason in OPS.fallbacks)  # reported in the stats


# -- greedy accept ------------------------------------------------------------


def _greedy_case(rng, B, V, n_correct, dtype=mx.float32, ties=False):
    """Logits (R, B, V) and proposals (R, B-1) right up to n_correct[r] in row r."""
    R = len(n_correct)
    values = rng.integers(-3, 3, (R, B, V)) if ties else rng.standard_normal((R, B, V))
    logits = mx.array(values.astype(np.float32)).astype(dtype)
    proposals = np.array(mx.argmax(logits, axis=-1))[:, : B - 1].copy()
    for r, n in enumerate(n_correct):
        if n < B - 1:
            proposals[r, n] = (proposals[r, n] + 1) % V
    return logits, mx.array(proposals.astype(np.int32))


@pytest.mark.parametrize(
    "B, V, n_correct, dtype, ties",
    [
        (5, 100, [2], mx.float32, False),
        (5, 100, [4], mx.float32, False),  # all accepted: bonus from the last row
        (5, 100, [0], mx.float32, False),  # none accepted
        (1, 100, [0], mx.float32, False),  # B = 1: just the bonus token
        (4, 193, [3], mx.float32, True),  # many ties: lowest index must win
        (6, 64, [3], mx.float16, True),
        (6, 257, [1], mx.bfloat16, True),
        (9, 100, [5], mx.float32, False),  # proposals bound as device, not constant
        (5, 100, [2, 4, 0, 3], mx.float32, True),  # rows stopping at different places
        (1, 100, [0, 0, 0], mx.float32, False),  # B = 1 in every row
        (6, 257, [5, 0, 2], mx.bfloat16, True),
    ],
)
def test_greedy_accept_matches_twin(B, V, n_correct, dtype, ties) -> None:
    rng = np.random.default_rng(B * V + sum(n_correct) + len(n_correct))
    logits, proposals = _greedy_case(rng, B, V, n_correct, dtype, ties)
    want = kernels.greedy_accept_twin(logits, proposals)
    assert want[1].tolist() == n_correct
    _assert_same(OPS.greedy_accept(logits, proposals), want)
    if len(n_correct) == 1:  # the same row without the row axis
        one = OPS.greedy_accept(logits[0], proposals[0])
        _assert_same((one[0][None], one[1][None]), want)
        assert one[1].shape == ()


def test_greedy_accept_all_equal_rows_pick_index_zero() -> None:
    logits = mx.full((1, 3, 70), -mx.inf)
    proposals = mx.array([[0, 0]], mx.int32)
    _assert_same(OPS.greedy_accept(logits, proposals), (mx.array([[0, 0, 0]], mx.int32), mx.array([2])))


def test_greedy_accept_shipping_threadgroup() -> None:
    logits, proposals = _greedy_case(np.random.default_rng(7), 4, 1500, [2, 3], ties=True)
    ops = H.harness_ops()
    _assert_same(ops.greedy_accept(logits, proposals), kernels.greedy_accept_twin(logits, proposals))


# -- rejection accept ---------------------------------------------------------


def _probs(rng, shape, sharp=1.0):
    return mx.softmax(mx.array(rng.standard_normal(shape).astype(np.float32) * sharp), axis=-1)


@pytest.mark.parametrize("seed", range(4))
def test_rejection_accept_random_matches_twin(seed: int) -> None:
    rng = np.random.default_rng(seed)
    R, B, V = 1 + seed, 5, 100
    p, q = _probs(rng, (R, B, V), 2.0), _probs(rng, (R, B - 1, V), 2.0)
    proposals = mx.array([[rng.choice(V, p=np.array(x) / float(x.sum())) for x in row] for row in q], mx.int32)
    uniforms = mx.array(rng.random((R, B)).astype(np.float32))
    _assert_same(
        OPS.rejection_accept(p, q, proposals, uniforms),
        kernels.rejection_accept_twin(p, q, proposals, uniforms),
    )


def test_rejection_accept_edge_cases_as_rows_of_one_dispatch() -> None:
    rng = np.random.default_rng(11)
    B, V = 4, 100
    p = np.array(_probs(rng, (3, B, V)))
    proposals = mx.array([[3, 50, 99]] * 3, mx.int32)
    u = mx.array([[0.9, 0.5, 0.99, 0.3]] * 3, mx.float32)
    q = np.ones((3, B - 1, V), np.float32)  # row 1: q puts all mass on x, none accepted
    q[0] = p[0, : B - 1]  # row 0: q == p, all accepted
    # Row 2 rejects at position 1 a token both models give zero: the residual is
    # all zero, so the sample falls back to p itself.
    p[2, 1, 50] = 0
    q[2] = p[2, : B - 1]
    p, q = mx.array(p), mx.array(q)
    want = kernels.rejection_accept_twin(p, q, proposals, u)
    assert want[1].tolist() == [B - 1, 0, 1]
    _assert_same(OPS.rejection_accept(p, q, proposals, u), want)


def test_rejection_accept_b1_and_half_precision() -> None:
    rng = np.random.default_rng(5)
    p = _probs(rng, (2, 1, 300))
    u = mx.array([[0.42], [0.9]], mx.float32)
    empty = mx.zeros((2, 0), mx.int32)
    _assert_same(
        OPS.rejection_accept(p, mx.zeros((2, 0, 300)), empty, u),
        kernels.rejection_accept_twin(p, mx.zeros((2, 0, 300)), empty, u),
    )
    p16, q16 = _probs(rng, (3, 300)).astype(mx.float16), _probs(rng, (2, 300)).astype(mx.float16)
    proposals = mx.array([7, 8], mx.int32)
    u = mx.array([0.2, 0.99, 0.6], mx.float32)
    got = OPS.rejection_accept(p16, q16, proposals, u)  # one row without the row axis
    want = kernels.rejection_accept_twin(p16, q16, proposals, u)
    assert got[0].shape == (3,) and got[1].shape == ()
    _assert_same((got[0][None], got[1][None]), (want[0][None], want[1][None]))


# -- wrong kernels must fail --------------------------------------------------


def _mutated(name: str, old: str, new: str) -> str:
    source = kernels.metal_source(f"{name}.metal")
    assert old in source
    return source.replace(old, new, 1)


def test_harness_catches_wrong_window_and_wrong_ratio_test() -> None:
    mx.random.seed(3)
    q, k, v = (mx.random.normal((1, 2, 4, 64)), mx.random.normal((1, 2, 9, 64)), mx.random.normal((1, 2, 9, 64)))
    launch = kernels.plan_block_attention(q, k, v, scale=0.125, sliding_window=3, causal=True)
    off_by_one = _mutated("block_attention", "qpos - window + 1", "qpos - window")
    got = H.run(launch, off_by_one)[0]
    want = kernels.block_attention_twin(q, k, v, scale=0.125, sliding_window=3, causal=True)
    assert mx.abs(got - want).max().item() > 1e-3
    # Causality ignored: later block rows leak into earlier ones.
    not_causal = _mutated("block_attention", "causal ? qpos + 1 : end", "end")
    assert mx.abs(H.run(launch, not_causal)[0] - want).max().item() > 1e-3

    # Accept on equality: wrong exactly when u * q(x) == p(x), here q == p, u -> 1.
    p = mx.array([[[0.5, 0.5], [0.25, 0.75]]])
    proposals, u = mx.array([[0]], mx.int32), mx.array([[1.0, 0.5]])
    launch = kernels.plan_rejection_accept(p, p[:, :1], proposals, u, threads=64)
    lenient = _mutated("rejection_accept", "row_uniforms[accepted] * float(row_q[at]) < float(row_p[at])",
                       "row_uniforms[accepted] * float(row_q[at]) <= float(row_p[at])")
    want = kernels.rejection_accept_twin(p, p[:, :1], proposals, u)
    assert want[1].tolist() == [0] and H.run(launch, lenient)[1].tolist() == [1]


def test_harness_catches_rows_that_ignore_their_own_length_or_offset() -> None:
    mx.random.seed(5)
    q, k, v = (mx.random.normal((2, 2, 3, 64)), mx.random.normal((2, 1, 9, 64)), mx.random.normal((2, 1, 9, 64)))
    lengths = mx.array([9, 5])
    launch = kernels.plan_block_attention(q, k, v, scale=0.125, sliding_window=None, lengths=lengths)
    want = kernels.block_attention_twin(q, k, v, scale=0.125, sliding_window=None, lengths=lengths)
    assert mx.abs(H.run(launch)[0] - want).max().item() < 2e-5
    whole_rows = _mutated("block_attention", "const int end = min(max(int(lengths[batch]), L), S);",
                          "const int end = S;")
    got = H.run(launch, whole_rows)[0]
    assert mx.abs(got[0] - want[0]).max().item() < 2e-5  # the full row is still right,
    assert mx.abs(got[1] - want[1]).max().item() > 1e-3  # the short one sees its padding

    logits, proposals = _greedy_case(np.random.default_rng(2), 4, 100, [3, 0, 1])
    launch = kernels.plan_greedy_accept(logits, proposals, threads=64)
    first_row_only = _mutated("greedy_accept", "logits + (size_t(r) * B + n) * V", "logits + size_t(n) * V")
    assert H.run(launch, first_row_only)[1].tolist() != [3, 0, 1]


def test_harness_catches_wrong_tie_break() -> None:
    logits = mx.array([[[1.0, 3.0, 3.0, 0.0] * 20] * 2])
    launch = kernels.plan_greedy_accept(logits, mx.array([[1]], mx.int32), threads=64)
    header = kernels.metal_source(kernels.HEADER)
    highest_wins = header.replace("j < index", "j > index")
    assert highest_wins != header
    assert H.run(launch)[0].tolist() == [[1, 1]]
    assert H.run(launch, None, highest_wins)[0].tolist() != [[1, 1]]


def test_poisoned_outputs_expose_unwritten_tokens() -> None:
    poison = int(np.frombuffer(bytes([H.POISON] * 4), np.int32)[0])
    logits, proposals = _greedy_case(np.random.default_rng(1), 5, 100, [1, 2])
    launch = kernels.plan_greedy_accept(logits, proposals, threads=64)
    lazy = _mutated("greedy_accept", "for (int b = t; b < B; b += NT)", "for (int b = t; b <= n; b += NT)")
    assert kernels.greedy_accept_twin(logits, proposals)[0].tolist()[0][2:] == [0, 0, 0]
    tokens = H.run(launch, lazy)[0].tolist()
    assert tokens[0][2:] == [poison] * 3, tokens

    p = _probs(np.random.default_rng(2), (3, 2, 50))
    launch = kernels.plan_rejection_accept(p, p[:, :1], mx.array([[0]] * 3), mx.full((3, 2), 0.5), threads=64)
    one_count = _mutated("rejection_accept", "num_accepted[r] = n;", "num_accepted[0] = n;")
    assert H.run(launch, one_count)[1].tolist()[1:] == [poison] * 2


# -- a few decode steps through the harness -----------------------------------


def _speculative_greedy(ops: kernels.KernelOps, steps: int, starts=(5, 40, 81), B: int = 4) -> list[list[int]]:
    """Toy batched draft-verify loop, one row per start token: the target's next
    token is argmax(W[prev]); the drafter perturbs that chain with block attention
    over the row's own context, so some proposals are right and some are not, and
    the rows' contexts grow apart (ragged lengths, right-padded)."""
    V, D, heads = 97, 64, 2
    key = mx.random.key(0)
    kw, ke, kp = mx.random.split(key, 3)
    W = mx.random.normal((V, V), key=kw)
    E = mx.random.normal((V, heads * D), key=ke)
    P = mx.random.normal((D, V), key=kp) * 0.3
    rows = [[start] for start in starts]
    block = mx.broadcast_to(E[:1], (B - 1, heads * D))
    for _ in range(steps):
        lengths = [len(tokens) + B - 1 for tokens in rows]
        S = max(lengths)
        kv = mx.stack([
            mx.concatenate([E[mx.array(tokens)], block, mx.zeros((S - n, heads * D))])
            for tokens, n in zip(rows, lengths)
        ]).reshape(len(rows), S, heads, D).transpose(0, 2, 1, 3)
        queries = mx.broadcast_to(block.reshape(1, B - 1, heads, D).transpose(0, 2, 1, 3), (len(rows), heads, B - 1, D))
        attn = ops.block_attention(queries, kv, kv, scale=D**-0.5, sliding_window=3, causal=True,
                                   lengths=mx.array(lengths, mx.int32))
        noise = attn.mean(axis=1) @ P  # (R, B - 1, V)
        proposals = []
        for r, tokens in enumerate(rows):
            prev, chain = tokens[-1], []
            for i in range(B - 1):
                prev = int(mx.argmax(W[prev] + noise[r, i]))
                chain.append(prev)
            proposals.append(chain)
        logits = W[mx.array([[tokens[-1], *chain] for tokens, chain in zip(rows, proposals)])]
        out, n = ops.greedy_accept(logits, mx.array(proposals, mx.int32))
        for tokens, committed, accepted in zip(rows, out.tolist(), n.tolist()):
            tokens += committed[: accepted + 1]
    return rows


def test_greedy_decode_steps_through_harness_match_twins_and_plain_greedy() -> None:
    got = _speculative_greedy(OPS, steps=4)
    assert got == _speculative_greedy(kernels.TWINS, steps=4)
    key = mx.random.key(0)
    W = mx.random.normal((97, 97), key=mx.random.split(key, 3)[0])
    for tokens in got:
        plain = tokens[:1]
        while len(plain) < len(tokens):
            plain.append(int(mx.argmax(W[plain[-1]])))
        assert tokens == plain
    assert len({len(tokens) for tokens in got}) > 1  # the rows accepted different numbers
    assert max(map(len, got)) > 1 + 4  # some proposal was accepted at least once
