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
    assert got[0].dtype == mx.int32 and got[0].shape == want[0].shape
    assert got[1].shape == () and int(got[1]) == int(want[1])
    assert got[0].tolist() == want[0].tolist()


# -- block attention ----------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, D, heads, kv_heads, L, S, window, causal",
    [
        (mx.float32, 64, 4, 2, 4, 19, None, False),  # GQA, full attention
        (mx.float32, 64, 4, 2, 4, 19, None, True),  # full attention, causal block (is_causal)
        (mx.float32, 64, 4, 2, 4, 19, 5, True),  # sliding window reaching into context
        (mx.float32, 64, 4, 2, 6, 19, 3, False),  # window shorter than the block, bidirectional block
        (mx.float32, 128, 2, 2, 3, 7, 1, True),  # window 1: no context, causal block
        (mx.float32, 128, 2, 1, 3, 7, 50, True),  # window wider than everything
        (mx.float16, 64, 2, 1, 4, 9, 3, True),
        (mx.bfloat16, 64, 2, 2, 4, 9, None, False),
    ],
)
def test_block_attention_matches_twin(dtype, D, heads, kv_heads, L, S, window, causal) -> None:
    mx.random.seed(D + S + (window or 0))
    q = mx.random.normal((1, heads, L, D)).astype(dtype)
    k = mx.random.normal((1, kv_heads, S, D)).astype(dtype)
    v = mx.random.normal((1, kv_heads, S, D)).astype(dtype)
    scale = D**-0.5
    got = OPS.block_attention(q, k, v, scale=scale, sliding_window=window, causal=causal)
    want = kernels.block_attention_twin(q, k, v, scale=scale, sliding_window=window, causal=causal)
    assert got.shape == want.shape and got.dtype == dtype
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert err < TOL[dtype], err


def test_block_attention_unsupported_head_dim_falls_back_to_twin() -> None:
    q, kv = mx.ones((1, 2, 2, 48)), mx.ones((1, 2, 5, 48))
    out = OPS.block_attention(q, kv, kv, scale=0.1, sliding_window=None)
    assert out.shape == q.shape
    assert any("head_dim 48" in reason for reason in OPS.fallbacks)  # reported in the stats


# -- greedy accept ------------------------------------------------------------


def _greedy_case(rng, B, V, n_correct, dtype=mx.float32, ties=False):
    values = rng.integers(-3, 3, (B, V)) if ties else rng.standard_normal((B, V))
    logits = mx.array(values.astype(np.float32)).astype(dtype)
    target = np.array(mx.argmax(logits, axis=-1))
    proposals = target[: B - 1].copy()
    if n_correct < B - 1:
        proposals[n_correct] = (proposals[n_correct] + 1) % V
    return logits, mx.array(proposals.astype(np.int32))


@pytest.mark.parametrize(
    "B, V, n_correct, dtype, ties",
    [
        (5, 100, 2, mx.float32, False),
        (5, 100, 4, mx.float32, False),  # all accepted: bonus from the last row
        (5, 100, 0, mx.float32, False),  # none accepted
        (1, 100, 0, mx.float32, False),  # B = 1: just the bonus token
        (4, 193, 3, mx.float32, True),  # many ties: lowest index must win
        (6, 64, 3, mx.float16, True),
        (6, 257, 1, mx.bfloat16, True),
        (9, 100, 5, mx.float32, False),  # proposals bound as device, not constant
    ],
)
def test_greedy_accept_matches_twin(B, V, n_correct, dtype, ties) -> None:
    rng = np.random.default_rng(B * V + n_correct)
    logits, proposals = _greedy_case(rng, B, V, n_correct, dtype, ties)
    want = kernels.greedy_accept_twin(logits, proposals)
    assert int(want[1]) == n_correct
    _assert_same(OPS.greedy_accept(logits, proposals), want)


def test_greedy_accept_all_equal_rows_pick_index_zero() -> None:
    logits = mx.full((3, 70), -mx.inf)
    proposals = mx.array([0, 0], mx.int32)
    _assert_same(OPS.greedy_accept(logits, proposals), (mx.array([0, 0, 0], mx.int32), mx.array(2)))


def test_greedy_accept_shipping_threadgroup() -> None:
    logits, proposals = _greedy_case(np.random.default_rng(7), 4, 1500, 2, ties=True)
    ops = H.harness_ops()
    _assert_same(ops.greedy_accept(logits, proposals), kernels.greedy_accept_twin(logits, proposals))


# -- rejection accept ---------------------------------------------------------


def _probs(rng, rows, V, sharp=1.0):
    return mx.softmax(mx.array(rng.standard_normal((rows, V)).astype(np.float32) * sharp), axis=-1)


@pytest.mark.parametrize("seed", range(6))
def test_rejection_accept_random_matches_twin(seed: int) -> None:
    rng = np.random.default_rng(seed)
    B, V = 5, 100
    p, q = _probs(rng, B, V, 2.0), _probs(rng, B - 1, V, 2.0)
    proposals = mx.array([rng.choice(V, p=np.array(row) / float(row.sum())) for row in q], mx.int32)
    uniforms = mx.array(rng.random(B).astype(np.float32))
    _assert_same(
        OPS.rejection_accept(p, q, proposals, uniforms),
        kernels.rejection_accept_twin(p, q, proposals, uniforms),
    )


def test_rejection_accept_edge_cases() -> None:
    rng = np.random.default_rng(11)
    B, V = 4, 100
    p = _probs(rng, B, V)
    proposals = mx.array([3, 50, 99], mx.int32)
    u = mx.array([0.9, 0.5, 0.99, 0.3], mx.float32)
    cases = {
        "all accepted (q == p)": (p, p[: B - 1], u, B - 1),
        "none accepted (q puts all mass on x)": (p, mx.ones((B - 1, V)), u, 0),
    }
    # Row 1 rejects a token both models give zero: the residual is all zero,
    # so the sample falls back to p itself.
    zero = np.array(p)
    zero[1, 50] = 0
    zero = mx.array(zero)
    cases["zero residual"] = (zero, zero[: B - 1], u, 1)
    for name, (pp, qq, uu, n) in cases.items():
        want = kernels.rejection_accept_twin(pp, qq, proposals, uu)
        assert int(want[1]) == n, name
        _assert_same(OPS.rejection_accept(pp, qq, proposals, uu), want)


def test_rejection_accept_b1_and_half_precision() -> None:
    rng = np.random.default_rng(5)
    p = _probs(rng, 1, 300)
    u = mx.array([0.42], mx.float32)
    empty = mx.zeros((0,), mx.int32)
    _assert_same(
        OPS.rejection_accept(p, mx.zeros((0, 300)), empty, u),
        kernels.rejection_accept_twin(p, mx.zeros((0, 300)), empty, u),
    )
    p16, q16 = _probs(rng, 3, 300).astype(mx.float16), _probs(rng, 2, 300).astype(mx.float16)
    proposals = mx.array([7, 8], mx.int32)
    u = mx.array([0.2, 0.99, 0.6], mx.float32)
    _assert_same(
        OPS.rejection_accept(p16, q16, proposals, u),
        kernels.rejection_accept_twin(p16, q16, proposals, u),
    )


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
    not_causal = _mutated("block_attention", "causal ? qpos + 1 : S", "S")
    assert mx.abs(H.run(launch, not_causal)[0] - want).max().item() > 1e-3

    # Accept on equality: wrong exactly when u * q(x) == p(x), here q == p, u -> 1.
    p = mx.array([[0.5, 0.5], [0.25, 0.75]])
    launch = kernels.plan_rejection_accept(p, p[:1], mx.array([0], mx.int32), mx.array([1.0, 0.5]), threads=64)
    lenient = _mutated("rejection_accept", "uniforms[accepted] * float(q[at]) < float(p[at])",
                       "uniforms[accepted] * float(q[at]) <= float(p[at])")
    want = kernels.rejection_accept_twin(p, p[:1], mx.array([0], mx.int32), mx.array([1.0, 0.5]))
    assert int(want[1]) == 0 and int(H.run(launch, lenient)[1]) == 1


def test_harness_catches_wrong_tie_break() -> None:
    logits = mx.array([[1.0, 3.0, 3.0, 0.0] * 20] * 2)
    launch = kernels.plan_greedy_accept(logits, mx.array([1], mx.int32), threads=64)
    header = kernels.metal_source(kernels.HEADER)
    highest_wins = header.replace("j < index", "j > index")
    assert highest_wins != header
    assert H.run(launch)[0].tolist() == [1, 1]
    assert H.run(launch, None, highest_wins)[0].tolist() != [1, 1]


def test_poisoned_outputs_expose_unwritten_tokens() -> None:
    logits, proposals = _greedy_case(np.random.default_rng(1), 5, 100, 1)
    launch = kernels.plan_greedy_accept(logits, proposals, threads=64)
    lazy = _mutated("greedy_accept", "for (int b = t; b < B; b += NT)", "for (int b = t; b <= n; b += NT)")
    assert kernels.greedy_accept_twin(logits, proposals)[0].tolist()[2:] == [0, 0, 0]
    tokens = H.run(launch, lazy)[0].tolist()
    assert tokens[2:] == [int(np.frombuffer(bytes([H.POISON] * 4), np.int32)[0])] * 3, tokens


# -- a few decode steps through the harness -----------------------------------


def _speculative_greedy(ops: kernels.KernelOps, steps: int, B: int = 4) -> list[int]:
    """Toy draft-verify loop: the target's next token is argmax(W[prev]); the
    drafter perturbs that chain with block attention over its context, so some
    proposals are right and some are not."""
    V, D, heads = 97, 64, 2
    key = mx.random.key(0)
    kw, ke, kp = mx.random.split(key, 3)
    W = mx.random.normal((V, V), key=kw)
    E = mx.random.normal((V, heads * D), key=ke)
    P = mx.random.normal((D, V), key=kp) * 0.3
    tokens = [5]
    for _ in range(steps):
        context = E[mx.array(tokens)].reshape(len(tokens), heads, D).transpose(1, 0, 2)[None]
        block = mx.broadcast_to(E[:1].reshape(1, heads, 1, D), (1, heads, B - 1, D))
        kv = mx.concatenate([context, block], axis=2)
        attn = ops.block_attention(block, kv, kv, scale=D**-0.5, sliding_window=3, causal=True)
        noise = attn[0].mean(axis=0) @ P  # (B - 1, V)
        proposals, prev = [], tokens[-1]
        for i in range(B - 1):
            prev = int(mx.argmax(W[prev] + noise[i]))
            proposals.append(prev)
        rows = W[mx.array([tokens[-1], *proposals])]
        out, n = ops.greedy_accept(rows, mx.array(proposals, mx.int32))
        tokens += out.tolist()[: int(n) + 1]
    return tokens


def test_greedy_decode_steps_through_harness_match_twins_and_plain_greedy() -> None:
    got = _speculative_greedy(OPS, steps=4)
    assert got == _speculative_greedy(kernels.TWINS, steps=4)
    key = mx.random.key(0)
    W = mx.random.normal((97, 97), key=mx.random.split(key, 3)[0])
    plain = [5]
    while len(plain) < len(got):
        plain.append(int(mx.argmax(W[plain[-1]])))
    assert got == plain
    assert len(got) > 1 + 4  # some proposal was accepted at least once
