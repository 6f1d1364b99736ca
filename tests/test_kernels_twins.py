"""The pure-MLX twins over rows: block attention with per-row lengths against a
loop over single rows, and the accept ops against per-row numpy references."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import kernels

# -- block attention ----------------------------------------------------------


def _ragged_qkv(seed: int, heads: int, kv_heads: int, L: int, lengths: list[int], D: int = 16):
    """Rows of q, k, v whose keys past each row's length are large garbage."""
    mx.random.seed(seed)
    R, S = len(lengths), max(lengths)
    q = mx.random.normal((R, heads, L, D))
    real = (mx.arange(S) < mx.array(lengths)[:, None])[:, None, :, None]
    k, v = (mx.where(real, mx.random.normal((R, kv_heads, S, D)), 1e4 * mx.random.normal((R, kv_heads, S, D)))
            for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("window, causal", [(None, False), (None, True), (3, True), (3, False), (1, True), (50, False)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (2, 2)])
def test_block_attention_rows_match_a_loop_over_single_rows(window, causal, heads, kv_heads) -> None:
    L, lengths = 4, [13, 4, 9, 5]  # a row of block only (no context), one of block + 1 context key
    q, k, v = _ragged_qkv(len(lengths) + (window or 0), heads, kv_heads, L, lengths)
    rule = {"scale": 0.25, "sliding_window": window, "causal": causal}
    got = kernels.block_attention_twin(q, k, v, **rule, lengths=mx.array(lengths, mx.int32))
    for r, n in enumerate(lengths):
        want = kernels.block_attention_twin(q[r : r + 1], k[r : r + 1, :, :n], v[r : r + 1, :, :n], **rule)
        assert mx.allclose(got[r : r + 1], want, atol=1e-5).item(), (r, n)


def test_block_attention_without_lengths_treats_rows_independently() -> None:
    q, k, v = _ragged_qkv(1, 4, 2, 3, [10, 10, 10])
    got = kernels.block_attention_twin(q, k, v, scale=0.25, sliding_window=4, causal=True)
    assert mx.array_equal(got, kernels.block_attention_twin(q, k, v, scale=0.25, sliding_window=4, causal=True,
                                                            lengths=mx.array([10, 10, 10])))
    for r in range(3):
        want = kernels.block_attention_twin(q[r : r + 1], k[r : r + 1], v[r : r + 1], scale=0.25,
                                            sliding_window=4, causal=True)
        assert mx.allclose(got[r : r + 1], want, atol=1e-5).item()


# -- accept ops -----------------------------------------------------------------


def _commit_ref(proposals: np.ndarray, n: int, last: int) -> list[int]:
    return [*proposals[:n].tolist(), int(last)] + [0] * (len(proposals) - n)


def match_ref(target: np.ndarray, proposals: np.ndarray) -> tuple[list[int], int]:
    n = 0
    while n < len(proposals) and proposals[n] == target[n]:
        n += 1
    return _commit_ref(proposals, n, target[n]), n


def rejection_ref(p: np.ndarray, q: np.ndarray, proposals: np.ndarray, u: np.ndarray) -> tuple[list[int], int]:
    B = p.shape[0]
    n = 0
    while n < B - 1 and u[n] * q[n, proposals[n]] < p[n, proposals[n]]:
        n += 1
    residual = np.maximum(p[n] - (q[n] if n < B - 1 else 0), 0).astype(np.float32)
    weights = residual if residual.sum() > 0 else p[n].astype(np.float32)
    cdf = np.cumsum(weights, dtype=np.float32)
    sample = min(int((cdf <= u[B - 1] * cdf[-1]).sum()), int(np.flatnonzero(weights > 0)[-1]))
    return _commit_ref(proposals, n, sample), n


def _assert_rows(got: tuple[mx.array, mx.array], want: list[tuple[list[int], int]]) -> None:
    tokens, n = got
    assert tokens.dtype == mx.int32 and n.dtype == mx.int32 and n.shape == (len(want),)
    assert tokens.tolist() == [w[0] for w in want] and n.tolist() == [w[1] for w in want]


def _greedy_rows(rng, n_correct: list[int], B: int, V: int = 40):
    """Logits with many ties (lowest index must win) and proposals right up to n_correct[r]."""
    logits = rng.integers(-3, 3, (len(n_correct), B, V)).astype(np.float32)
    proposals = np.argmax(logits, axis=-1)[:, : B - 1].astype(np.int32)
    for r, n in enumerate(n_correct):
        if n < B - 1:
            proposals[r, n] = (proposals[r, n] + 1) % V
    return logits, proposals


def test_greedy_and_match_accept_rows() -> None:
    rng = np.random.default_rng(0)
    logits, proposals = _greedy_rows(rng, [2, 4, 0, 3], B=5)
    want = [match_ref(np.argmax(x, axis=-1), x_prop) for x, x_prop in zip(logits, proposals)]
    assert [w[1] for w in want] == [2, 4, 0, 3]
    _assert_rows(kernels.greedy_accept_twin(mx.array(logits), mx.array(proposals)), want)
    target = mx.argmax(mx.array(logits), axis=-1)
    _assert_rows(kernels.match_accept_twin(target, mx.array(proposals)), want)


def test_accept_with_no_proposals_commits_the_bonus_of_every_row() -> None:
    logits = mx.array(np.random.default_rng(1).standard_normal((3, 1, 30)).astype(np.float32))
    _assert_rows(kernels.greedy_accept_twin(logits, mx.zeros((3, 0), mx.int32)),
                 [([int(np.argmax(np.array(x)))], 0) for x in logits[:, 0]])


def _probs(rng, shape, sharp=2.0) -> np.ndarray:
    x = np.exp(rng.standard_normal(shape) * sharp)
    return (x / x.sum(axis=-1, keepdims=True)).astype(np.float32)


def test_rejection_accept_rows() -> None:
    rng = np.random.default_rng(2)
    R, B, V = 6, 5, 50
    p, q = _probs(rng, (R, B, V)), _probs(rng, (R, B - 1, V))
    proposals = np.array([[rng.choice(V, p=row / row.sum()) for row in qr] for qr in q], np.int32)
    uniforms = rng.random((R, B)).astype(np.float32)
    q[1] = p[1, : B - 1]  # accepts everything: the bonus comes from p[1, B-1]
    q[2, :, proposals[2]] = 1.0  # rejects at once
    p[3, 0, proposals[3, 0]] = 0  # both models give x no mass: rejected, the residual is all zero,
    p[3, 0] /= p[3, 0].sum()  # so the sample comes from p
    q[3, 0] = p[3, 0]
    want = [rejection_ref(*row) for row in zip(p, q, proposals, uniforms)]
    assert want[1][1] == B - 1 and want[2][1] == 0 and want[3][1] == 0
    got = kernels.rejection_accept_twin(mx.array(p), mx.array(q), mx.array(proposals), mx.array(uniforms))
    _assert_rows(got, want)


def test_a_single_row_needs_no_row_axis() -> None:
    rng = np.random.default_rng(3)
    logits, proposals = _greedy_rows(rng, [1], B=4)
    tokens, n = kernels.greedy_accept_twin(mx.array(logits[0]), mx.array(proposals[0]))
    assert tokens.shape == (4,) and n.shape == ()
    assert (tokens.tolist(), n.item()) == match_ref(np.argmax(logits[0], axis=-1), proposals[0])
    p, q = _probs(rng, (4, 20)), _probs(rng, (3, 20))
    u = rng.random(4).astype(np.float32)
    tokens, n = kernels.rejection_accept_twin(mx.array(p), mx.array(q), mx.array(proposals[0] % 20), mx.array(u))
    assert (tokens.tolist(), n.item()) == rejection_ref(p, q, proposals[0] % 20, u)
