"""`dflash-mlx convert`: DFlash drafters, HF-layout targets and GGUF files to MLX safetensors.

Every input goes through the same steps, so a drafter, a target and a GGUF file differ only in how
the model is read:

    read -> cast (--dtype) -> quantize (recipe -> mlx_lm quant predicate) -> save -> model card
         -> load back and run one forward -> move into place

All writing happens in a hidden folder next to the destination, which replaces the destination only
once it is complete and verified; any failure or interrupt removes it.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from dflash_mlx.checkpoint import load_weights, read_config, resolve
from dflash_mlx.drafter import is_drafter_config, load_drafter
from dflash_mlx.errors import DFlashError
from dflash_mlx.gguf import PACKED_GROUP_SIZE, GGUFFile, is_gguf, write_json
from dflash_mlx.kernels import get_ops

DTYPES = ("float16", "bfloat16", "float32")
Q_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
# (group_size, bits) each mode uses when the command line does not say; mlx_lm's choices.
_MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
_RULE_KEYS = {"pattern", "layers", "keep", "bits", "group_size", "mode"}

QuantPredicate = Callable[[str, nn.Module], Union[bool, dict]]


@dataclass
class ConversionResult:
    """What `convert` wrote, for callers and the model card."""

    path: Path
    kind: str  # "target" or "drafter"
    source: str
    recipe: Optional[str]
    quantization: Optional[dict]
    bits_per_weight: float
    size_bytes: int
    carried_layers: int = 0  # GGUF layers kept in the file's own quantization, not re-quantized


@dataclass(frozen=True)
class _Options:
    quantize: bool
    bits: int
    group_size: int
    mode: str
    dtype: Optional[str]
    recipe: Optional[str]


# ---------------------------------------------------------------------------------------------
# Recipes


def load_recipe(name_or_path: str) -> dict:
    """A recipe by shipped name (`mixed_4_8`) or JSON path, validated. See convert/README.md."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise DFlashError(f"recipe file {path} does not exist; fix: pass a shipped recipe name or a JSON file")
        text, where = path.read_text(), str(path)
    else:
        shipped = importlib.resources.files("dflash_mlx.recipes").joinpath(f"{name_or_path}.json")
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
    files = importlib.resources.files("dflash_mlx.recipes").iterdir()
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


def make_quant_predicate(recipe: dict, model: nn.Module, opts: _Options) -> QuantPredicate:
    """The mlx_lm `quant_predicate` a recipe describes: False keeps a layer in float, True
    quantizes it with the command line's settings, a dict with its own (mlx_lm then records
    those per layer in config.json)."""
    indices = {i for name, _ in model.named_modules() if (i := _layer_index(name + ".")) is not None}
    n_layers = max(indices) + 1 if indices else 0
    rules = [(re.compile(r["pattern"]), r) for r in recipe.get("rules", [])]

    def in_window(rule: dict, path: str) -> bool:
        window, index = rule.get("layers"), _layer_index(path + ".")
        if window is None or index is None:
            return True
        first = int(window.get("first", 0) * n_layers)
        last = int(window.get("last", 0) * n_layers)
        return index < first or index >= n_layers - last

    defaults = {"group_size": opts.group_size, "bits": opts.bits, "mode": opts.mode}

    def predicate(path: str, module: nn.Module) -> Union[bool, dict]:
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


# ---------------------------------------------------------------------------------------------
# Steps shared by every input


def cast_floats(model: nn.Module, dtype: Optional[str]) -> None:
    """Cast floating parameters to dtype, leaving those the model asks to keep (mlx_lm's
    `cast_predicate`, e.g. float32 router weights) alone."""
    if dtype is None:
        return
    target = getattr(mx, dtype)
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(name: str, value: mx.array) -> mx.array:
        if keep(name) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(target)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))


def quantize(model: nn.Module, config: dict, recipe: dict, opts: _Options) -> dict:
    """Quantize in place with mlx_lm; returns the config with its `quantization` entry."""
    from mlx_lm.utils import quantize_model

    predicate = make_quant_predicate(recipe, model, opts)
    try:
        _, config = quantize_model(
            model, config, opts.group_size, opts.bits, mode=opts.mode, quant_predicate=predicate
        )
    except (ValueError, RuntimeError) as e:
        raise DFlashError(
            f"cannot quantize with bits={opts.bits}, group size {opts.group_size}, mode {opts.mode} "
            f"({e}); fix: pick a combination MLX supports (e.g. mxfp4 needs 4 bits, group 32)"
        ) from None
    return config


def bits_per_weight(model: nn.Module) -> float:
    """Stored bits per weight, counting scales and biases (mlx_lm's definition)."""
    from mlx_lm.utils import compute_bits_per_weight

    return float(compute_bits_per_weight(model))


def save_model_files(out: Path, model: nn.Module, config: dict) -> None:
    """Sharded safetensors + index and config.json (with `quantization`), as mlx_lm writes them."""
    from mlx_lm.utils import save_config, save_model

    save_model(out, model, donate_model=True)
    save_config(dict(config), out / "config.json")


def weights_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def write_model_card(result: ConversionResult, recipe: Optional[dict], folder: Path) -> None:
    """README.md in folder (the temporary one; result.path is where it will end up)."""
    q = result.quantization
    if q is None:
        quant = "none (float weights)"
    else:
        overrides = sum(isinstance(v, dict) for v in q.values())
        quant = f"{q['bits']}-bit {q['mode']}, group size {q['group_size']}"
        if overrides:
            quant += f"; {overrides} layers with their own settings (see config.json)"
    recipe_line = "none"
    if recipe is not None:
        recipe_line = f"`{recipe['name']}` - {recipe.get('description', '')}".rstrip(" -")
    lines = [
        "---",
        "library_name: mlx",
        "tags: [mlx, dflash-mlx]",
        "---",
        f"# {result.path.name}",
        "",
        f"MLX {result.kind} converted by `dflash-mlx convert`.",
        "",
        f"- Source: {result.source}",
        f"- Recipe: {recipe_line}",
        f"- Quantization: {quant}",
        f"- Bits per weight: {result.bits_per_weight:.3f}",
        f"- Size: {result.size_bytes / 2**20:.1f} MiB of safetensors",
        "",
    ]
    if result.carried_layers:
        lines.insert(-1, f"- Layers carried over from the GGUF's quantization unchanged: {result.carried_layers}")
    if result.kind == "target":
        lines += ["```python", "from mlx_lm import load", f'model, tokenizer = load("{result.path.name}")', "```", ""]
    else:
        usage = f'model, tokenizer = dflash_mlx.load("path/to/target", "{result.path.name}")'
        lines += ["```python", "import dflash_mlx", usage, "```", ""]
    (folder / "README.md").write_text("\n".join(lines))


def _verify(forward: Callable[[], mx.array]) -> None:
    """Run forward (load the written folder, one small forward) and turn any failure into a
    DFlashError, so a broken conversion never replaces the destination."""
    try:
        ok = bool(mx.all(mx.isfinite(forward())).item())
    except Exception as e:
        raise DFlashError(f"the converted model does not load back ({type(e).__name__}: {e}); fix: report this with the source model") from None
    if not ok:
        raise DFlashError("the converted model produces non-finite logits; fix: convert with --dtype float32 or fewer quantized layers")


def verify_target(path: Path) -> None:
    """Load the written folder with plain mlx_lm and run one forward."""
    from mlx_lm import load

    def forward() -> mx.array:
        model, tokenizer = load(str(path))
        # One token: quantized matmuls on MLX's CPU backend cost seconds per row.
        tokens = tokenizer.encode("Hello")[:1] or [0]
        return model(mx.array([tokens]))

    _verify(forward)


def verify_drafter(path: Path) -> None:
    """Load the written folder with dflash-mlx's drafter loader and draft one 2-token block from
    2 random context rows. A drafter has no LM head of its own, so the check stops at its final
    hidden states (an identity head, tiled to
    the width of its draft vocabulary if it has one)."""

    def forward() -> mx.array:
        drafter = load_drafter(str(path))
        args, dtype = drafter.args, drafter.norm.weight.dtype
        key = mx.random.key(0)  # leaves the caller's global random state alone
        context = mx.random.normal((1, 2, len(args.target_layer_ids) * args.hidden_size), key=key)
        block = mx.random.normal((1, 2, args.hidden_size), key=key)
        width = args.hidden_size if drafter.vocab_rows is None else drafter.vocab_rows.size
        head = lambda h: h[..., mx.arange(width) % args.hidden_size]  # noqa: E731
        logits = drafter(block.astype(dtype), context.astype(dtype), drafter.make_cache(), head, get_ops(False))
        rows = drafter.vocab_rows  # ids outside a draft vocabulary score -inf by design
        return logits if rows is None else logits[..., rows]

    _verify(forward)


# ---------------------------------------------------------------------------------------------
# Inputs


def _lifted_rope(config: dict) -> dict:
    """transformers 5 nests rope_theta in rope_parameters; mlx_lm's llama only reads the top level
    and silently falls back to 10000. Lift it so the saved config.json states it."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params or "rope_theta" in config:
        return {}
    lifted = {"rope_theta": params["rope_theta"]}
    if params.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        lifted["rope_scaling"] = params
    return lifted


def _convert_target(src: Path, config: dict, out: Path, opts: _Options, recipe: Optional[dict]) -> ConversionResult:
    from mlx_lm.utils import load as mlx_load
    from mlx_lm.utils import save as mlx_save

    load_weights(src, "model")
    try:
        model, tokenizer, config = mlx_load(str(src), model_config=_lifted_rope(config), lazy=True, return_config=True)
    except (ValueError, TypeError) as e:  # TypeError: a config missing arguments the model class requires
        raise DFlashError(
            f"{src} is neither a DFlash drafter nor a target mlx_lm can load ({e}); "
            "fix: pass a DFlash drafter, a supported HF causal LM, or a .gguf file"
        ) from None
    except (OSError, KeyError) as e:
        raise DFlashError(f"{src} is missing model or tokenizer files ({type(e).__name__}: {e}); fix: download the full model folder") from None
    # mlx_lm reads only the legacy `torch_dtype`; transformers 5 writes `dtype`.
    cast_floats(model, opts.dtype or config.get("torch_dtype") or config.get("dtype"))
    if recipe is not None:
        config = quantize(model, config, recipe, opts)
    bpw = bits_per_weight(model)
    mlx_save(out, src, model, tokenizer, config)
    return ConversionResult(out, "target", str(src), recipe and recipe["name"], config.get("quantization"), bpw, weights_size(out))


def _convert_gguf(src: Path, out: Path, opts: _Options, recipe: Optional[dict]) -> ConversionResult:
    from mlx_lm.utils import _get_classes

    gg = GGUFFile(src)
    config = gg.config()
    # float32 even when quantizing: it holds dequantized and carried-over GGUF weights exactly. On
    # SmolLM2 Q4_1 carried over, float16 (1 bit/weight smaller) measured max logit error 0.56 vs
    # 1.1e-4, and MLX's CPU backend ran it 40x slower.
    dtype = opts.dtype or "float32"
    config["torch_dtype"] = dtype
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(gg.weights(config, getattr(mx, dtype)))
    try:
        model.load_weights(list(model.sanitize(weights).items()))
    except ValueError as e:
        raise DFlashError(f"the tensors of {src.name} do not fit its metadata ({e}); fix: re-export the GGUF") from None
    del weights
    carried = 0
    if recipe is not None:
        config = quantize(model, config, recipe, opts)
        carried = carry_over_packed(model, gg.packed_layers(config), getattr(mx, dtype))
    bpw = bits_per_weight(model)
    out.mkdir(exist_ok=True)
    save_model_files(out, model, config)
    gg.write_tokenizer(out)
    write_json(out / "generation_config.json", gg.generation_config())
    return ConversionResult(
        out, "target", gg.describe(), recipe and recipe["name"], config.get("quantization"), bpw, weights_size(out), carried
    )


def carry_over_packed(model: nn.Module, packed: dict, dtype: mx.Dtype) -> int:
    """Swap in the GGUF's own tensors wherever a layer was quantized exactly as the file stores
    it (same bits, group 32, affine): re-quantizing would round llama.cpp's grid onto a new one,
    quantizing twice. Returns how many layers were carried over."""
    carried = 0
    for path, module in model.named_modules():
        if path not in packed or not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        bits, tensors = packed[path]
        if (module.mode, module.group_size, module.bits) == ("affine", PACKED_GROUP_SIZE, bits):
            # Scales and biases are float16 in the file, so any float dtype holds them exactly.
            module.update({k: v if k == "weight" else v.astype(dtype) for k, v in tensors.items()})
            carried += 1
    return carried


def _convert_drafter(src: Path, config: dict, out: Path, opts: _Options, recipe: Optional[dict]) -> ConversionResult:
    load_weights(src, "model")
    try:
        model = load_drafter(str(src))  # parameter names are the released checkpoint's names
    except DFlashError as e:
        raise DFlashError(f"cannot read {src} as a DFlash drafter ({e}); fix: pass a released DFlash drafter folder") from None
    cast_floats(model, opts.dtype or config.get("torch_dtype") or config.get("dtype"))
    if recipe is not None:
        config = quantize(model, config, recipe, opts)
    bpw = bits_per_weight(model)
    out.mkdir(exist_ok=True)
    save_model_files(out, model, config)
    return ConversionResult(out, "drafter", str(src), recipe and recipe["name"], config.get("quantization"), bpw, weights_size(out))


# ---------------------------------------------------------------------------------------------
# Entry points


def _publish(tmp: Path, dst: Path, force: bool) -> None:
    """Move the finished folder into place; with force, the old destination goes only after."""
    if not dst.exists() and not dst.is_symlink():
        tmp.rename(dst)
        return
    if not force:
        raise DFlashError(f"destination {dst} appeared during conversion; fix: pass --force or choose another --mlx-path")
    old = dst.with_name(f".{dst.name}.replaced-{tmp.name}")
    dst.rename(old)
    try:
        tmp.rename(dst)
    except BaseException:
        old.rename(dst)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def _resolve_options(quantize, q_bits, q_group_size, q_mode, dtype, recipe) -> _Options:
    if q_mode not in _MODE_DEFAULTS:
        raise DFlashError(f"unknown quantization mode {q_mode!r}; fix: use one of {', '.join(Q_MODES)}")
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"unknown dtype {dtype!r}; fix: use one of {', '.join(DTYPES)}")
    default_group, default_bits = _MODE_DEFAULTS[q_mode]
    return _Options(bool(quantize or recipe), q_bits or default_bits, q_group_size or default_group, q_mode, dtype, recipe)


def convert(
    model: str,
    mlx_path: str,
    quantize: bool = False,
    q_bits: Optional[int] = None,
    q_group_size: Optional[int] = None,
    q_mode: str = "affine",
    dtype: Optional[str] = None,
    recipe: Optional[str] = None,
    force: bool = False,
) -> ConversionResult:
    """Convert a DFlash drafter, an HF-layout target folder/repo or a GGUF file to an MLX folder.

    `q_bits` / `q_group_size` default to the mode's defaults (4 bits, group 64 for affine).
    A `recipe` (shipped name or JSON path) implies quantization. The source is never modified;
    `mlx_path` is only replaced (with `force`) once the new folder is complete and loads.
    """
    opts = _resolve_options(quantize, q_bits, q_group_size, q_mode, dtype, recipe)
    src = resolve(model, "model").resolve()
    dst = Path(mlx_path).expanduser().absolute()
    if (dst.exists() or dst.is_symlink()) and not force:
        raise DFlashError(f"destination {dst} already exists; fix: pass --force to replace it or choose another --mlx-path")
    if dst.resolve() == src or src in dst.resolve().parents:
        raise DFlashError(f"destination {dst} is the source or inside it; fix: choose an --mlx-path outside {src}")
    if not dst.parent.is_dir():
        raise DFlashError(f"folder {dst.parent} does not exist; fix: create it or choose another --mlx-path")

    if src.is_file():
        if not is_gguf(src):
            raise DFlashError(f"{src} is not a GGUF file (bad magic); fix: pass a .gguf file or a model folder")
        kind, config = "gguf", None
    else:
        config = read_config(src)
        kind = "drafter" if is_drafter_config(config) else "target"
    recipe_data = None
    if opts.quantize:
        recipe_data = load_recipe(opts.recipe or ("drafter_default" if kind == "drafter" else "target_default"))
        family = "drafter" if kind == "drafter" else "target"
        if recipe_data.get("family", "any") not in ("any", family):
            raise DFlashError(f"recipe {recipe_data['name']} is for {recipe_data['family']} models, this is a {family}; fix: pick a {family} recipe")

    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        # mkdtemp makes the folder private (0700); the result should have ordinary permissions.
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        if kind == "gguf":
            result = _convert_gguf(src, tmp, opts, recipe_data)
        elif kind == "drafter":
            result = _convert_drafter(src, config, tmp, opts, recipe_data)
        else:
            result = _convert_target(src, config, tmp, opts, recipe_data)
        result.path = dst
        write_model_card(result, recipe_data, tmp)
        (verify_target if result.kind == "target" else verify_drafter)(tmp)
        _publish(tmp, dst, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `convert`'s flags (named like mlx_lm.convert's) on a (sub)parser."""
    parser.add_argument("--model", "--hf-path", required=True, help="model folder, HF repo id, or .gguf file")
    parser.add_argument("--mlx-path", required=True, help="output folder (must not exist unless --force)")
    parser.add_argument("-q", "--quantize", action="store_true", help="quantize (implied by --recipe)")
    parser.add_argument("--q-bits", type=int, choices=(4, 8), default=None, help="bits per weight (default: the mode's, 4 for affine)")
    parser.add_argument("--q-group-size", type=int, choices=(32, 64, 128), default=None, help="group size (default: the mode's, 64 for affine)")
    parser.add_argument("--q-mode", choices=Q_MODES, default="affine", help="quantization mode")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="float dtype, also of quantization scales (default: the source's; float32 for GGUF)")
    parser.add_argument("--recipe", default=None, help="recipe name (e.g. mixed_4_8) or JSON file; see convert/README.md")
    parser.add_argument("--force", action="store_true", help="replace an existing --mlx-path once the new one is complete")


def run(args: argparse.Namespace) -> int:
    """Run `convert` from parsed arguments; DFlashError propagates to the CLI's handler."""
    result = convert(
        args.model, args.mlx_path, quantize=args.quantize, q_bits=args.q_bits, q_group_size=args.q_group_size,
        q_mode=args.q_mode, dtype=args.dtype, recipe=args.recipe, force=args.force,
    )
    print(f"Wrote {result.kind} to {result.path}: {result.bits_per_weight:.2f} bits per weight, {result.size_bytes / 2**20:.1f} MiB")
    return 0
