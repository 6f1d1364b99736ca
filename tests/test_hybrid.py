"""Hybrid targets: Gated DeltaNet (qwen3_next, qwen3_5, qwen3_5_moe) and sliding-window
attention (gemma3_text, gemma4_text, olmo3) layers must roll back exactly after a rejected block.

Every model here is a tiny random fp32 model built by the test itself. The sampling
test is statistical: a chi-square test at significance ALPHA with a fixed seed, so a
correct implementation fails it with probability at most 1e-3 over seeds, and the
outcome is reproducible.
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, RotatingKVCache
from mlx_lm.utils import _get_classes
from stats import ALPHA, chi_square_p_value
from tiny import EOS_ID, VOCAB, OracleDrafter, ScriptedPolicy, decode, drafter_config, save_drafter, save_tokenizer

import dflash_mlx
from dflash_mlx import DFlashModel, PromptCache, stream_generate
from dflash_mlx.errors import DFlashError
from dflash_mlx.models import Drafter, DrafterArgs, load_drafter
from dflash_mlx.sampling import SamplingParams, probabilities
from dflash_mlx.target import Target

V, H, WINDOW = 64, 32, 6
_QWEN_HYBRID = dict(
    hidden_size=H,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    vocab_size=V,
    max_position_embeddings=4096,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_QWEN3_5_ROPE = dict(type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[1, 1, 0])
CONFIGS = {
    "qwen3_5": dict(
        model_type="qwen3_5", text_config=dict(_QWEN_HYBRID, model_type="qwen3_5_text", rope_parameters=_QWEN3_5_ROPE)
    ),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe",
        text_config=dict(_QWEN_HYBRID, **_MOE, model_type="qwen3_5_moe_text", rope_parameters=_QWEN3_5_ROPE),
    ),
    "qwen3_next": dict(
        _QWEN_HYBRID,
        **_MOE,
        model_type="qwen3_next",
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=H,
        num_hidden_layers=4,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
        vocab_size=V,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
    ),
    "olmo3": dict(
        model_type="olmo3",
        hidden_size=H,
        num_hidden_layers=4,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        vocab_size=V,
        max_position_embeddings=4096,
        sliding_window=WINDOW,
        rope_theta=10000.0,
    ),
    "gemma4_text": dict(
        model_type="gemma4_text",
        hidden_size=H,
        num_hidden_layers=5,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        vocab_size=V,
        vocab_size_per_layer_input=V,
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=2,  # the last two layers reuse earlier K/V
        sliding_window=WINDOW,
        sliding_window_pattern=3,
        final_logit_softcapping=30.0,
    ),
}
FAMILIES = list(CONFIGS)
# Longer than WINDOW and than the prefill chunk, so prefill and decoding both slide.
PROMPT = [5, 17, 9, 33, 2, 41, 8, 8, 60, 12, 27, 3, 50, 19, 44, 7, 31, 22, 11, 58]
MAX_TOKENS = 28


def build(family: str) -> nn.Module:
    """A random fp32 model of ``family``, scaled up so its greedy choices are varied."""
    config = CONFIGS[family]
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def make_drafter(model: nn.Module, **overrides) -> Drafter:
    config = drafter_config(
        dict(hidden_size=H, vocab_size=V, rope_theta=10000.0, num_hidden_layers=len(model.layers)),
        target_layer_ids=[0, 2],
        **overrides,
    )
    mx.random.seed(1)
    drafter = Drafter(DrafterArgs.from_config(config))
    mx.eval(drafter.parameters())
    return drafter


def reference(model: nn.Module, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def dflash(target: Target, drafter: Drafter, prompt: list[int], block_size, n=MAX_TOKENS, **request):
    """Tokens, and per step (accepted proposals, block size), of one request."""
    out, stats = decode(DFlashModel(target, drafter), prompt, n, engine_kwargs=dict(block_size=block_size,
                        prefill_step_size=8), **request)
    return out, [(t - 1, b) for t, b in zip(stats.acceptance_lengths, stats.block_sizes)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = build(request.param)
    target = Target(model, [0, 2])
    return request.param, model, target, make_drafter(model), reference(model, PROMPT)


def test_cache_types(family):
    name, model, target, _, _ = family
    kinds = {type(c).__name__ for c in target.make_cache()}
    if name in ("gemma3_text", "olmo3", "gemma4_text"):
        assert any(isinstance(c, RotatingKVCache) for c in model.make_cache())
        assert kinds == {"RaggedKVCache"} and any(c.window for c in target.make_cache())
    else:
        assert kinds == {"ArraysCache", "RaggedKVCache"}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("drafter_kind", ["oracle", "random"])
def test_greedy_matches_mlx_lm(family, block_size, drafter_kind):
    name, model, target, drafter, ref = family
    if drafter_kind == "oracle":
        # Long accepted runs, with every 7th position wrong: rejections mid-block.
        drafter = OracleDrafter(drafter, PROMPT + ref, wrong_every=7)
    out, steps = dflash(target, drafter, PROMPT, block_size)
    assert out == ref, name
    if block_size > 1:
        accepted = [n for n, _ in steps]
        partial = [n for n, b in steps if n < b - 1]
        assert partial, "no block was rejected part-way: the rollback was not exercised"
        if drafter_kind == "oracle":
            assert max(accepted) >= min(block_size - 1, 5)


def test_logits_at_scores_one_column_per_row(family):
    """Scoring only chosen positions (the batch prefill's last prompt tokens) gives those logits:
    the final norm is cut to the columns before the head, softcapping and scaling included."""
    name, model, target, _, _ = family
    tokens = mx.array([PROMPT[:12], PROMPT[4:16]])
    full, hidden = target(tokens, None)
    columns = [11, 6]
    picked, hidden_picked = target(tokens, None, logits_at=columns)
    assert picked.shape == (2, 1, V), name
    for row, column in enumerate(columns):
        assert mx.allclose(picked[row, 0], full[row, column], rtol=1e-5, atol=1e-5).item(), name
    assert mx.array_equal(hidden, hidden_picked).item()
    assert target.final_norm is target._norm_owner["norm"]  # the model is left as it was


@pytest.mark.parametrize("rows", [1, 2])
def test_a_scored_prefill_runs_the_last_layer_from_its_first_scored_column(family, rows):
    """A prefill chunk scores only its last token: the last layer runs on the columns before the
    first scored one apart (MLX then computes only their keys and values), and the logits, hidden
    states and caches are those of one whole forward of each row alone."""
    name, model, target, _, _ = family
    if rows == 2 and target.cache_policy.mixers:
        pytest.skip("recurrent targets prefill one request at a time")
    chunks = [PROMPT[8:20], PROMPT[8:17]][:rows]

    def prefilled():
        cache = target.make_cache()
        target.prefill(mx.array(PROMPT[:8]), cache)
        return cache

    calls, last = [], target.layers[-1]

    class Recorded:
        def __call__(self, x, *args, **kwargs):
            calls.append(x.shape[1])
            return last(x, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(last, name)

    caches = [prefilled() for _ in chunks]
    target.layers[-1] = Recorded()
    try:
        scored = target.prefill_rows(caches, chunks)
    finally:
        target.layers[-1] = last
    # gemma4's last layer reads an earlier layer's keys (an array the split cannot cut): it runs whole.
    first = min(map(len, chunks)) - 1
    assert calls == ([12] if name == "gemma4_text" else [first, 12 - first]), name
    probe = mx.array([[5]])
    for chunk, cache, (logits, hidden) in zip(chunks, caches, scored):
        alone = prefilled()
        whole, whole_hidden = target(mx.array([chunk]), alone)
        assert mx.allclose(logits, whole[:, -1], rtol=1e-4, atol=1e-3).item(), name
        assert mx.allclose(hidden, whole_hidden, rtol=1e-4, atol=1e-3).item(), name
        assert [c.lengths for c in cache if hasattr(c, "lengths")] == [c.lengths for c in alone if hasattr(c, "lengths")]
        assert mx.allclose(target(probe, cache)[0], target(probe, alone)[0], rtol=1e-4, atol=1e-3).item(), name


def test_plain_steps_run_ahead_exactly(family):
    # Plain runs whose next anchor's forward starts before the host reads it, then drafted blocks
    # verified after an anchor that already ran: rollback reaches only into the proposals' forward.
    name, model, target, drafter, ref = family
    drafter = OracleDrafter(drafter, PROMPT + ref, wrong_every=4)
    out, steps = dflash(target, drafter, PROMPT, ScriptedPolicy([1, 1, 4, 1, 6, 2]))
    assert out == ref, name
    assert any(0 < n < b - 1 for n, b in steps)  # a block rejected part-way


def live(cache) -> list[mx.array]:
    """The rows/state a cache's next forward will use."""
    if isinstance(cache, ArraysCache):
        return [cache[0], cache[1]]
    n = cache.lengths[0]
    return [cache.keys[..., :n, :], cache.values[..., :n, :]]


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_text"])
def test_rollback_state_equals_plain_decoding(name):
    """After verify + rollback the caches hold what feeding the committed tokens leaves."""
    model = build(name)
    target = Target(model, [0, 2])
    prompt = mx.array(PROMPT)
    committed, block = [7, 30, 2], [7, 30, 2, 9, 9, 9]
    plain, spec = target.make_cache(), target.make_cache()
    target.prefill(prompt, plain, 8)
    target.prefill(prompt, spec, 8)
    target(mx.array([committed]), plain)
    target(mx.array([block]), spec)
    target.rollback(spec, 3)
    for a, b in zip(plain, spec):
        for x, y in zip(live(a), live(b)):
            assert x.shape == y.shape and mx.allclose(x, y, atol=1e-5).item()
    nxt = mx.array([[13, 4]])
    assert mx.allclose(target(nxt, plain)[0], target(nxt, spec)[0], atol=1e-4).item()


def test_rollback_only_reaches_the_last_forward():
    target = Target(build("qwen3_5"), [0, 2])
    cache = target.make_cache()
    target.prefill(mx.array(PROMPT), cache)
    target(mx.array([[1, 2, 3]]), cache)
    target.rollback(cache, 1)
    with pytest.raises(DFlashError, match="last forward"):
        target.rollback(cache, 3)


@pytest.mark.parametrize("name", FAMILIES)
def test_drafter_sees_the_scaled_embedding(name):
    """The drafter's block input is what the target's first layer receives (Gemma: * sqrt(H))."""
    model = build(name)
    target = Target(model, [0, 2])
    seen = []
    first = target.layers[0]

    class Spy:
        def __call__(self, x, *args, **kwargs):
            seen.append(x)
            return first(x, *args, **kwargs)

        def __getattr__(self, name):  # per-layer flags the model reads (is_linear, ...)
            return getattr(first, name)

    tokens = mx.array([[3, 9, 27]])
    target.layers[0] = Spy()
    try:
        model(tokens)
    finally:
        target.layers[0] = first
    assert mx.allclose(target.embed(tokens), seen[0], atol=1e-5).item()


def test_sliding_window_yarn_drafter_loads_and_runs(tmp_path):
    """Qwen3.6-style drafter: sliding-window layers and yarn RoPE, on a hybrid target."""
    model = build("qwen3_5")
    config = drafter_config(
        dict(hidden_size=H, vocab_size=V, rope_theta=10000.0, num_hidden_layers=4),
        target_layer_ids=[0, 2],
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    )
    drafter = load_drafter(str(save_drafter(tmp_path / "draft", config)))
    assert drafter.layers[0].self_attn.sliding_window == 4
    assert drafter.layers[1].self_attn.sliding_window is None
    assert type(drafter.layers[0].self_attn.rope).__name__ == "YarnRoPE"
    ref = reference(model, PROMPT, 16)
    out, _ = dflash(Target(model, [0, 2]), drafter, PROMPT, 4, n=16)
    assert out == ref


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_text"])
def test_load_and_stream_generate(tmp_path, name):
    """The public path: folders on disk -> dflash_mlx.load -> stream_generate, greedy exact."""
    config = dict(CONFIGS[name])
    if "text_config" in config:
        config["text_config"] = dict(config["text_config"], vocab_size=VOCAB)
    else:
        config["vocab_size"] = VOCAB
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))
    folder = tmp_path / name
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(dict(config, eos_token_id=EOS_ID)))
    save_tokenizer(folder)
    draft = drafter_config(
        dict(hidden_size=H, vocab_size=VOCAB, rope_theta=10000.0, num_hidden_layers=len(model.layers)),
        target_layer_ids=[0, 2],
    )
    pair, tokenizer = dflash_mlx.load(str(folder), str(save_drafter(tmp_path / "draft", draft)))
    prompt = tokenizer.encode("A prompt longer than the sliding window.")
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), pair.target.model, max_tokens=20)]
    out = [r.token for r in stream_generate(pair, tokenizer, prompt, 20, block_size=4, prefill_step_size=8)]
    assert out == ref[: len(out)] and (len(out) == 20 or out[-1] == EOS_ID)


def test_sampling_third_token_distribution():
    """Sampling on qwen3_5 is exact after rollbacks.

    Block size 2 with the greedy continuation as the drafter's pick: under coupled sampling it is
    accepted when it is the seed's draw, with probability p(x), so the first step is often rejected and rolled back (a
    Gated DeltaNet replay) before the third token is drawn. Its empirical
    distribution over seeded runs must match the exact marginal, enumerated over
    the first two tokens.
    """
    model = build("qwen3_5")
    target = Target(model, [0, 2])
    params = SamplingParams(temp=0.7)
    prompt = PROMPT[:6]
    p1 = np.array(probabilities(model(mx.array([prompt]))[0, -1:], params))[0]
    p2 = np.array(probabilities(model(mx.array([prompt + [a] for a in range(V)]))[:, -1], params))
    pairs = mx.array([prompt + [a, b] for a in range(V) for b in range(V)])
    p3 = np.array(probabilities(model(pairs)[:, -1], params)).reshape(V, V, V)
    expected = np.einsum("a,ab,abv->v", p1, p2, p3)

    drafter = OracleDrafter(make_drafter(model), prompt + reference(model, prompt, 4))
    runs, counts, rejected = 600, np.zeros(V, int), 0
    for seed in range(runs):
        out, steps = dflash(target, drafter, prompt, 2, n=3, temp=params.temp, seed=2026 + seed)
        counts[out[2]] += 1
        rejected += steps[0][0] == 0
    assert chi_square_p_value(counts, expected) > ALPHA
    assert 0.05 * runs < rejected < runs - 20  # both the rollback and the full-accept paths ran


def test_unsupported_recurrent_target_is_refused():
    """LFM2's short-conv layers keep an ArraysCache state that is not a Gated DeltaNet."""
    config = dict(
        model_type="lfm2", vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5, conv_bias=False,
        conv_L_cache=3, block_dim=H, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False, intermediate_size=64, full_attn_idxs=[1],
    )
    model_cls, args_cls = _get_classes(config)
    with pytest.raises(DFlashError, match="unsupported target architecture 'lfm2': layer 0 .*cannot roll back"):
        Target(model_cls(args_cls.from_dict(config)), [0])


def test_rotating_cache_with_attention_sinks_is_refused():
    model = build("gemma3_text")
    model.make_cache = lambda: [RotatingKVCache(max_size=WINDOW, keep=4) for _ in model.layers]
    with pytest.raises(DFlashError, match="attention sinks"):
        Target(model, [0, 2])


def test_changed_mlx_lm_layer_fails_loudly():
    """If mlx_lm changes the Gated DeltaNet layer we rely on, loading fails instead of decoding wrong."""
    model = build("qwen3_5")

    class Renamed(nn.Module):
        def __call__(self, x, mask=None, cache=None):
            return x

    model.layers[0]["linear_attn"] = Renamed()
    with pytest.raises(DFlashError, match=r"mlx_lm .* changed the Gated DeltaNet layer"):
        Target(model, [0, 2])


def test_second_chat_turn_reuses_the_prompt_cache_exactly(family):
    """A prompt that extends the last turn starts from what the prompt cache holds; never wrong."""
    name, model, target, drafter, ref = family
    cache, pair = PromptCache(), DFlashModel(target, drafter)
    kwargs = dict(block_size=4, prefill_step_size=8, prompt_cache=cache)
    first, _ = decode(pair, PROMPT, 12, engine_kwargs=kwargs)
    turn = PROMPT + first + PROMPT[:5]
    second, _ = decode(pair, turn, 12, engine_kwargs=kwargs)
    assert second == reference(model, turn, 12)
    assert cache.entries and len(list(cache.entries.values())[-1].tokens) > len(turn)
