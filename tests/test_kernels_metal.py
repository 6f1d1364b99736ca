"""Real Metal kernels against the twins (macOS with Metal only), and the
backend selection everywhere."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import kernels
from dflash_mlx.errors import DFlashError

needs_metal = pytest.mark.skipif(
    not mx.metal.is_available(), reason="Metal is not available (kernels run on a Mac only)"
)


def test_get_ops_selects_backend() -> None:
    assert kernels.get_ops(False) is kernels.TWINS
    if mx.metal.is_available():
        assert kernels.get_ops(None).path == "metal"
        assert kernels.get_ops(None) is kernels.get_ops(True)  # built once
    else:
        assert kernels.get_ops(None).path == "mlx"
        with pytest.raises(DFlashError, match="not available"):
            kernels.get_ops(True)


@needs_metal
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window, causal", [(None, False), (None, True), (1, True), (7, True), (7, False), (4096, True)])
@pytest.mark.parametrize("lengths", [None, [300, 16, 150, 17]])
def test_metal_block_attention(dtype, D, window, causal, lengths) -> None:
    mx.random.seed(D)
    R = 1 if lengths is None else len(lengths)
    q = mx.random.normal((R, 8, 16, D)).astype(dtype)
    k = mx.random.normal((R, 2, 300, D)).astype(dtype)
    v = mx.random.normal((R, 2, 300, D)).astype(dtype)
    rule = {"scale": D**-0.5, "sliding_window": window, "causal": causal,
            "lengths": None if lengths is None else mx.array(lengths, mx.int32)}
    ops = kernels.get_ops(True)
    got = ops.block_attention(q, k, v, **rule)
    want = kernels.block_attention_twin(q, k, v, **rule)
    tol = 2e-5 if dtype == mx.float32 else 3e-2
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < tol
    assert not ops.fallbacks


@needs_metal
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("R, B, V", [(1, 1, 5), (1, 4, 1000), (3, 4, 1000), (1, 16, 151_936), (8, 16, 151_936)])
def test_metal_greedy_accept(dtype, R, B, V) -> None:
    rng = np.random.default_rng(B)
    logits = mx.array(rng.integers(-4, 4, (R, B, V)).astype(np.float32)).astype(dtype)
    target = mx.argmax(logits, axis=-1).astype(mx.int32)
    ops = kernels.get_ops(True)
    # Row r's first wrong proposal is at (shift + r) % B: rows stop at different places.
    for shift in {0, B // 2, B - 1}:
        wrong = (shift + mx.arange(R)[:, None]) % B == mx.arange(B - 1)
        proposals = mx.where(wrong, (target[:, : B - 1] + 1) % V, target[:, : B - 1])
        got = ops.greedy_accept(logits, proposals)
        want = kernels.greedy_accept_twin(logits, proposals)
        assert got[1].tolist() == want[1].tolist() and got[0].tolist() == want[0].tolist()
        one = ops.greedy_accept(logits[0], proposals[0])
        assert one[1].item() == want[1][0].item() and one[0].tolist() == want[0][0].tolist()
    assert not ops.fallbacks


@needs_metal
@pytest.mark.parametrize("seed", range(5))
def test_metal_rejection_accept(seed: int) -> None:
    rng = np.random.default_rng(seed)
    R, B, V = 1 + seed, 8, 32_000
    p = mx.softmax(mx.array(rng.standard_normal((R, B, V)).astype(np.float32) * 3), axis=-1)
    q = mx.softmax(mx.array(rng.standard_normal((R, B - 1, V)).astype(np.float32) * 3), axis=-1)
    proposals = mx.argmax(q, axis=-1).astype(mx.int32)
    uniforms = mx.array(rng.random((R, B)).astype(np.float32))
    ops = kernels.get_ops(True)
    got = ops.rejection_accept(p, q, proposals, uniforms)
    want = kernels.rejection_accept_twin(p, q, proposals, uniforms)
    assert got[1].tolist() == want[1].tolist() and got[0].tolist() == want[0].tolist()
    assert not ops.fallbacks
