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


def safetensors_problem(file: Path) -> str | None:
    """Why ``file`` is not a complete safetensors file (read from its header alone), or None."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if not 0 < n <= size - 8:
                return "its header is missing or cut off"
            header = json.loads(f.read(n))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        return f"its header is unreadable ({type(e).__name__})"
    needed = 8 + n + max(ends, default=0)
    return None if size >= needed else f"it is truncated ({size} of {needed} bytes)"


def check_weights(path: Path, what: str) -> None:
    """Refuse a checkpoint folder whose weight files are cut off, before anything reads them."""
    for f in sorted(path.glob("model*.safetensors")):
        if (problem := safetensors_problem(f)) is not None:
            raise DFlashError(f"{what} weights {f} are not usable: {problem}; fix: re-download or re-convert the {what}")


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
