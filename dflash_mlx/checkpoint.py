"""Finding and reading checkpoints: local folders or Hub ids, config, safetensors."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from .errors import DFlashError


# What a model or drafter needs from a Hub repo: config, weights, tokenizer and chat template.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


def resolve(path_or_repo: str, what: str) -> Path:
    """A local path as given (never touching the network), else a Hub snapshot."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    looks_like_repo = path_or_repo.count("/") == 1 and not path_or_repo.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise DFlashError(
            f"{what} not found: {path_or_repo} does not exist; fix: give a local folder or a Hub repo id"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path_or_repo, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # the hub raises many types; all mean "could not fetch"
        raise DFlashError(
            f"{what} {path_or_repo!r} is not a local folder and could not be fetched from the Hub "
            f"({type(e).__name__}); fix: check the name or download it first"
        ) from None


def read_config(path: Path, what: str = "model") -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DFlashError(f"{what} folder {path} has no config.json; fix: point at a checkpoint folder")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{config_file} is not valid JSON ({e.msg}); fix: re-download or repair it") from None
    if not isinstance(config, dict):
        raise DFlashError(f"{config_file} is not a JSON object; fix: re-download or repair it")
    return config


def load_weights(path: Path, what: str = "drafter") -> dict[str, mx.array]:
    # model*.safetensors, as mlx_lm reads: other safetensors in the folder are not weights.
    files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise DFlashError(f"{what} folder {path} has no *.safetensors weights (model*.safetensors); fix: download the weights next to config.json")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as e:
            raise DFlashError(
                f"{f} is not a readable safetensors file ({e}); fix: re-download or re-convert it"
            ) from None
    return weights
