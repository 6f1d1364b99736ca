"""Tiny models the tests build themselves: tokenizer, mlx_lm targets, drafters."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from dflash_mlx.drafter import Drafter, DrafterArgs

SPECIALS = ["<pad>", "<s>", "</s>", "<mask>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
VOCAB = len(SPECIALS) + len(CHARS)
EOS_ID, MASK_ID = 2, 3
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

TARGETS = {
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}


def save_tokenizer(path: Path) -> None:
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def save_target(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """An mlx_lm model of ``family`` (config entries replaced by ``overrides``) with random fp32
    weights, as a model folder."""
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    config = dict(TARGETS[family], eos_token_id=EOS_ID, **overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Default init gives a near-constant output; larger matrices make the random
    # model "chatty" (varied, peaked next-token choices), a harder test.
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.5
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    save_tokenizer(path)
    return path


def drafter_config(target_config: dict, **overrides) -> dict:
    """A config.json in the released DFlash layout for a target."""
    n_layers = overrides.pop("num_hidden_layers", 2)
    layer_ids = overrides.pop("target_layer_ids", [1, 4][:n_layers] if n_layers <= 2 else None)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target_config["hidden_size"],
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "vocab_size": target_config["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": target_config["rope_theta"],
        "max_position_embeddings": 4096,
        "block_size": 16,
        "num_target_layers": target_config["num_hidden_layers"],
        "dflash_config": {"mask_token_id": MASK_ID},
    }
    if layer_ids is not None:
        config["dflash_config"]["target_layer_ids"] = layer_ids
    config.update(overrides)
    return config


def save_drafter(path: Path, config: dict, seed: int = 1, dtype=mx.float32) -> Path:
    """Random drafter weights saved like the released PyTorch checkpoints."""
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = Drafter(DrafterArgs.from_config(config))
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


class OracleDrafter(Drafter):
    """A drafter that knows the answer: the target's own greedy continuation.

    It still runs the real drafter forward (so cache bookkeeping is exercised)
    but replaces its logits with a peak on the reference token, corrupting every
    ``wrong_every``-th position so some blocks are rejected part-way.
    """

    def __init__(self, drafter: Drafter, reference: list[int], wrong_every: int = 0):
        super().__init__(drafter.args)
        self.update(drafter.parameters())
        self.reference, self.wrong_every = reference, wrong_every

    def __call__(self, block_embeddings, context_hidden, cache, lm_head, ops):
        logits = super().__call__(block_embeddings, context_hidden, cache, lm_head, ops)
        start = cache[0].offset  # the anchor's position: context rows are positions 0..start-1
        V = logits.shape[-1]
        rows = []
        for i in range(1, block_embeddings.shape[1]):
            pos = start + i
            tok = self.reference[pos] if pos < len(self.reference) else 0
            if self.wrong_every and pos % self.wrong_every == 0:
                tok = (tok + 1) % V
            rows.append(tok)
        return logits * 0 + 30.0 * mx.eye(V)[mx.array(rows)]
