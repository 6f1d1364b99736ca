"""Drafter checkpoints: which architecture a config.json names, loading and saving.

The architectures live one per file, as in mlx_lm: ``dflash.py`` (the original
DFlash drafter) and ``dflash2.py`` (DFlash2). Released checkpoints use PyTorch
names, which are the modules' names here, so they load without renaming (bar
DFlash2's two codebooks, stored without ``.weight``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoint import load_weights, read_config, resolve
from ..copying import load_corpus, save_corpus
from .dflash import DEFAULT_DRAFT_WINDOW, Attention, Drafter, DrafterArgs, config_error, default_target_layer_ids
from .dflash2 import DFlash2Args, DFlash2Drafter
from ..errors import DFlashError

__all__ = [
    "DEFAULT_DRAFT_WINDOW", "Attention", "Drafter", "DrafterArgs", "default_target_layer_ids", "is_drafter_config",
    "drafter_classes", "load_drafter", "drafter_config", "save_drafter",
]

ARCHITECTURES: dict[str, tuple[type[DrafterArgs], type[Drafter]]] = {
    Drafter.architecture: (DrafterArgs, Drafter),
    DFlash2Drafter.architecture: (DFlash2Args, DFlash2Drafter),
}
_BARE_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def is_drafter_config(config: dict[str, Any]) -> bool:
    return "dflash_config" in config or ("block_size" in config and "num_target_layers" in config)


def drafter_classes(config: dict[str, Any]) -> tuple[type[DrafterArgs], type[Drafter]]:
    """The (args, model) classes of the architecture config.json names (DFlash if none)."""
    names = config.get("architectures") or [Drafter.architecture]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise config_error("architectures", f"is {names!r}, not a list of names")
    known = [n for n in names if n in ARCHITECTURES]
    if len(known) != 1:
        raise config_error("architectures", f"is {names}, not one drafter architecture this version knows",
                           f"use one of {', '.join(ARCHITECTURES)} (or upgrade dflash-mlx)")
    return ARCHITECTURES[known[0]]


def load_drafter(path_or_repo: str, dtype: mx.Dtype | None = None) -> Drafter:
    """Load a DFlash or DFlash2 drafter (released layout or our MLX conversion, quantized or not)."""
    path = resolve(str(path_or_repo), "drafter")
    config = read_config(path, "drafter")
    if not is_drafter_config(config):
        raise DFlashError(
            f"{path} is not a DFlash drafter (config.json has no dflash_config): "
            "pass the drafter with --draft and the target with --model"
        )
    args_class, model_class = drafter_classes(config)
    args = args_class.from_config(config)
    model = model_class(args)
    weights = load_weights(path)
    for name in _BARE_CODEBOOKS:
        if name in weights:
            weights[f"{name}.weight"] = weights.pop(name)
    if (q := config.get("quantization")) is not None:
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
            # Mixed recipes store per-layer settings under the layer's path, as mlx_lm does.
            class_predicate=lambda p, m: f"{p}.scales" in weights and (q.get(p) if isinstance(q.get(p), dict) else True),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DFlashError(
            f"drafter weights in {path} do not match its config.json ({e}): "
            "the checkpoint is incomplete or the config belongs to another model"
        ) from None
    rows = model.vocab_rows
    if rows is not None and not (rows.size and 0 <= rows.min().item() and rows.max().item() < args.vocab_size):
        raise DFlashError(f"drafter draft_vocab in {path} holds ids outside its vocab_size {args.vocab_size}: the checkpoint is corrupt")
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.corpus = load_corpus(path)
    return model


# Written inside dflash_config, where the official loader reads them.
_DFLASH_KEYS = ("target_layer_ids", "mask_token_id", "input_embedding_scale", "output_multiplier",
                "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "draft_window")


def drafter_config(drafter: Drafter) -> dict:
    """config.json of a drafter in the released (original) layout, plus our draft vocabulary."""
    a = drafter.args
    values = {k: v for k, v in vars(a).items() if v is not None}
    config = {"architectures": [drafter.architecture], "model_type": "qwen3"}
    config.update({k: v for k, v in values.items() if k not in _DFLASH_KEYS})
    config["torch_dtype"] = "float32"
    config["dflash_config"] = {k: values[k] for k in _DFLASH_KEYS if k in values}
    return config


def save_drafter(drafter: Drafter, out: Path, dtype: mx.Dtype = mx.float32) -> None:
    """config.json + model.safetensors (+ its corpus), loadable by ``load_drafter`` and the converter."""
    out.mkdir(parents=True, exist_ok=True)
    config = drafter_config(drafter)
    config["torch_dtype"] = str(dtype).split(".")[-1]
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if drafter.corpus is not None:
        save_corpus(out, drafter.corpus.tokens)
