"""Conversion recipes: which layers `dflash-mlx convert` quantizes, and how (see convert/README.md).

A recipe is JSON data (shipped ones live in convert/, as the `dflash_mlx.convert.recipes` package); it
becomes the `quant_predicate` mlx_lm's quantization takes.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from ..errors import DFlashError

Q_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
_RULE_KEYS = {"pattern", "layers", "keep", "bits", "group_size", "mode"}

QuantPredicate = Callable[[str, object], Union[bool, dict]]


@dataclass(frozen=True)
class Options:
    quantize: bool
    bits: int
    group_size: int
    mode: str
    dtype: Optional[str]
    recipe: Optional[str]


def load_recipe(name_or_path: str) -> dict:
    """A recipe by shipped name (`mixed_4_8`) or JSON path, validated. See convert/README.md."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise DFlashError(f"recipe file {path} does not exist; fix: pass a shipped recipe name or a JSON file")
        text, where = path.read_text(), str(path)
    else:
        shipped = importlib.resources.files("dflash_mlx.convert.recipes").joinpath(f"{name_or_path}.json")
        if not shipped.is_file():
            raise DFlashError(
                f"unknown recipe {name_or_path!r}; fix: use one of {', '.join(shipped_recipes())} "
                "or a path to a recipe JSON file"
            )
        text, where = shipped.read_text(), f"{name_or_path}.json"
    try:
        recipe = json.loads(text)
    except json.JSONDecodeError as e:
        raise DFlashError(f"recipe {where} is not valid JSON ({e}); fix: correct the file") from None
    _validate_recipe(recipe, where)
    recipe.setdefault("name", path.stem if path.suffix == ".json" else name_or_path)
    return recipe


def shipped_recipes() -> list[str]:
    """Names of the recipes that ship with the package."""
    files = importlib.resources.files("dflash_mlx.convert.recipes").iterdir()
    return sorted(f.name[: -len(".json")] for f in files if f.name.endswith(".json"))


def _validate_recipe(recipe: object, where: str) -> None:
    def bad(problem: str) -> DFlashError:
        return DFlashError(f"recipe {where}: {problem}; fix: see convert/README.md for the format")

    if not isinstance(recipe, dict) or not isinstance(recipe.get("rules", []), list):
        raise bad("expected an object with a list of rules")
    if recipe.get("family", "any") not in ("target", "drafter", "any"):
        raise bad(f"family must be target, drafter or any, not {recipe.get('family')!r}")
    for i, rule in enumerate(recipe.get("rules", [])):
        if not isinstance(rule, dict) or not isinstance(rule.get("pattern"), str):
            raise bad(f"rule {i} needs a string pattern")
        if unknown := set(rule) - _RULE_KEYS:
            raise bad(f"rule {i} has unknown keys {sorted(unknown)}")
        try:
            re.compile(rule["pattern"])
        except re.error as e:
            raise bad(f"rule {i} pattern does not compile ({e})") from None
        if rule.get("mode", "affine") not in Q_MODES:
            raise bad(f"rule {i} mode must be one of {', '.join(Q_MODES)}")


def _layer_index(path: str) -> Optional[int]:
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", path)
    return int(match.group(1)) if match else None


def make_quant_predicate(recipe: dict, num_layers: int, opts: Options) -> QuantPredicate:
    """The mlx_lm `quant_predicate` a recipe describes: False keeps a layer in float, True
    quantizes it with the command line's settings, a dict with its own (mlx_lm then records
    those per layer in config.json)."""
    rules = [(re.compile(r["pattern"]), r) for r in recipe.get("rules", [])]

    def in_window(rule: dict, path: str) -> bool:
        window, index = rule.get("layers"), _layer_index(path + ".")
        if window is None or index is None:
            return True
        first = int(window.get("first", 0) * num_layers)
        last = int(window.get("last", 0) * num_layers)
        return index < first or index >= num_layers - last

    defaults = {"group_size": opts.group_size, "bits": opts.bits, "mode": opts.mode}

    def predicate(path: str, module) -> Union[bool, dict]:
        params = dict(defaults)
        for pattern, rule in rules:
            if pattern.search(path) and in_window(rule, path):
                if rule.get("keep"):
                    return False
                params.update({k: rule[k] for k in ("group_size", "bits", "mode") if k in rule})
                break
        if module.weight.shape[-1] % params["group_size"]:
            return False
        # True (not an equal dict) keeps config.json free of per-layer entries that say nothing.
        return True if params == defaults else params

    return predicate
