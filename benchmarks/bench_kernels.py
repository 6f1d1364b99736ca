"""Time the Metal kernels against their pure-MLX twins (Apple Silicon only).

    python benchmarks/bench_kernels.py
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import mlx.core as mx

from dflash_mlx import kernels


def _time(fn: Callable[[], object], warmup: int = 5, iters: int = 50) -> float:
    """Median microseconds per call, synchronising on the outputs each call."""
    for _ in range(warmup):
        mx.eval(fn())
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2] * 1e6


def main() -> int:
    if not mx.metal.is_available():
        print("bench_kernels: Metal is not available; the kernels only run on Apple Silicon. Skipping.")
        return 0
    metal = kernels.get_ops(True)
    twin = kernels.TWINS
    cases: list[tuple[str, Callable[[kernels.KernelOps], Callable[[], object]]]] = []

    for dtype in (mx.float16, mx.bfloat16):
        # One row filling its keys, then 4 rows of different lengths (the batch engine).
        for R, S, window in ((1, 512, None), (1, 4096, None), (1, 4096, 1024), (4, 4096, None), (4, 4096, 1024)):
            q = mx.random.normal((R, 32, 16, 128)).astype(dtype)
            k = mx.random.normal((R, 8, S, 128)).astype(dtype)
            v = mx.random.normal((R, 8, S, 128)).astype(dtype)
            lengths = None if R == 1 else mx.array([S - 1000 * r for r in range(R)], mx.int32)
            cases.append((
                f"block_attention {dtype} R={R} S={S} window={window}",
                lambda ops, q=q, k=k, v=v, w=window, n=lengths: lambda: ops.block_attention(
                    q, k, v, scale=128**-0.5, sliding_window=w, lengths=n),
            ))

    B, V = 16, 151_936
    for R in (1, 8):
        logits = mx.random.normal((R, B, V)).astype(mx.bfloat16)
        target = mx.argmax(logits, axis=-1).astype(mx.int32)
        for accepted in (0, B - 1):
            proposals = mx.where(mx.arange(B - 1) == accepted, target[:, :-1] + 1, target[:, :-1]) % V
            cases.append((
                f"greedy_accept R={R} B={B} V={V} accepted={accepted}",
                lambda ops, x=logits, y=proposals: lambda: ops.greedy_accept(x, y),
            ))
        p = mx.softmax(mx.random.normal((R, B, V)), axis=-1)
        q = mx.softmax(mx.random.normal((R, B - 1, V)), axis=-1)
        uniforms = mx.random.uniform(shape=(R, B))
        cases.append((
            f"rejection_accept R={R} B={B} V={V}",
            lambda ops, p=p, q=q, x=target[:, :-1], u=uniforms: lambda: ops.rejection_accept(p, q, x, u),
        ))

    print(f"{'case':60s} {'twin us':>10s} {'metal us':>10s} {'speedup':>8s}")
    for name, make in cases:
        t_twin, t_metal = _time(make(twin)), _time(make(metal))
        print(f"{name:60s} {t_twin:10.1f} {t_metal:10.1f} {t_twin / t_metal:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
