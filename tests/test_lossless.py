"""Greedy DFlash output must be token-for-token mlx_lm's greedy output."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_repetition_penalty
from tiny import OracleDrafter, async_evaluations, reads_apart_from_next_forward

import dflash_mlx
from dflash_mlx import DFlashModel, stream_generate
from dflash_mlx.policy import BlockPolicy

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    # Longer than the 16-token prefill chunk used below, so prefill takes 5 chunks.
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n# print the first ten\n",
]
MAX_TOKENS = 48


def reference(model, prompt, max_tokens=MAX_TOKENS, **kwargs):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, **kwargs)]


def dflash(model, tokenizer, prompt, block_size, max_tokens=MAX_TOKENS, **kwargs):
    responses = list(
        stream_generate(model, tokenizer, prompt, max_tokens, block_size=block_size, prefill_step_size=16, **kwargs)
    )
    return [r.token for r in responses], responses[-1].stats


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family(request, tiny_pair):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair(request.param)))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    refs = [reference(model.target.model, p) for p in prompts]
    return model, tokenizer, prompts, refs


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("drafter", ["random", "oracle", "oracle-corrupt"])
def test_greedy_matches_mlx_lm(family, block_size, drafter):
    model, tokenizer, prompts, refs = family
    taus = []
    for prompt, ref in zip(prompts, refs):
        pair = model
        if drafter != "random":
            wrong_every = 5 if drafter == "oracle-corrupt" else 0
            pair = DFlashModel(model.target, OracleDrafter(model.drafter, prompt + ref, wrong_every))
        out, stats = dflash(pair, tokenizer, prompt, block_size)
        # The tiny tokenizer's EOS can end a run early; everything produced must match.
        assert out == ref[: len(out)]
        assert len(out) == MAX_TOKENS or out[-1] == 2
        taus.append(stats.tau)
    if block_size > 1 and drafter == "oracle":
        # Whole blocks accepted, bonus token included: tau is the block size, bar the last step.
        assert min(taus) > 0.8 * block_size
    if block_size > 4 and drafter == "oracle-corrupt":
        assert 1 < min(taus) < block_size


def test_a_plain_step_is_read_without_waiting_for_the_next_forward(family, monkeypatch):
    """Plain steps start the next forward early (mlx_lm's pipelining, where it frees the host: a
    policy without a measured ``Overlap`` takes it that it does); their own outputs must be
    evaluated apart from it, or reading the token waits for that forward (one MLX evaluation)."""
    model, tokenizer, prompts, refs = family
    calls = async_evaluations(monkeypatch)
    out, stats = dflash(model, tokenizer, prompts[1], BlockPolicy(1))
    assert out == refs[1][: len(out)] and set(stats.block_sizes) == {1}
    assert reads_apart_from_next_forward(calls)


def test_full_blocks_and_bonus_path(family):
    model, tokenizer, prompts, refs = family
    oracle = OracleDrafter(model.drafter, prompts[0] + refs[0])
    out, stats = dflash(DFlashModel(model.target, oracle), tokenizer, prompts[0], 4, max_tokens=33)
    assert out == refs[0][:33]
    # 1 prefill token + 8 steps of 3 accepted proposals + 1 bonus token each.
    assert stats.acceptance_lengths == [4] * 8
    assert stats.histogram() == {4: 8}


def test_logits_processors_match_mlx_lm(family):
    model, tokenizer, prompts, _ = family
    processors = [make_repetition_penalty(1.5, 20)]
    ref = reference(model.target.model, prompts[0], logits_processors=processors)
    oracle = OracleDrafter(model.drafter, prompts[0] + ref, wrong_every=7)
    out, stats = dflash(
        DFlashModel(model.target, oracle), tokenizer, prompts[0], 8, logits_processors=processors
    )
    assert out == ref[: len(out)]
    assert stats.tau > 2


def test_greedy_sampler_via_match_strategy(family):
    """An opaque mlx_lm sampler goes through the exact match-accept path."""
    model, tokenizer, prompts, refs = family
    oracle = OracleDrafter(model.drafter, prompts[2] + refs[2], wrong_every=6)
    out, stats = dflash(
        DFlashModel(model.target, oracle), tokenizer, prompts[2], 8, sampler=lambda lp: mx.argmax(lp, axis=-1)
    )
    assert out == refs[2][: len(out)]
    assert stats.tau > 2


def test_target_model_is_left_untouched(family):
    """Taps live only for the duration of a call: plain mlx_lm use sees the original layers."""
    model, tokenizer, prompts, refs = family
    layers = list(model.target.layers)
    dflash(model, tokenizer, prompts[0], 4, max_tokens=8)
    assert all(a is b for a, b in zip(model.target.layers, layers))
    assert reference(model.target.model, prompts[0]) == refs[0]
