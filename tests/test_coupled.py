"""Coupled sampling (Gumbel-max, noise fixed per position): exact, and the same text at every block size.

The committed token at position t is argmax(filtered log p_t / temp + g_t), with g_t drawn from
(seed, t) alone. So a speculative run must equal, token for token, plain decoding that draws each
token that way (whatever the block sizes, drafts and copies), and plain decoding that way must
sample the target's distribution: together, exactness in distribution.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from stats import ALPHA, chi_square_p_value
from tiny import VOCAB, OracleDrafter, decode

import dflash_mlx
from dflash_mlx import DFlashModel, Engine, stream_generate
from dflash_mlx.kernels import get_ops
from dflash_mlx.sampling import Coupled, SamplingParams, filtered_logprobs, position_key, probabilities

SETTINGS = [SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_p=0.9), SamplingParams(temp=1.3, top_k=12, min_p=0.02)]
IDS = ["temp", "top_p", "top_k_min_p"]


def sampled(logits: mx.array, params: SamplingParams, seed: int, position: int) -> int:
    return Coupled(params, get_ops(), seed, logits.shape[-1]).at(position).first(logits[None]).item()


@pytest.mark.parametrize("params", SETTINGS, ids=IDS)
def test_position_noise_samples_the_target_distribution(params):
    logits = mx.random.normal((VOCAB,), key=mx.random.key(0)) * 2
    expected = np.array(probabilities(logits[None], params))[0]
    counts = np.zeros(VOCAB, int)
    for seed in range(4000):
        counts[sampled(logits, params, seed, 17)] += 1
    assert chi_square_p_value(counts, expected) > ALPHA


def test_positions_draw_independently():
    logits = mx.log(mx.array([0.5, 0.3, 0.2]))
    params = SamplingParams(temp=1.0)
    pairs = np.zeros((3, 3), int)
    for seed in range(3000):
        pairs[sampled(logits, params, seed, 40), sampled(logits, params, seed, 41)] += 1
    p = np.array([0.5, 0.3, 0.2])
    assert chi_square_p_value(pairs.ravel(), np.outer(p, p).ravel()) > ALPHA
    assert position_key(5, 1).tolist() != position_key(5, 2).tolist() != position_key(6, 1).tolist()


def test_draft_vocabulary_picks_see_the_same_noise_per_id():
    V, params = 50, SamplingParams(temp=0.8)
    coupled = Coupled(params, get_ops(), 9, V).at(3)
    logits = mx.random.normal((2, V), key=mx.random.key(1))
    columns = mx.array([1, 4, 7, 11, 20, 33, 49])
    picks, q = coupled.propose(logits[:, columns], columns=columns)
    full = mx.where((mx.arange(V)[None] == columns[:, None]).any(0), logits, -mx.inf)
    assert q is None
    assert columns[picks].tolist() == coupled.propose(full)[0].tolist()


def plain_coupled(model, prompt: list[int], params: SamplingParams, seed: int, n: int) -> list[int]:
    """Plain decoding with mlx_lm's cache, each token argmax(filtered logprobs / temp + g_position)."""
    cache, tokens, out = make_prompt_cache(model), list(prompt), []
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    for _ in range(n):
        g = mx.random.gumbel((logits.shape[-1],), key=position_key(seed, len(tokens)))
        token = mx.argmax(filtered_logprobs(logits[None], params)[0] / params.temp + g).item()
        tokens.append(token)
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_speculative_output_equals_plain_coupled_decoding(tiny_pair, family):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair(family)))
    prompt = tokenizer.encode("Once upon a time, once upon a time")
    for params, seed in [(SETTINGS[0], 3), (SETTINGS[1], 4)]:
        reference = plain_coupled(model.target.model, prompt, params, seed, 24)
        for block_size in [1, 2, 4, "auto"]:
            for copies in [True, False]:
                out, _ = decode(model, prompt, 24, engine_kwargs=dict(block_size=block_size, copy_proposals=copies),
                                temp=params.temp, top_p=params.top_p, seed=seed)
                assert out == reference, (params, block_size, copies)


def test_seeded_generation_is_the_same_at_every_block_size_and_says_its_rule(tiny_pair):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair("qwen3")))

    def run(seed, block_size):
        mx.random.seed(seed)
        responses = list(stream_generate(model, tokenizer, "Hi there", 20, temp=1.0, top_p=0.95,
                                         block_size=block_size, stop_tokens=[]))
        return [r.token for r in responses], responses[-1].stats

    tokens, stats = run(7, 4)
    assert stats.sampling == "coupled"
    assert run(7, 1)[0] == run(7, "auto")[0] == tokens
    assert run(8, 4)[0] != tokens


def test_batched_rows_equal_plain_coupled_decoding(tiny_pair):
    """Each seeded row of a batch commits what plain coupled decoding with its seed does, whatever
    its neighbours, their block sizes and acceptance: an oracle proposes each row's own seeded
    continuation, wrong at a different rate per row, so rows accept different counts (ragged)."""
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    prompts = [tokenizer.encode(text) for text in ["Once upon a time", "abc abc abc abc", "The end"]]
    settings = [(SETTINGS[0], 11), (SETTINGS[1], 12), (SETTINGS[2], 13)]
    oracle = OracleDrafter(model.drafter)
    engine = Engine(DFlashModel(model.target, oracle), block_size=4)
    oracle.engine, references = engine, {}
    for prompt, (params, seed), wrong in zip(prompts, settings, (0, 3, 5)):
        reference = plain_coupled(model.target.model, prompt, params, seed, 16)
        if 2 in reference:  # the stop token ends the request
            reference = reference[: reference.index(2) + 1]
        uid = engine.add(prompt, max_tokens=16, temp=params.temp, top_p=params.top_p, top_k=params.top_k,
                         min_p=params.min_p, seed=seed, stop_tokens=[[2]])
        references[uid], oracle.refs[uid], oracle.wrong[uid] = reference, prompt + reference, wrong
    out = {uid: [] for uid in references}
    while not engine.idle:
        for event in engine.step():
            out[event.uid].append(event.token)
    for uid, reference in references.items():
        assert out[uid] == reference, uid
    assert engine.stats.ragged_steps > 0


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_nucleus_equals_mlx_lm_top_p(top_p):
    """Verify rows find top-p's nucleus among their largest entries: the same cut as mlx_lm's full
    sort, rows with ties included, up to the rounding of the mass (summed in another order, it
    may move a token across the cut when the mass above it lies within 1e-5 of top_p); a row whose
    nucleus is wider than the candidates falls back."""
    from mlx_lm.sample_utils import apply_top_p

    from dflash_mlx.sampling import NUCLEUS_CANDIDATES, nucleus

    V = 4 * NUCLEUS_CANDIDATES
    keys = mx.random.split(mx.random.key(5), 3)
    peaked = mx.random.normal((6, V), key=keys[0]) * 4
    tied = mx.round(mx.random.normal((3, V), key=keys[1]) * 4)
    flat = mx.random.normal((1, V), key=keys[2]) * 0.1  # nucleus of most of the vocabulary
    for rows in [peaked, tied, mx.concatenate([peaked[:2], flat])]:
        logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        expected, got = apply_top_p(logprobs, top_p), nucleus(logprobs, top_p)
        moved = np.argwhere(np.array((expected == -mx.inf) != (got == -mx.inf)))
        probs = np.exp(np.array(logprobs, np.float64))
        for row, token in moved:  # only at the boundary: the mass above it is top_p, give or take rounding
            above = probs[row][probs[row] > probs[row, token]].sum()
            assert min(abs(above - top_p), abs(above + probs[row, token] - top_p)) < 1e-5
        assert len(moved) <= rows.shape[0] // 2
    kept = (nucleus(peaked - mx.logsumexp(peaked, axis=-1, keepdims=True), top_p) > -mx.inf).sum(axis=-1)
    assert 1 <= kept.min().item() and kept.max().item() <= NUCLEUS_CANDIDATES  # the fast path ran
