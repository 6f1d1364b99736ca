"""Load OpenBLAS ahead of MLX on Linux.

The mlx[cpu] wheel links a reference BLAS that makes fp32 matmuls 15-30x slower
than they should be. Loading Debian's OpenBLAS with RTLD_GLOBAL before
``mlx.core`` is imported makes MLX's BLAS calls resolve to it.

OpenBLAS picks its kernels by CPU model, and a release older than the CPU falls
back to its generic SSE3 kernels ("Prescott"): Debian 12's OpenBLAS on a Xeon of
model 207 did, and a verify forward of 8 rows cost 1.8x a 1-row one instead of 1.5x
(benchmarks/results/openblas_kernels_2026-12-08.json). Its kernels are therefore
chosen by the vector units the CPU has (``OPENBLAS_CORETYPE``), unless the user
chose them.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
# OpenBLAS kernel sets by the x86 flags they need, best first.
KERNELS_BY_FLAGS = (
    ("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    ("Haswell", {"avx2", "fma"}),
)


def kernels_for(flags: set[str]) -> str | None:
    """The OpenBLAS kernels (an ``OPENBLAS_CORETYPE``) an x86 CPU with ``flags`` runs best, or None."""
    return next((name for name, needs in KERNELS_BY_FLAGS if needs <= flags), None)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^flags\s*:(.*)$", f.read(), re.MULTILINE)
    except OSError:
        return set()
    return set(match.group(1).split()) if match else set()


def _preload() -> str:
    if sys.platform == "darwin":
        return "Accelerate"
    if os.environ.get("DFLASH_MLX_NO_OPENBLAS"):
        return "reference (DFLASH_MLX_NO_OPENBLAS set)"
    if "mlx.core" in sys.modules:
        return "unknown (mlx.core was imported before dflash_mlx)"
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            chosen = "OPENBLAS_CORETYPE" in os.environ
            kernels = None if chosen or platform.machine() != "x86_64" else kernels_for(_cpu_flags())
            if kernels:  # read once, as the library loads; child processes choose for themselves
                os.environ["OPENBLAS_CORETYPE"] = kernels
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            finally:
                if kernels:
                    del os.environ["OPENBLAS_CORETYPE"]
            return f"OpenBLAS ({path}; {_corename(lib)} kernels{', as OPENBLAS_CORETYPE chose' if chosen else ''})"
    return "reference (install libopenblas0-pthread for 15-30x faster fp32)"


def _corename(lib: ctypes.CDLL) -> str:
    try:
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode()
    except AttributeError:
        return "unnamed"


BLAS = _preload()
