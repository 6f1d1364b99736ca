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


def save_target(path: Path, family: str, seed: int = 0) -> Path:
    """An mlx_lm model of ``family`` with random fp32 weights, as a model folder."""
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    config = dict(TARGETS[family], eos_token_id=EOS_ID)
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


class RowOracleDrafter(Drafter):
    """``OracleDrafter`` for the batch engine: row r proposes the reference of request
    ``engine.uids[r]`` (``refs[uid]``: prompt + the target's continuation), wrong at
    every ``wrong[uid]``-th position (0: never). Set ``engine`` once it is built.

    One-hot rows are built by comparison, which a real vocabulary can afford.
    """

    def __init__(self, drafter: Drafter):
        super().__init__(drafter.args)
        self.update(drafter.parameters())
        self.refs, self.wrong, self.engine = {}, {}, None

    def draft_rows(self, block_embeddings, context_hidden, cache, lm_head, ops):
        logits = super().draft_rows(block_embeddings, context_hidden, cache, lm_head, ops)
        R, L = block_embeddings.shape[:2]
        if L == 1:  # a prompt chunk absorbed while prefilling: nothing drafted
            return logits
        rows = []
        for r, uid in enumerate(self.engine.uids):
            ref, every, start = self.refs[uid], self.wrong[uid], cache[0].lengths[r]
            for pos in range(start + 1, start + L):
                tok = ref[pos] if pos < len(ref) else 0
                rows.append((tok + 1) % logits.shape[-1] if every and pos % every == 0 else tok)
        hot = mx.arange(logits.shape[-1]) == mx.array(rows).reshape(R, L - 1, 1)
        # Depends on the real logits (so the forward runs) without their -inf
        # outside a draft vocabulary.
        return mx.depends(mx.where(hot, 30.0, 0.0), logits)
