"""dflash-mlx: lossless DFlash block-diffusion speculative decoding on MLX.

The public names load MLX and the generation stack on first use, so that
``import dflash_mlx`` and ``dflash-mlx --help`` stay fast. OpenBLAS is loaded
here, before any submodule imports ``mlx.core``.
"""

from importlib import import_module

from ._blas import BLAS  # noqa: F401  (must run before mlx.core is imported)
from .errors import DFlashError

# public name -> the module that defines it
_EXPORTS = {
    "DFlashModel": "model",
    "load": "model",
    "Engine": "engine",
    "PromptCache": "cache.prompt",
    "GenerationResponse": "generation",
    "generate": "generation",
    "stream_generate": "generation",
    "BatchResponse": "generation",
    "batch_generate": "generation",
}

__all__ = ["DFlashError", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_mlx' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
