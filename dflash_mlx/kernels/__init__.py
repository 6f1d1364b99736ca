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


def block_attention_twin(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, sliding_window: int | None, causal: bool = False
) -> mx.array:
    """Attention of the drafter's block queries over ``[context ; block]``.

    q: (B, n_heads, L, D), the block rows at positions S-L .. S-1.
    k, v: (B, n_kv_heads, S, D), the context rows (in position order, ending
    at position S-L-1) followed by the block. Block row i sees:
    - context key j iff ``sliding_window`` is None or ``(S-L+i) - j < sliding_window``
      (a true sliding window over positions: row 0 sees the last W-1 context
      rows, row i the last W-1-i);
    - block key S-L+j for every j, or only j <= i when ``causal``.
    With neither a window nor causality there is no mask: the block is
    bidirectional and sees all context.
    """
    if sliding_window is None and not causal:
        mask = None
    else:
        L, S = q.shape[2], k.shape[2]
        qpos = mx.arange(S - L, S)[:, None]
        kpos = mx.arange(S)[None]
        in_context = kpos < S - L
        sees_context = in_context if sliding_window is None else in_context & (qpos - kpos < sliding_window)
        sees_block = ~in_context if not causal else ~in_context & (kpos <= qpos)
        mask = sees_context | sees_block
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
    # fp32 so that a half-precision CDF over a large vocabulary does not stall.
    p_n = p[n].astype(mx.float32)
    residual = mx.maximum(p_n - q_pad[n].astype(mx.float32), 0)
    residual = mx.where(residual.sum() > 0, residual, p_n)
    return _commit(proposals, n, _inverse_cdf(residual, uniforms[B - 1]))



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
    "block_attention": (("q", "k", "v", "params", "scale"), ("out",)),
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


def _padded_proposals(proposals: mx.array) -> mx.array:
    # One spare entry keeps the buffer non-empty when B == 1.
    return mx.concatenate([proposals.astype(mx.int32), mx.zeros((1,), mx.int32)])


def plan_block_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    sliding_window: int | None,
    causal: bool = False,
    simdgroups: int = ATTENTION_SIMDGROUPS,
) -> Launch:
    """Launch of metal/block_attention.metal; same contract as ``block_attention_twin``."""
    dtype = _check_dtype(q, k, v)
    _, n_heads, L, D = q.shape
    _, n_kv_heads, S, _ = k.shape
    if q.shape[0] != 1 or k.shape != v.shape or k.shape[0] != 1 or k.shape[3] != D:
        raise KernelUnsupported(f"shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if D not in HEAD_DIMS:
        raise KernelUnsupported(f"head_dim {D}: the kernel supports {HEAD_DIMS}")
    if n_heads % n_kv_heads or L > S:
        raise KernelUnsupported(f"{n_heads} heads over {n_kv_heads} kv heads, L={L}, S={S}")
    if sliding_window is not None and sliding_window < 1:
        raise KernelUnsupported(f"sliding_window {sliding_window}")
    params = mx.array([L, S, n_heads // n_kv_heads, sliding_window or 0, int(causal)], mx.int32)
    return Launch(
        "block_attention",
        (q, k, v, params, mx.array([scale], mx.float32)),
        (("T", dtype), ("D", D), ("NSG", simdgroups)),
        (32 * simdgroups * L, n_heads, 1),
        (32 * simdgroups, 1, 1),
        (q.shape,),
        (dtype,),
    )


def plan_greedy_accept(
    logits: mx.array, proposals: mx.array, *, threads: int = ACCEPT_THREADS
) -> Launch:
    """Launch of metal/greedy_accept.metal; same contract as ``greedy_accept_twin``."""
    dtype = _check_dtype(logits)
    B, V = logits.shape
    return Launch(
        "greedy_accept",
        (logits, _padded_proposals(proposals), mx.array([B, V], mx.int32)),
        (("T", dtype), ("NT", threads)),
        (threads, 1, 1),
        (threads, 1, 1),
        ((B,), ()),
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
    """Launch of metal/rejection_accept.metal; same contract as ``rejection_accept_twin``."""
    B, V = p.shape
    # With B == 1 the kernel never reads q, but Metal needs a non-empty buffer.
    q = q.astype(p.dtype) if B > 1 else p[:1]
    dtype = _check_dtype(p, q)
    inputs = (p, q, _padded_proposals(proposals), uniforms.astype(mx.float32))
    return Launch(
        "rejection_accept",
        inputs + (mx.array([B, V], mx.int32),),
        (("T", dtype), ("NT", threads)),
        (threads, 1, 1),
        (threads, 1, 1),
        ((B,), ()),
        (mx.int32, mx.int32),
    )


@dataclass(frozen=True)
class KernelOps:
    """The implementations the decode loop calls; ``path`` names them in stats."""

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

    def block_attention(q, k, v, *, scale, sliding_window, causal=False):
        try:
            launch = plan_block_attention(
                q, k, v, scale=scale, sliding_window=sliding_window, causal=causal,
                simdgroups=attention_simdgroups,
            )
        except KernelUnsupported as e:
            fallbacks.add(f"block attention: {e}")
            return block_attention_twin(q, k, v, scale=scale, sliding_window=sliding_window, causal=causal)
        return run(launch)[0]

    def greedy_accept(logits, proposals):
        try:
            launch = plan_greedy_accept(logits, proposals, threads=accept_threads)
        except KernelUnsupported as e:
            fallbacks.add(f"greedy accept: {e}")
            return greedy_accept_twin(logits, proposals)
        tokens, n = run(launch)
        return tokens, n

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
