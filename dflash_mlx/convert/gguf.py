"""Read a GGUF file as an mlx_lm model: config, float weights under mlx_lm names, tokenizer.

llama.cpp's files differ from the Hugging Face layout that mlx_lm expects in three ways this
module undoes: tensor names (`blk.N.attn_q` vs `model.layers.N.self_attn.q_proj`), the row order
of the llama Q/K projections (llama.cpp interleaves the two rotary halves so its "normal" RoPE
can rotate adjacent pairs; mlx_lm rotates the first half against the second), and metadata
(hyper-parameters and the tokenizer live in key/value fields instead of JSON files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from dflash_mlx.errors import DFlashError

try:
    import gguf as _gguf
except ImportError:  # only needed for GGUF input, so fail when one is given
    _gguf = None


@dataclass(frozen=True)
class _Arch:
    """How one llama.cpp architecture maps onto an mlx_lm model."""

    model_type: str
    hf_architecture: str
    # llama.cpp permutes Q/K rows only for architectures it runs with "normal" (adjacent-pair) RoPE.
    permuted_qk: bool


_ARCHITECTURES = {
    "llama": _Arch("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": _Arch("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# mx.load decodes these natively (0.65 s for SmolLM2 vs 3.5 s through numpy); every other
# type goes through the gguf package's numpy dequantizers.
_MX_NATIVE = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
# ggml's legacy block formats all use 32 weights per scale.
_GGML_BLOCK = 32
# Block formats MLX's affine quantization (w = scale * q + bias, group 32) holds exactly; mx.load
# returns them packed that way: Q4_0 (w = d * (q - 8)) as scale d, bias -8d; Q4_1 (w = d * q + m)
# as d, m; Q8_0 (w = d * q, q signed) as q + 128 with bias -128d. Every product and sum is exact
# in float32, so with float32 scales and biases the MLX layer computes llama.cpp's weights.
PACKED_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
PACKED_GROUP_SIZE = _GGML_BLOCK


def _require_gguf() -> Any:
    if _gguf is None:
        raise DFlashError("Reading GGUF files needs the gguf package; fix: pip install gguf")
    return _gguf


class GGUFFile:
    """An opened, validated GGUF file of a supported architecture."""

    def __init__(self, path: Path):
        gguf = _require_gguf()
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError/struct.error/IndexError on damage
            raise DFlashError(
                f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                "fix: re-download or re-export it"
            ) from None
        self.architecture = str(self._field("general.architecture", ""))
        if self.architecture not in _ARCHITECTURES:
            raise DFlashError(
                f"GGUF architecture {self.architecture!r} in {self.path.name} is not supported "
                f"(supported: {', '.join(sorted(_ARCHITECTURES))}); fix: convert the model's "
                "Hugging Face checkpoint instead"
            )
        self.arch = _ARCHITECTURES[self.architecture]
        self._check_tensor_types()

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.architecture}.{key}", default)

    def _check_tensor_types(self) -> None:
        gguf = _require_gguf()
        decodable: dict[Any, bool] = {}
        for t in self.reader.tensors:
            if t.tensor_type not in decodable:
                decodable[t.tensor_type] = _can_dequantize(gguf, t.tensor_type)
            if not decodable[t.tensor_type]:
                raise DFlashError(
                    f"GGUF tensor {t.name} has type {t.tensor_type.name}, which cannot be "
                    "dequantized; fix: use a GGUF with F32/F16/Q*_0/Q*_1/K-quant tensors"
                )

    @property
    def tensor_types(self) -> dict[str, int]:
        """How many tensors the file stores in each ggml type, e.g. {"Q4_1": 210}."""
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def config(self) -> dict:
        """An HF-style config.json for mlx_lm, with every value mlx_lm would otherwise default."""
        names = {t.name for t in self.reader.tensors}
        hidden = int(self._arch_field("embedding_length"))
        heads = int(self._arch_field("attention.head_count"))
        kv_heads = self._arch_field("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise DFlashError(
                f"{self.path.name} has a per-layer KV head count, which mlx_lm's "
                f"{self.arch.model_type} cannot represent; fix: convert the HF checkpoint instead"
            )
        head_dim = int(self._arch_field("attention.key_length", hidden // heads))
        embed = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
        # ggml lists dimensions fastest-first, so the vocabulary is the last one.
        vocab = int(self._arch_field("vocab_size", int(embed.shape[-1])))
        config = {
            "model_type": self.arch.model_type,
            "architectures": [self.arch.hf_architecture],
            "hidden_size": hidden,
            "num_hidden_layers": int(self._arch_field("block_count")),
            "intermediate_size": int(self._arch_field("feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon")),
            "vocab_size": vocab,
            "max_position_embeddings": int(self._arch_field("context_length", 2048)),
            # Written explicitly: a missing rope_theta makes mlx_lm's llama silently use 10000.
            # 10000 is also llama.cpp's default when the file leaves it out.
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "mlp_bias": False,
        }
        config.update(self._rope_scaling())
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            value = self._field(f"tokenizer.ggml.{key}")
            if value is not None:
                config[key.replace("padding", "pad")] = int(value)
        return config

    def _rope_scaling(self) -> dict:
        if "rope_freqs.weight" in {t.name for t in self.reader.tensors}:
            raise DFlashError(
                f"{self.path.name} uses per-frequency RoPE factors (rope_freqs, e.g. Llama 3.1), "
                "which this converter cannot map back to rope_scaling; fix: convert the HF checkpoint"
            )
        kind = self._arch_field("rope.scaling.type", "none")
        if kind == "none":
            return {}
        if kind == "linear":
            return {"rope_scaling": {"type": "linear", "factor": float(self._arch_field("rope.scaling.factor"))}}
        raise DFlashError(
            f"{self.path.name} uses RoPE scaling {kind!r}, which this converter does not map; "
            "fix: convert the HF checkpoint instead"
        )

    @cached_property
    def _native(self) -> dict | None:
        """mx.load's view of the file when it can decode every tensor, else None."""
        native = {t.tensor_type.name for t in self.reader.tensors} <= _MX_NATIVE
        return mx.load(str(self.path)) if native else None

    def _to_mlx_rows(self, name: str, w: mx.array, config: dict) -> mx.array:
        """Undo llama.cpp's Q/K row permutation. It moves whole rows, so it applies alike to
        float weights and to packed ones with their scales and biases (groups run along a row)."""
        if self.arch.permuted_qk and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            return unpermute_qk(w, heads)
        return w

    def weights(self, config: dict, dtype: mx.Dtype) -> Iterator[tuple[str, mx.array]]:
        """Yield (mlx_lm name, weight cast to dtype), dequantizing exactly in float32 first."""
        stored = self._native
        for t in tqdm(self.reader.tensors, desc="Reading GGUF", unit="tensor", leave=False):
            name = _mlx_name(t.name, self.path)
            if stored is not None:
                w = _from_mx_load(stored, t.name)
            else:
                w = mx.array(_require_gguf().quants.dequantize(t.data, t.tensor_type))
            w = self._to_mlx_rows(name, w, config).astype(dtype)
            mx.eval(w)  # bound memory: materialise each tensor instead of one lazy graph of all
            yield name, w

    def packed_layers(self, config: dict) -> dict[str, tuple[int, dict[str, mx.array]]]:
        """The file's own quantized tensors for layers stored as Q4_0/Q4_1/Q8_0:
        mlx_lm layer path -> (bits, {"weight", "scales", "biases"}) in MLX's affine layout
        (group size PACKED_GROUP_SIZE, float16 scales and biases as stored)."""
        stored = self._native or {}
        layers = {}
        for t in self.reader.tensors:
            bits = PACKED_BITS.get(t.tensor_type.name)
            if bits is None or not t.name.endswith(".weight") or t.name not in stored:
                continue
            name = _mlx_name(t.name, self.path)
            stem = t.name.removesuffix(".weight")
            parts = {"weight": stored[t.name], "scales": stored[f"{stem}.scales"], "biases": stored[f"{stem}.biases"]}
            layers[name.removesuffix(".weight")] = (bits, {k: self._to_mlx_rows(name, v, config) for k, v in parts.items()})
        return layers

    def write_tokenizer(self, out_dir: Path) -> None:
        """Rebuild tokenizer.json, tokenizer_config.json and the chat template from metadata."""
        try:
            from transformers import PreTrainedTokenizerFast
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (
                GGUF_TOKENIZER_MAPPING,
                convert_gguf_tokenizer,
            )
        except ImportError:
            raise DFlashError(
                "this transformers version cannot rebuild a tokenizer from GGUF metadata; "
                "fix: pip install 'transformers>=5'"
            ) from None
        spec = {
            name: self._field(f"tokenizer.{key}")
            for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if f"tokenizer.{key}" in self.reader.fields
        }
        if "tokens" not in spec:
            raise DFlashError(
                f"{self.path.name} carries no tokenizer vocabulary; fix: use a GGUF exported "
                "with its tokenizer (llama.cpp's convert_hf_to_gguf.py writes it)"
            )
        try:
            backend, _ = convert_gguf_tokenizer(self.architecture, spec)
        except (ValueError, KeyError) as e:
            raise DFlashError(
                f"cannot rebuild the tokenizer of {self.path.name} ({type(e).__name__}: {e}); "
                "fix: use a GGUF exported with its full tokenizer metadata"
            ) from None
        tokens = spec["tokens"]
        specials = {
            role: tokens[spec[key]]
            for role, key in (
                ("bos_token", "bos_token_id"),
                ("eos_token", "eos_token_id"),
                ("unk_token", "unk_token_id"),
                ("pad_token", "pad_token_id"),
            )
            if key in spec
        }
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            chat_template=self._field("tokenizer.chat_template"),
            **specials,
        )
        tokenizer.save_pretrained(str(out_dir))

    def generation_config(self) -> dict:
        """generation_config.json values: mlx_lm reads its stop tokens from eos_token_id."""
        return {
            k: int(v)
            for k, v in (
                ("bos_token_id", self._field("tokenizer.ggml.bos_token_id")),
                ("eos_token_id", self._field("tokenizer.ggml.eos_token_id")),
            )
            if v is not None
        }

    def export(self, folder: Path) -> dict:
        """Write the file as an HF-layout float32 folder mlx_lm loads (config, weights, tokenizer);
        returns the config. float32 holds every dequantized GGUF weight exactly."""
        config = {**self.config(), "torch_dtype": "float32"}
        folder.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(folder / "model.safetensors"), dict(self.weights(config, mx.float32)), metadata={"format": "mlx"})
        write_json(folder / "config.json", config)
        write_json(folder / "generation_config.json", self.generation_config())
        self.write_tokenizer(folder)
        return config

    def describe(self) -> str:
        """One line for the model card: name, architecture and stored tensor types."""
        name = self._field("general.name", self.path.stem)
        types = ", ".join(f"{k} x{v}" for k, v in sorted(self.tensor_types.items()))
        return f"{name} (GGUF, {self.architecture}; tensors: {types})"


def _can_dequantize(gguf: Any, qtype: Any) -> bool:
    """Whether the gguf package can decode ``qtype``: dequantize one all-zero block of it."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((block_bytes,), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _mlx_name(gguf_name: str, path: Path) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    raise DFlashError(
        f"GGUF tensor {gguf_name} in {path.name} has no mlx_lm counterpart; "
        "fix: convert the model's Hugging Face checkpoint instead"
    )


def _from_mx_load(stored: dict, name: str) -> mx.array:
    w = stored[name]
    scales = stored.get(name.removesuffix(".weight") + ".scales")
    if scales is None:
        return w.astype(mx.float32)
    biases = stored[name.removesuffix(".weight") + ".biases"]
    bits = w.shape[-1] * 32 // (scales.shape[-1] * _GGML_BLOCK)
    # Scales are fp16 in the file; dequantizing with fp16 scales would round every weight
    # to fp16, so widen them first to get the exact float32 values llama.cpp computes.
    return mx.dequantize(
        w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=_GGML_BLOCK, bits=bits
    )


def unpermute_qk(w: mx.array, n_heads: int) -> mx.array:
    """Invert llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`).

    llama.cpp stores each head's rows as (half, pair) -> interleaved; mlx_lm expects (pair, half).
    """
    shape = w.shape
    half = shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def is_gguf(path: Path) -> bool:
    """A file whose first bytes are the GGUF magic (whatever its suffix)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"

