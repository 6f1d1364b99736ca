"""Load OpenBLAS ahead of MLX on Linux.

The mlx[cpu] wheel links a reference BLAS that makes fp32 matmuls 15-30x slower
than they should be. Loading Debian's OpenBLAS with RTLD_GLOBAL before
``mlx.core`` is imported makes MLX's BLAS calls resolve to it.
"""

from __future__ import annotations

import ctypes
import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


def _preload() -> str:
    if sys.platform == "darwin":
        return "Accelerate"
    if os.environ.get("DFLASH_MLX_NO_OPENBLAS"):
        return "reference (DFLASH_MLX_NO_OPENBLAS set)"
    if "mlx.core" in sys.modules:
        return "unknown (mlx.core was imported before dflash_mlx)"
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return f"OpenBLAS ({path})"
    return "reference (install libopenblas0-pthread for 15-30x faster fp32)"


BLAS = _preload()
