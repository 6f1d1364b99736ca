"""`dflash-mlx convert`: DFlash drafters, HF-layout targets and GGUF files to MLX safetensors.

One pipeline for every input:

    read -> cast (--dtype) -> quantize (recipe -> mlx_lm quant predicate) -> save -> verify -> publish

Targets are cast, quantized and saved by `mlx_lm.convert` itself, from a staging folder that holds
what mlx_lm needs to read the source right (a GGUF file exported as an HF folder; a transformers-5
config with its RoPE base and dtype stated where mlx_lm looks). Drafters, which mlx_lm cannot load,
go through the same mlx_lm steps by hand (`quantize_model`, `save_model`, `save_config`). GGUF
layers quantized exactly as the file stores them get the file's own tensors back afterwards.

All writing happens in a hidden folder next to the destination, which replaces the destination only
once it is complete and verified; any failure or interrupt removes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..errors import DFlashError
from .recipe import Q_MODES, Options, QuantPredicate, load_recipe, make_quant_predicate

DTYPES = ("float16", "bfloat16", "float32")
# (group_size, bits) each mode uses when the command line does not say; mlx_lm's choices.
_MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


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


# ---------------------------------------------------------------------------------------------
# Reading: what the pipeline needs of each kind of source


def _staged_target(src: Path, config: dict, stage: Path) -> None:
    """A folder mlx_lm reads `src` from correctly: every file linked, config.json restated.

    transformers 5 nests rope_theta in rope_parameters (mlx_lm's llama then silently uses 10000)
    and writes `dtype` where mlx_lm.convert looks for `torch_dtype`: both are lifted."""
    stage.mkdir()
    for f in src.iterdir():
        if f.name != "config.json" and not f.name.startswith("."):
            (stage / f.name).symlink_to(f.resolve())
    fixed = dict(config)
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params and "rope_theta" not in config:
        fixed["rope_theta"] = params["rope_theta"]
        if params.get("rope_type", "default") != "default" and "rope_scaling" not in config:
            fixed["rope_scaling"] = params
    if "torch_dtype" not in config and config.get("dtype") in DTYPES:
        fixed["torch_dtype"] = config["dtype"]
    (stage / "config.json").write_text(json.dumps(fixed, indent=2))


def _convert_target(src: Path, stage: Path, out: Path, opts: Options, predicate: Optional[QuantPredicate]) -> None:
    from mlx_lm.convert import convert as mlx_lm_convert

    try:
        mlx_lm_convert(str(stage), str(out), quantize=predicate is not None, q_group_size=opts.group_size,
                       q_bits=opts.bits, q_mode=opts.mode, dtype=opts.dtype, quant_predicate=predicate)
    except (ValueError, TypeError) as e:  # TypeError: a config missing arguments the model class requires
        raise DFlashError(
            f"{src} is neither a DFlash drafter nor a target mlx_lm can load ({e}); "
            "fix: pass a DFlash drafter, a supported HF causal LM, or a .gguf file"
        ) from None
    except (OSError, KeyError) as e:
        raise DFlashError(f"{src} is missing model or tokenizer files ({type(e).__name__}: {e}); fix: download the full model folder") from None


def _convert_drafter(src: Path, config: dict, out: Path, opts: Options, predicate: Optional[QuantPredicate]) -> None:
    """mlx_lm.convert's steps for a model mlx_lm cannot load itself."""
    import mlx.core as mx
    from mlx_lm.utils import quantize_model, save_config, save_model

    from ..copying import save_corpus
    from ..models import load_drafter

    try:
        drafter = load_drafter(str(src))  # parameter names are the released checkpoint's names
    except DFlashError as e:
        raise DFlashError(f"cannot read {src} as a DFlash drafter ({e}); fix: pass a released DFlash drafter folder") from None
    dtype = opts.dtype or config.get("torch_dtype") or config.get("dtype")
    if dtype in DTYPES:
        drafter.set_dtype(getattr(mx, dtype))  # floating parameters only: draft_vocab stays int32
    if predicate is not None:
        _, config = quantize_model(drafter, config, opts.group_size, opts.bits, mode=opts.mode, quant_predicate=predicate)
    corpus = drafter.corpus
    save_model(out, drafter, donate_model=True)
    save_config(dict(config), out / "config.json")
    if corpus is not None:
        save_corpus(out, corpus.tokens)


def carry_over_packed(out: Path, packed: dict) -> int:
    """Put the GGUF's own tensors back wherever a layer was quantized exactly as the file stores
    it (same bits, group 32, affine): re-quantizing rounds llama.cpp's grid onto a new one,
    quantizing twice. `packed`: layer path -> (bits, {weight, scales, biases}). Returns how many
    layers were carried over."""
    import mlx.core as mx

    from .gguf import PACKED_GROUP_SIZE

    config = json.loads((out / "config.json").read_text())
    quantization = config.get("quantization")
    index_file = out / "model.safetensors.index.json"
    if not quantization or not packed:
        return 0
    files = json.loads(index_file.read_text())["weight_map"] if index_file.is_file() else {}
    updates: dict[str, dict[str, mx.array]] = {}
    for path, (bits, tensors) in packed.items():
        layer = quantization.get(path)
        settings = layer if isinstance(layer, dict) else quantization
        if f"{path}.scales" not in files:
            continue  # kept in float by the recipe
        if (settings.get("mode", "affine"), settings["group_size"], settings["bits"]) == ("affine", PACKED_GROUP_SIZE, bits):
            updates.setdefault(files[f"{path}.scales"], {})[path] = tensors
    for name, layers in updates.items():
        weights = mx.load(str(out / name))
        for path, tensors in layers.items():
            # Scales and biases are float16 in the file: any float dtype holds them exactly.
            scale_dtype = weights[f"{path}.scales"].dtype
            weights.update({f"{path}.{k}": v if k == "weight" else v.astype(scale_dtype) for k, v in tensors.items()})
        mx.save_safetensors(str(out / name), weights, metadata={"format": "mlx"})
    return sum(len(layers) for layers in updates.values())


# ---------------------------------------------------------------------------------------------
# Verifying what was written, and the model card


def _verified(forward: Callable[[], tuple]) -> float:
    """Run forward (load the written folder, one small forward) and return the loaded model's bits
    per weight; any failure becomes a DFlashError, so a broken conversion never replaces the
    destination."""
    import mlx.core as mx
    from mlx_lm.utils import compute_bits_per_weight

    try:
        model, logits = forward()
        ok = bool(mx.all(mx.isfinite(logits)).item())
    except Exception as e:
        raise DFlashError(f"the converted model does not load back ({type(e).__name__}: {e}); fix: report this with the source model") from None
    if not ok:
        raise DFlashError("the converted model produces non-finite logits; fix: convert with --dtype float32 or fewer quantized layers")
    return float(compute_bits_per_weight(model))


def verify_target(path: Path) -> float:
    """Load the written folder with plain mlx_lm and run one forward."""
    def forward():
        import mlx.core as mx
        from mlx_lm import load

        model, tokenizer = load(str(path))
        # One token: quantized matmuls on MLX's CPU backend cost seconds per row.
        tokens = tokenizer.encode("Hello")[:1] or [0]
        return model, model(mx.array([tokens]))

    return _verified(forward)


def verify_drafter(path: Path) -> float:
    """Load the written folder with dflash-mlx's drafter loader and draft one 2-token block from
    2 random context rows. A drafter has no LM head of its own, so the check stops at its final
    hidden states (an identity head, tiled to the width of its draft vocabulary if it has one)."""
    def forward():
        import mlx.core as mx

        from ..models import load_drafter
        from ..kernels import get_ops

        drafter = load_drafter(str(path))
        args, dtype = drafter.args, drafter.norm.weight.dtype
        key = mx.random.key(0)  # leaves the caller's global random state alone
        context = mx.random.normal((1, 2, len(args.target_layer_ids) * args.hidden_size), key=key)
        block = mx.random.normal((1, 2, args.hidden_size), key=key)
        rows = drafter.vocab_rows  # ids outside a draft vocabulary score -inf by design
        width = args.hidden_size if rows is None else rows.size
        head = lambda h: h[..., mx.arange(width) % args.hidden_size]  # noqa: E731
        logits = drafter(block.astype(dtype), context.astype(dtype), drafter.make_cache(), head, get_ops(False))
        return drafter, logits if rows is None else logits[..., rows]

    return _verified(forward)


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
        "---", "library_name: mlx", "tags: [mlx, dflash-mlx]", "---", f"# {result.path.name}", "",
        f"MLX {result.kind} converted by `dflash-mlx convert`.", "",
        f"- Source: {result.source}",
        f"- Recipe: {recipe_line}",
        f"- Quantization: {quant}",
        f"- Bits per weight: {result.bits_per_weight:.3f}",
        f"- Size: {result.size_bytes / 2**20:.1f} MiB of safetensors",
    ]
    if result.carried_layers:
        lines.append(f"- Layers carried over from the GGUF's quantization unchanged: {result.carried_layers}")
    if result.kind == "target":
        usage = ["from mlx_lm import load", f'model, tokenizer = load("{result.path.name}")']
    else:
        usage = ["import dflash_mlx", f'model, tokenizer = dflash_mlx.load("path/to/target", "{result.path.name}")']
    lines += ["", "```python", *usage, "```", ""]
    (folder / "README.md").write_text("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Entry points


def _publish(done: Path, dst: Path, force: bool, tag: str) -> None:
    """Move the finished folder into place; with force, the old destination goes only after."""
    if not dst.exists() and not dst.is_symlink():
        done.rename(dst)
        return
    if not force:
        raise DFlashError(f"destination {dst} appeared during conversion; fix: pass --force or choose another --mlx-path")
    old = dst.with_name(f".{dst.name}.replaced-{tag}")
    dst.rename(old)
    try:
        done.rename(dst)
    except BaseException:
        old.rename(dst)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def _resolve_options(quantize, q_bits, q_group_size, q_mode, dtype, recipe) -> Options:
    if q_mode not in _MODE_DEFAULTS:
        raise DFlashError(f"unknown quantization mode {q_mode!r}; fix: use one of {', '.join(Q_MODES)}")
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"unknown dtype {dtype!r}; fix: use one of {', '.join(DTYPES)}")
    default_group, default_bits = _MODE_DEFAULTS[q_mode]
    opts = Options(bool(quantize or recipe), q_bits or default_bits, q_group_size or default_group, q_mode, dtype, recipe)
    if opts.quantize:
        import mlx.core as mx

        try:  # before any reading: a bad combination fails in a second, not after loading the model
            mx.quantize(mx.zeros((8, 4 * opts.group_size)), opts.group_size, opts.bits, mode=opts.mode)
        except (ValueError, RuntimeError) as e:
            raise DFlashError(
                f"cannot quantize with bits={opts.bits}, group size {opts.group_size}, mode {opts.mode} "
                f"({e}); fix: pick a combination MLX supports (e.g. mxfp4 needs 4 bits, group 32)"
            ) from None
    return opts


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
    from ..checkpoint import load_weights, read_config, resolve
    from ..models import is_drafter_config
    from .gguf import GGUFFile, is_gguf

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
        gguf, config = GGUFFile(src), None
        kind = "target"
    else:
        gguf, config = None, read_config(src)
        load_weights(src, "model")  # one-line errors for missing or unreadable weights, before any work
        kind = "drafter" if is_drafter_config(config) else "target"
    recipe_data = None
    if opts.quantize:
        recipe_data = load_recipe(opts.recipe or f"{kind}_default")
        if recipe_data.get("family", "any") not in ("any", kind):
            raise DFlashError(f"recipe {recipe_data['name']} is for {recipe_data['family']} models, this is a {kind}; fix: pick a {kind} recipe")

    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        out = tmp / "out"
        if gguf is not None:  # read: the GGUF becomes an HF-layout folder, then it is a target like any other
            config = gguf.export(tmp / "stage")
        elif kind == "target":
            _staged_target(src, config, tmp / "stage")
        layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers", 0)
        predicate = make_quant_predicate(recipe_data, layers, opts) if recipe_data is not None else None
        if kind == "target":
            _convert_target(src, tmp / "stage", out, opts, predicate)
            shutil.rmtree(tmp / "stage")
        else:
            _convert_drafter(src, config, out, opts, predicate)
        carried = carry_over_packed(out, gguf.packed_layers(config)) if gguf is not None else 0
        # Verified before it is published; bits per weight are read off the model that loaded back.
        bpw = (verify_target if kind == "target" else verify_drafter)(out)
        saved = json.loads((out / "config.json").read_text())
        result = ConversionResult(dst, kind, gguf.describe() if gguf else str(src), recipe_data and recipe_data["name"],
                                  saved.get("quantization"), bpw, sum(f.stat().st_size for f in out.glob("*.safetensors")),
                                  carried)
        write_model_card(result, recipe_data, out)
        # mkdtemp makes the folder private (0700); the result should have ordinary permissions.
        umask = os.umask(0)
        os.umask(umask)
        out.chmod(0o777 & ~umask)
        _publish(out, dst, force, tmp.name)
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
