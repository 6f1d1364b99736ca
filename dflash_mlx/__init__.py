"""dflash-mlx: lossless DFlash block-diffusion speculative decoding on MLX."""

from ._blas import BLAS  # noqa: F401  (must run before mlx.core is imported)
from .errors import DFlashError
from .generate import DFlashModel, GenerationResponse, generate, load, stream_generate

__all__ = ["DFlashError", "DFlashModel", "GenerationResponse", "generate", "load", "stream_generate"]
