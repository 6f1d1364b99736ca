"""The two hot spots of the draft-verify loop: block attention and verify/accept.

Each op has a pure-MLX *twin* that runs on every backend and defines the
semantics. Metal kernels with the same contract (sources in ``metal/``) are
used instead when Metal is available; ``kernel_path()`` says which one ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx


# -- block attention ---------------------------------------------------------


def block_attention_twin(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, sliding_window: int | None
) -> mx.array:
    """Attention of the drafter's block queries over ``[context ; block]``.

    q: (1, n_heads, L, D), the block rows at absolute positions S-L .. S-1.
    k, v: (1, n_kv_heads, S, D), context rows at positions 0 .. S-L-1 followed by
    the block. Full attention (``sliding_window=None``) needs no mask: the block is
    bidirectional and sees all context. A sliding-window layer lets query position
    i see key position j iff ``j <= i and i - j < sliding_window``.
    """
    if sliding_window is None:
        mask = None
    else:
        L, S = q.shape[2], k.shape[2]
        qpos = mx.arange(S - L, S)[:, None]
        kpos = mx.arange(S)[None]
        mask = (kpos <= qpos) & (qpos - kpos < sliding_window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


# -- verify / accept ----------------------------------------------------------
#
# All accept ops take the B verify rows of the target and the B-1 proposals and
# return (tokens, num_accepted): tokens[:n] are the accepted proposals, tokens[n]
# the bonus (or residual) token, tokens[n+1:] are zero. One host sync reads both.


def _commit(proposals: mx.array, n: mx.array, last: mx.array) -> tuple[mx.array, mx.array]:
    B = proposals.shape[0] + 1
    idx = mx.arange(B)
    padded = mx.concatenate([proposals.astype(mx.int32), mx.zeros((1,), mx.int32)])
    tokens = mx.where(idx < n, padded, mx.where(idx == n, last.astype(mx.int32), 0))
    return tokens, n.astype(mx.int32)


def match_accept_twin(target_tokens: mx.array, proposals: mx.array) -> tuple[mx.array, mx.array]:
    """Accept the longest prefix of proposals equal to the target's own tokens.

    Exact for any sampler of the target: each target token is drawn from the
    row conditioned on the proposals before it, which are the committed tokens.
    """
    matches = (proposals == target_tokens[:-1]).astype(mx.int32)
    n = mx.cumprod(matches).sum() if matches.size else mx.array(0, mx.int32)
    return _commit(proposals, n, target_tokens[n])


def greedy_accept_twin(logits: mx.array, proposals: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy verify: row argmax (lowest index wins ties), then match_accept."""
    return match_accept_twin(mx.argmax(logits, axis=-1).astype(mx.int32), proposals)


def _inverse_cdf(weights: mx.array, u: mx.array) -> mx.array:
    """Index i with cdf[i-1] <= u * total < cdf[i]; never a zero-weight index."""
    cdf = mx.cumsum(weights)
    i = (cdf <= u * cdf[-1]).astype(mx.int32).sum()
    last_nonzero = weights.shape[0] - 1 - mx.argmax((weights[::-1] > 0).astype(mx.int32))
    return mx.minimum(i, last_nonzero)


def rejection_accept_twin(
    p: mx.array, q: mx.array, proposals: mx.array, uniforms: mx.array
) -> tuple[mx.array, mx.array]:
    """Lossless rejection sampling (Leviathan et al. / Chen et al.).

    p: (B, V) target probabilities, q: (B-1, V) drafter probabilities the
    proposals were sampled from, uniforms: (B,) in [0, 1). Proposal i is accepted
    iff ``uniforms[i] * q[i, x] < p[i, x]``; the first rejected row n is replaced
    by a sample (inverse CDF with ``uniforms[B-1]``) from ``max(p[n] - q[n], 0)``
    normalised (or from p[n] if that is all zero); if all are accepted the bonus
    is sampled from p[B-1].
    """
    B = p.shape[0]
    rows = mx.arange(B - 1)
    px = p[rows, proposals]
    qx = q[rows, proposals]
    ok = (uniforms[: B - 1] * qx < px).astype(mx.int32)
    n = mx.cumprod(ok).sum() if B > 1 else mx.array(0, mx.int32)
    q_pad = mx.concatenate([q, mx.zeros((1, p.shape[1]), q.dtype)])
    residual = mx.maximum(p[n] - q_pad[n], 0)
    residual = mx.where(residual.sum() > 0, residual, p[n])
    return _commit(proposals, n, _inverse_cdf(residual, uniforms[B - 1]))


@dataclass(frozen=True)
class KernelOps:
    """The implementations the decode loop calls; ``path`` names them in stats."""

    path: str
    block_attention: Callable
    greedy_accept: Callable
    match_accept: Callable
    rejection_accept: Callable


TWINS = KernelOps(
    "mlx",
    block_attention_twin,
    greedy_accept_twin,
    match_accept_twin,
    rejection_accept_twin,
)


def get_ops(use_metal: bool | None = None) -> KernelOps:
    """Metal kernels when available (``None``: auto), else the pure-MLX twins."""
    if use_metal and not mx.metal.is_available():
        raise RuntimeError("Metal kernels were requested but Metal is not available")
    return TWINS
