"""A draft vocabulary: the drafter scores a subset of token ids; output is unchanged."""

import json
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from stats import ALPHA, chi_square_p_value
from test_lossless import MAX_TOKENS, PROMPTS, dflash, reference
from tiny import TARGETS, drafter_config, save_target

import dflash_mlx
from dflash_mlx import DFlashModel, kernels
from dflash_mlx.convert import convert
from dflash_mlx.models import Drafter, DrafterArgs, load_drafter, save_drafter
from dflash_mlx.errors import DFlashError
from dflash_mlx.kernels import rejection_accept_twin
from dflash_mlx.sampling import Greedy, Rejection, SamplingParams, probabilities
from dflash_mlx.target import Target


def vocab_drafter(family: str, rows: mx.array, seed: int = 1) -> Drafter:
    mx.random.seed(seed)
    drafter = Drafter(DrafterArgs.from_config(drafter_config(TARGETS[family], draft_vocab_size=rows.size)))
    drafter.draft_vocab = rows
    return drafter


def random_rows(vocab: int, n: int, seed: int = 0) -> mx.array:
    return mx.array(np.sort(np.random.default_rng(seed).choice(vocab, n, replace=False)).astype(np.int32))


@pytest.mark.parametrize("quantized", [False, True])
def test_head_rows_are_columns_of_the_full_head(tmp_path, quantized):
    model, _ = mlx_lm.load(str(save_target(tmp_path / "t", "qwen3")))
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    target = Target(model, [1])
    rows = random_rows(target.vocab_size, 37)
    h = mx.random.normal((5, target.hidden_size), key=mx.random.key(0))
    assert mx.allclose(target.head(rows)(h), target.lm_head(h)[:, rows], atol=1e-4).item()


def test_drafter_proposes_only_its_vocabulary(tiny_pair):
    model, _ = mlx_lm.load(str(tiny_pair("qwen3")[0]))
    rows = random_rows(TARGETS["qwen3"]["vocab_size"], 20)
    drafter = vocab_drafter("qwen3", rows)
    target = Target(model, drafter.args.target_layer_ids)
    _, hidden = target(mx.array([[5, 9, 11, 40, 7]]), None)
    block = target.embed(mx.array([[7] + [drafter.args.mask_token_id] * 7]))
    scores = drafter.scores(block, hidden, drafter.make_cache(), target.head(rows), kernels.get_ops(False))[0]
    logits = drafter.full_vocab(scores)  # what the drafter's forward returns
    assert scores.shape[-1] == rows.size
    outside = np.setdiff1d(np.arange(target.vocab_size), np.array(rows))
    assert np.isinf(np.array(logits)[:, outside]).all()
    assert np.isfinite(np.array(logits)[:, np.array(rows)]).all()
    assert set(np.array(logits.argmax(-1)).tolist()) <= set(np.array(rows).tolist())
    # The confidence, taken over the draft vocabulary alone, is the full softmax's top probability.
    flat = logits * 0.01  # a random drafter's picks are near-certain: flatten them, -inf stays
    top = mx.softmax(flat, axis=-1).max(axis=-1)
    tokens, _, confidence = drafter.pick(scores * 0.01, Greedy(kernels.get_ops(False)).propose)
    assert mx.allclose(confidence, top, atol=1e-6).item()
    assert tokens.tolist() == flat.argmax(-1).tolist()
    assert (top < 0.9).all().item()


@pytest.mark.parametrize("params", [SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_p=0.9)],
                         ids=["temp", "top_p"])
def test_sampled_picks_over_the_draft_vocabulary_are_exact(params):
    """Sampled over the draft vocabulary's columns alone, a pick follows the distribution a
    sampler over the whole vocabulary gives (the rest scores -inf), its q is that distribution,
    and the acceptance rule with that q commits the target's distribution."""
    vocab, n = TARGETS["qwen3"]["vocab_size"], 20000
    rows = random_rows(vocab, vocab // 3, seed=2)
    drafter = vocab_drafter("qwen3", rows)
    scores = mx.random.normal((2, rows.size), key=mx.random.key(3)) * 2
    logits = drafter.full_vocab(scores)  # what the drafter's forward returns over all V
    strategy = Rejection(params, kernels.get_ops(False))
    expected_q = np.array(probabilities(logits, params))
    tokens, q, _ = drafter.pick(mx.broadcast_to(scores, (n, *scores.shape)), partial(strategy.propose, key=mx.random.key(4)))
    assert np.allclose(np.array(q[:3]), expected_q, atol=1e-6)
    tokens = np.array(tokens)
    assert np.isin(tokens, np.array(rows)).all()
    assert chi_square_p_value(np.bincount(tokens[:, 0], minlength=vocab), expected_q[0]) > ALPHA
    # The target agrees in part and puts mass where the drafter never proposes: the residual covers it.
    noise = mx.random.normal((3, vocab), key=mx.random.key(5))
    p = probabilities(mx.concatenate([drafter.full_vocab(scores, -1.0) + noise[:2], noise[2:]]), params)
    uniforms = mx.random.uniform(shape=(n, 3), key=mx.random.key(6))
    committed, accepted = mx.vmap(rejection_accept_twin, in_axes=(None, 0, 0, 0))(p, q, mx.array(tokens), uniforms)
    assert chi_square_p_value(np.bincount(np.array(committed[:, 0]), minlength=vocab), np.array(p[0])) > ALPHA
    assert 0.05 * n < (np.array(accepted) >= 1).sum() < 0.95 * n


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_matches_mlx_lm_with_a_draft_vocabulary(tiny_pair, family):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair(family)))
    # Half the ids: the target's own tokens are often outside, so blocks stop early.
    pair = DFlashModel(model.target, vocab_drafter(family, random_rows(model.target.vocab_size, 64)))
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        out, stats = dflash(pair, tokenizer, prompt, 8)
        assert out == reference(model.target.model, prompt)[: len(out)]
        assert len(out) == MAX_TOKENS or out[-1] == 2
        assert stats.block_sizes and max(stats.block_sizes) == 8


def test_draft_vocabulary_survives_saving_and_conversion(tmp_path):
    rows = random_rows(TARGETS["qwen3"]["vocab_size"], 48)
    src, out = tmp_path / "draft", tmp_path / "draft-4bit"
    save_drafter(vocab_drafter("qwen3", rows), src, mx.bfloat16)
    assert json.loads((src / "config.json").read_text())["draft_vocab_size"] == 48
    convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=32)
    for path in (src, out):
        loaded = load_drafter(str(path))
        assert loaded.vocab_rows.dtype == mx.int32 and mx.array_equal(loaded.vocab_rows, rows).item()


def test_ids_outside_the_vocabulary_are_refused(tmp_path):
    rows = random_rows(TARGETS["qwen3"]["vocab_size"], 8)
    save_drafter(vocab_drafter("qwen3", rows.at[-1].add(10_000)), tmp_path / "bad")
    with pytest.raises(DFlashError, match="draft_vocab .* outside"):
        load_drafter(str(tmp_path / "bad"))
