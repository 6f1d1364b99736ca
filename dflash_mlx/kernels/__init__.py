"""The two hot spots of the draft-verify loop: block attention and verify/accept.

Each op has a pure-MLX *twin* that runs on every backend and defines the
semantics. Metal kernels with the same contract (sources in ``metal/``) are
used instead when Metal is available; ``KernelOps.path`` names the one in use
and ``KernelOps.fallbacks`` records any op that had to fall back to its twin.
"""

from __future__ import annotations

import functools
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx

from ..errors import DFlashError


# -- block attention ---------------------------------------------------------


def block_visibility(
    L: int, S: int, *, sliding_window: int | None, causal: bool, lengths: mx.array | None = None
) -> mx.array:
    """Which keys each block row sees: (L, S), or (R, 1, L, S) per row with ``lengths``.

    Row r's keys are its first ``lengths[r]`` (all S without ``lengths``), clamped to
    [L, S]; its block is the last L of them and its context everything before.
    Block row i, at position ``end - L + i`` (``end`` = the row's length), sees:
    - context key j iff ``sliding_window`` is None or ``(end - L + i) - j < sliding_window``
      (a true sliding window over positions: row 0 sees the last W-1 context
      rows, row i the last W-1-i);
    - block key end-L+j for every j, or only j <= i when ``causal``;
    - nothing past ``end``.
    """
    end = S if lengths is None else mx.clip(lengths.astype(mx.int32), L, S)[:, None, None]
    kpos = mx.arange(S)
    qpos = end - L + mx.arange(L)[:, None]
    in_context = kpos < end - L
    sees_context = in_context if sliding_window is None else in_context & (qpos - kpos < sliding_window)
    in_block = ~in_context & (kpos < end)
    sees_block = in_block & (kpos <= qpos) if causal else in_block
    visible = sees_context | sees_block
    return visible if lengths is None else visible[:, None]


def block_attention_twin(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    sliding_window: int | None,
    causal: bool = False,
    lengths: mx.array | None = None,
) -> mx.array:
    """Attention of the drafter's block queries over ``[context ; block]``, per row.

    q: (R, n_heads, L, D), each row's block queries.
    k, v: (R, n_kv_heads, S, D): row r holds its context rows (in position order)
    followed by its block in its first ``lengths[r]`` keys (int32 (R,), each in
    [L, S]; None: every row fills all S). Keys past a row's length are padding:
    any finite values there are invisible. ``block_visibility`` gives the rule.
    With neither a window, causality nor lengths there is no mask: the block is
    bidirectional and sees all context.
    """
    L, S = q.shape[2], k.shape[2]
    if sliding_window is None and not causal and lengths is None:
        mask = None
    else:
        mask = block_visibility(L, S, sliding_window=sliding_window, causal=causal, lengths=lengths)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


# -- verify / accept ----------------------------------------------------------
#
# All accept ops take, per row (one request each), the B verify rows of the
# target and the B-1 proposals, and return (tokens (R, B), num_accepted (R,)):
# tokens[r, :n] are row r's accepted proposals, tokens[r, n] its bonus (or
# residual) token, tokens[r, n+1:] are zero. One host sync reads all rows.
# A single row may also come without the row axis (proposals (B-1,)); its
# results then have none either: tokens (B,), num_accepted ().


def _one_row_too(proposals_at: int) -> Callable[[Callable], Callable]:
    """Lets an accept op over rows take a single row without the row axis;
    ``proposals_at`` is the position of its proposals argument."""

    def wrap(over_rows: Callable) -> Callable:
        @functools.wraps(over_rows)
        def accept(*arrays: mx.array) -> tuple[mx.array, mx.array]:
            if arrays[proposals_at].ndim != 1:
                return over_rows(*arrays)
            tokens, n = over_rows(*(a[None] for a in arrays))
            return tokens[0], n[0]

        return accept

    return wrap


def _padded(proposals: mx.array) -> mx.array:
    """Proposals (R, B-1) as int32 (R, B): a zero where each row's bonus goes, which
    also keeps a kernel's buffer non-empty when B == 1."""
    return mx.concatenate([proposals.astype(mx.int32), mx.zeros((proposals.shape[0], 1), mx.int32)], axis=1)


def _commit(proposals: mx.array, n: mx.array, last: mx.array) -> tuple[mx.array, mx.array]:
    idx = mx.arange(proposals.shape[1] + 1)
    n_col = n[:, None]
    tokens = mx.where(idx < n_col, _padded(proposals), mx.where(idx == n_col, last[:, None].astype(mx.int32), 0))
    return tokens, n.astype(mx.int32)


def _accepted_prefix(ok: mx.array) -> mx.array:
    """Per row, the number of leading true entries of ``ok`` (R, B-1)."""
    return mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)


@_one_row_too(proposals_at=1)
def match_accept_twin(target_tokens: mx.array, proposals: mx.array) -> tuple[mx.array, mx.array]:
    """Accept the longest prefix of proposals (R, B-1) equal to the target's own tokens (R, B).

    Exact for any sampler of the target: each target token is drawn from the
    row conditioned on the proposals before it, which are the committed tokens.
    """
    n = _accepted_prefix(proposals == target_tokens[:, :-1])
    return _commit(proposals, n, mx.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0])


@_one_row_too(proposals_at=1)
def greedy_accept_twin(logits: mx.array, proposals: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy verify of logits (R, B, V): row argmax (lowest index wins ties), then match_accept."""
    return match_accept_twin(mx.argmax(logits, axis=-1).astype(mx.int32), proposals)


def _inverse_cdf(weights: mx.array, u: mx.array) -> mx.array:
    """Per row of weights (R, V), the index i with cdf[i-1] <= u * total < cdf[i]; never a zero-weight index."""
    cdf = mx.cumsum(weights, axis=1)
    i = (cdf <= u[:, None] * cdf[:, -1:]).astype(mx.int32).sum(axis=1)
    last_nonzero = weights.shape[1] - 1 - mx.argmax((weights[:, ::-1] > 0).astype(mx.int32), axis=1)
    return mx.minimum(i, last_nonzero)


@_one_row_too(proposals_at=2)
def rejection_accept_twin(
    p: mx.array, q: mx.array, proposals: mx.array, uniforms: mx.array
) -> tuple[mx.array, mx.array]:
    """Lossless rejection sampling (Leviathan et al. / Chen et al.), per row.

    p: (R, B, V) target probabilities, q: (R, B-1, V) drafter probabilities the
    proposals (R, B-1) were sampled from, uniforms: (R, B) in [0, 1). In row r,
    proposal i is accepted iff ``uniforms[r, i] * q[r, i, x] < p[r, i, x]``; the
    first rejected position n is replaced by a sample (inverse CDF with
    ``uniforms[r, B-1]``) from ``max(p[r, n] - q[r, n], 0)`` normalised (or from
    p[r, n] if that is all zero); if all are accepted the bonus is sampled from
    p[r, B-1].
    """
    R, B, V = p.shape
    at = proposals[..., None]
    px = mx.take_along_axis(p[:, : B - 1], at, axis=2)[..., 0]
    qx = mx.take_along_axis(q, at, axis=2)[..., 0]
    n = _accepted_prefix(uniforms[:, : B - 1] * qx < px)
    q_pad = mx.concatenate([q, mx.zeros((R, 1, V), q.dtype)], axis=1)
    row = n[:, None, None]
    # fp32 so that a half-precision CDF over a large vocabulary does not stall.
    p_n = mx.take_along_axis(p, row, axis=1)[:, 0].astype(mx.float32)
    residual = mx.maximum(p_n - mx.take_along_axis(q_pad, row, axis=1)[:, 0].astype(mx.float32), 0)
    residual = mx.where(residual.sum(axis=1, keepdims=True) > 0, residual, p_n)
    return _commit(proposals, n, _inverse_cdf(residual, uniforms[:, B - 1]))


# -- Metal kernels ------------------------------------------------------------
#
# Each op is planned into a ``Launch`` (the arguments of one metal_kernel call)
# and handed to a runner: real Metal here, a CPU emulation in the tests. Sharing
# the plan is what lets Linux CI vouch for the dispatches a Mac will make.

ATTENTION_SIMDGROUPS = 4
ACCEPT_THREADS = 512
HEAD_DIMS = (64, 128)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

# kernel name -> (input names, output names); sources are metal/<name>.metal.
SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "block_attention": (("q", "k", "v", "lengths", "params", "scale"), ("out",)),
    "greedy_accept": (("logits", "proposals", "params"), ("tokens", "num_accepted")),
    "rejection_accept": (
        ("p", "q", "proposals", "uniforms", "params"),
        ("tokens", "num_accepted"),
    ),
}
HEADER = "dflash.h"


class KernelUnsupported(ValueError):
    """Inputs a Metal kernel does not handle; the op falls back to its twin."""


@dataclass(frozen=True)
class Launch:
    """One dispatch: the arguments of an ``mx.fast.metal_kernel`` call."""

    kernel: str
    inputs: tuple[mx.array, ...]
    template: tuple[tuple[str, object], ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[mx.Dtype, ...]


Runner = Callable[[Launch], Sequence[mx.array]]


def metal_source(filename: str) -> str:
    """Text of a file in ``metal/``: the checkout's own folder beside the package
    when there is one, else the installed ``dflash_mlx.kernels.metal`` package."""
    # The checkout first: an editable install maps dflash_mlx.kernels.metal to the
    # checkout it was installed from, which need not be the one being imported
    # (a git worktree run with PYTHONPATH), and tests must compile the .metal
    # files beside the code that plans their launches.
    checkout = Path(__file__).resolve().parents[2] / "metal" / filename
    if checkout.is_file():
        return checkout.read_text()
    return importlib.resources.files("dflash_mlx.kernels.metal").joinpath(filename).read_text()


def build_kernel(name: str, source: str | None = None, header: str | None = None) -> Callable:
    """The metal_kernel for ``name``; tests pass altered source/header to it."""
    input_names, output_names = SIGNATURES[name]
    return mx.fast.metal_kernel(
        name=f"dflash_{name}",
        input_names=list(input_names),
        output_names=list(output_names),
        source=metal_source(f"{name}.metal") if source is None else source,
        header=metal_source(HEADER) if header is None else header,
    )


_kernel = functools.cache(build_kernel)


def run_metal(
    launch: Launch, verbose: bool = False, kernel: Callable | None = None
) -> list[mx.array]:
    """Dispatch ``launch`` with ``kernel`` (default: built once from metal/).

    ``verbose`` prints the generated source, which also works while tracing.
    """
    kernel = kernel or _kernel(launch.kernel)
    return kernel(
        inputs=list(launch.inputs),
        template=list(launch.template),
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=list(launch.output_shapes),
        output_dtypes=list(launch.output_dtypes),
        verbose=verbose,
    )


def _check_dtype(*arrays: mx.array) -> mx.Dtype:
    dtype = arrays[0].dtype
    if dtype not in DTYPES or any(a.dtype != dtype for a in arrays):
        raise KernelUnsupported(f"dtypes {[a.dtype for a in arrays]}: need one of {DTYPES}")
    return dtype


def _check_rows(lead: mx.array, proposals: mx.array) -> tuple[int, int, int]:
    """(R, B, V) of an accept op's (R, B, V) input and its (R, B-1) proposals."""
    if lead.ndim != 3 or proposals.shape != (lead.shape[0], lead.shape[1] - 1):
        raise KernelUnsupported(f"shapes {lead.shape} with proposals {proposals.shape}")
    return lead.shape


def plan_block_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    sliding_window: int | None,
    causal: bool = False,
    lengths: mx.array | None = None,
    simdgroups: int = ATTENTION_SIMDGROUPS,
) -> Launch:
    """Launch of metal/block_attention.metal; same contract as ``block_attention_twin``."""
    dtype = _check_dtype(q, k, v)
    R, n_heads, L, D = q.shape
    _, n_kv_heads, S, _ = k.shape
    if k.shape != v.shape or k.shape[0] != R or k.shape[3] != D:
        raise KernelUnsupported(f"shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if lengths is not None and lengths.shape != (R,):
        raise KernelUnsupported(f"lengths of shape {lengths.shape} for {R} rows")
    if D not in HEAD_DIMS:
        raise KernelUnsupported(f"head_dim {D}: the kernel supports {HEAD_DIMS}")
    if n_heads % n_kv_heads or L > S:
        raise KernelUnsupported(f"{n_heads} heads over {n_kv_heads} kv heads, L={L}, S={S}")
    if sliding_window is not None and sliding_window < 1:
        raise KernelUnsupported(f"sliding_window {sliding_window}")
    lengths = mx.full((R,), S, mx.int32) if lengths is None else lengths.astype(mx.int32)
    params = mx.array([L, S, n_heads, n_heads // n_kv_heads, sliding_window or 0, int(causal)], mx.int32)
    return Launch(
        "block_attention",
        (q, k, v, lengths, params, mx.array([scale], mx.float32)),
        (("T", dtype), ("D", D), ("NSG", simdgroups)),
        (32 * simdgroups * L, n_heads, R),
        (32 * simdgroups, 1, 1),
        (q.shape,),
        (dtype,),
    )


def plan_greedy_accept(
    logits: mx.array, proposals: mx.array, *, threads: int = ACCEPT_THREADS
) -> Launch:
    """Launch of metal/greedy_accept.metal over rows (logits (R, B, V)); same contract
    as ``greedy_accept_twin``."""
    dtype = _check_dtype(logits)
    R, B, V = _check_rows(logits, proposals)
    return Launch(
        "greedy_accept",
        (logits, _padded(proposals), mx.array([B, V], mx.int32)),
        (("T", dtype), ("NT", threads)),
        (threads, R, 1),
        (threads, 1, 1),
        ((R, B), (R,)),
        (mx.int32, mx.int32),
    )


def plan_rejection_accept(
    p: mx.array,
    q: mx.array,
    proposals: mx.array,
    uniforms: mx.array,
    *,
    threads: int = ACCEPT_THREADS,
) -> Launch:
    """Launch of metal/rejection_accept.metal over rows (p (R, B, V)); same contract
    as ``rejection_accept_twin``."""
    R, B, V = _check_rows(p, proposals)
    if q.shape != (R, B - 1, V) or uniforms.shape != (R, B):
        raise KernelUnsupported(f"shapes p {p.shape}, q {q.shape}, uniforms {uniforms.shape}")
    # With B == 1 the kernel never reads q, but Metal needs a non-empty buffer.
    q = q.astype(p.dtype) if B > 1 else p
    dtype = _check_dtype(p, q)
    inputs = (p, q, _padded(proposals), uniforms.astype(mx.float32))
    return Launch(
        "rejection_accept",
        inputs + (mx.array([B, V], mx.int32),),
        (("T", dtype), ("NT", threads)),
        (threads, R, 1),
        (threads, 1, 1),
        ((R, B), (R,)),
        (mx.int32, mx.int32),
    )


@dataclass(frozen=True)
class KernelOps:
    """The implementations the decode loop calls; ``path`` names them in stats.

    Every op works on rows (one request each):
    - ``block_attention(q (R, H, L, D), k, v (R, H_kv, S, D), *, scale, sliding_window,
      causal=False, lengths=None | int32 (R,)) -> (R, H, L, D)``
    - ``greedy_accept(logits (R, B, V), proposals (R, B-1))``
    - ``match_accept(target_tokens (R, B), proposals (R, B-1))``
    - ``rejection_accept(p (R, B, V), q (R, B-1, V), proposals (R, B-1), uniforms (R, B))``
    The accept ops return ``(tokens (R, B) int32, num_accepted (R,) int32)``, or for
    one row passed without the row axis ``(tokens (B,), num_accepted ())``.
    """

    path: str
    block_attention: Callable
    greedy_accept: Callable
    match_accept: Callable
    rejection_accept: Callable
    fallbacks: set[str] = field(default_factory=set)  # "op: reason" for inputs a kernel refused


TWINS = KernelOps(
    "mlx",
    block_attention_twin,
    greedy_accept_twin,
    match_accept_twin,
    rejection_accept_twin,
)


def make_ops(
    path: str,
    run: Runner,
    *,
    attention_simdgroups: int = ATTENTION_SIMDGROUPS,
    accept_threads: int = ACCEPT_THREADS,
) -> KernelOps:
    """KernelOps whose kernels go through ``run``. match_accept stays the twin:
    it is a few scalar ops on B - 1 tokens, nothing for a kernel to fuse."""
    fallbacks: set[str] = set()

    def block_attention(q, k, v, *, scale, sliding_window, causal=False, lengths=None):
        keywords = {"scale": scale, "sliding_window": sliding_window, "causal": causal, "lengths": lengths}
        try:
            launch = plan_block_attention(q, k, v, **keywords, simdgroups=attention_simdgroups)
        except KernelUnsupported as e:
            fallbacks.add(f"block attention: {e}")
            return block_attention_twin(q, k, v, **keywords)
        return run(launch)[0]

    @_one_row_too(proposals_at=1)
    def greedy_accept(logits, proposals):
        try:
            launch = plan_greedy_accept(logits, proposals, threads=accept_threads)
        except KernelUnsupported as e:
            fallbacks.add(f"greedy accept: {e}")
            return greedy_accept_twin(logits, proposals)
        tokens, n = run(launch)
        return tokens, n

    @_one_row_too(proposals_at=2)
    def rejection_accept(p, q, proposals, uniforms):
        try:
            launch = plan_rejection_accept(p, q, proposals, uniforms, threads=accept_threads)
        except KernelUnsupported as e:
            fallbacks.add(f"rejection accept: {e}")
            return rejection_accept_twin(p, q, proposals, uniforms)
        tokens, n = run(launch)
        return tokens, n

    return KernelOps(path, block_attention, greedy_accept, match_accept_twin, rejection_accept, fallbacks)


@functools.cache
def _metal_ops() -> KernelOps:
    return make_ops("metal", run_metal)


def get_ops(use_metal: bool | None = None) -> KernelOps:
    """Metal kernels when available (``None``: auto), else the pure-MLX twins."""
    available = mx.metal.is_available()
    if use_metal and not available:
        raise DFlashError("Metal kernels were requested but Metal is not available: drop use_metal")
    if use_metal is False or not available:
        return TWINS
    return _metal_ops()
