"""Sampling is exact in distribution: the acceptance rule and the whole loop.

Statistical tests use fixed seeds and a chi-square test at significance 1e-3:
a correct implementation fails at most once in a thousand seeds, and since the
seeds are fixed the outcome is reproducible.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from stats import ALPHA, chi_square_p_value

import dflash_mlx
from dflash_mlx import DFlashModel, Engine, stream_generate
from dflash_mlx.kernels import rejection_accept_twin
from dflash_mlx.models import Drafter
from dflash_mlx.sampling import SamplingParams, probabilities

# -- the acceptance rule on hand-made distributions ------------------------------

V, N = 8, 40000


def run_accept(p, q, seed):
    """N independent verify steps: proposals drawn from q, then the accept rule."""
    key_props, key_u = mx.random.split(mx.random.key(seed))
    proposals = mx.random.categorical(mx.log(q), shape=(N, q.shape[0]), key=key_props).astype(mx.int32)
    uniforms = mx.random.uniform(shape=(N, p.shape[0]), key=key_u)
    tokens, n = mx.vmap(rejection_accept_twin, in_axes=(None, None, 0, 0))(p, q, proposals, uniforms)
    return np.array(tokens), np.array(n), np.array(proposals)


def hand_made(seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V) * 0.5, size=3).astype(np.float32)
    q = rng.dirichlet(np.ones(V) * 0.5, size=2).astype(np.float32)
    q[1, 3] = 0  # a token only the target can produce: must come from the residual
    q[1] /= q[1].sum()
    return mx.array(p), mx.array(q)


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_rule_is_exact(seed):
    p, q = hand_made(seed)
    tokens, n, _ = run_accept(p, q, seed)
    p = np.array(p)
    # First committed token follows p[0], whatever q proposed.
    assert chi_square_p_value(np.bincount(tokens[:, 0], minlength=V), p[0]) > ALPHA
    # Given the first proposal was accepted, the second token follows p[1].
    second = tokens[n >= 1, 1]
    assert chi_square_p_value(np.bincount(second, minlength=V), p[1]) > ALPHA
    # Expected acceptance of the first proposal is sum(min(p, q)).
    expected = np.minimum(p[0], np.array(q)[0]).sum()
    assert abs((n >= 1).mean() - expected) < 5 * math.sqrt(expected * (1 - expected) / N)


def test_rejection_rule_edge_cases():
    p = mx.array([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    # q == p: every proposal is accepted, the bonus comes from the last row.
    tokens, n = rejection_accept_twin(p, p[:2], mx.array([1, 0]), mx.array([0.99, 0.99, 0.5]))
    assert n.item() == 2 and tokens.tolist() == [1, 0, 2]
    # A proposal the target gives probability zero is always rejected and replaced.
    q = mx.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    tokens, n = rejection_accept_twin(p, q, mx.array([0, 0]), mx.array([0.0, 0.0, 0.3]))
    assert n.item() == 0 and tokens.tolist() == [1, 0, 0]


def test_vmapped_rule_equals_single_calls():
    p, q = hand_made(3)
    key_props, key_u = mx.random.split(mx.random.key(3))
    proposals = mx.random.categorical(mx.log(q), shape=(5, 2), key=key_props).astype(mx.int32)
    uniforms = mx.random.uniform(shape=(5, 3), key=key_u)
    batched, _ = mx.vmap(rejection_accept_twin, in_axes=(None, None, 0, 0))(p, q, proposals, uniforms)
    for i in range(5):
        tokens, _ = rejection_accept_twin(p, q, proposals[i], uniforms[i])
        assert tokens.tolist() == batched[i].tolist()


# -- the whole loop --------------------------------------------------------------


class HalfKnowingDrafter(Drafter):
    """Proposes from the target's own (softened) distribution at the first position: its pick
    is sometimes the target's and sometimes not, so both accepted and rejected proposals run."""

    def __init__(self, drafter, target_model, prompt):
        super().__init__(drafter.args)
        self.update(drafter.parameters())
        self.target_model, self.prompt = [target_model], prompt  # list: not a child module
        self.rows: dict[int, mx.array] = {}  # the target's logits after prompt + anchor, by anchor

    def scores(self, block_embeddings, context_hidden, cache, lm_head, ops):
        logits = super().scores(block_embeddings, context_hidden, cache, lm_head, ops)  # no draft vocabulary
        table = self.target_model[0].model.embed_tokens.weight
        anchors = mx.argmin(((table[None] - block_embeddings[:, :1]) ** 2).sum(-1), axis=-1).tolist()
        for anchor in anchors:
            if anchor not in self.rows:
                self.rows[anchor] = self.target_model[0](mx.array([self.prompt + [anchor]]))[0, -1]
        first = mx.stack([self.rows[anchor] for anchor in anchors])[:, None]
        return mx.concatenate([0.6 * first, logits[:, 1:]], axis=1)


SETTINGS = [
    SamplingParams(temp=1.0),
    SamplingParams(temp=0.7, top_p=0.9),
    SamplingParams(temp=1.3, top_k=12, min_p=0.02),
]


@pytest.mark.parametrize("params", SETTINGS, ids=["temp", "top_p", "top_k_min_p"])
def test_loop_second_token_distribution(tiny_pair, params):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    target = model.target.model
    prompt = tokenizer.encode("Once upon a time")
    # Exact marginal of the 2nd generated token: sum over the first token.
    first = np.array(probabilities(target(mx.array([prompt]))[0, -1:], params))[0]
    batch = mx.array([prompt + [t] for t in range(len(first))])
    second_given_first = np.array(probabilities(target(batch)[:, -1], params))
    expected = first @ second_given_first

    # Through the engine (coupled sampling, the rule of DFlash drafters), a seed per run, 64 runs
    # decoded together.
    engine = Engine(DFlashModel(model.target, HalfKnowingDrafter(model.drafter, target, prompt)), block_size=4,
                    max_rows=64)
    runs = 1500
    uids = [engine.add(prompt, max_tokens=4, temp=params.temp, top_p=params.top_p, top_k=params.top_k,
                       min_p=params.min_p, seed=run) for run in range(runs)]
    events = {uid: [] for uid in uids}
    while not engine.idle:
        for event in engine.step():
            events[event.uid].append(event)
    counts = np.bincount([events[uid][1].token for uid in uids], minlength=len(first))
    accepted = sum(events[uid][1].from_draft for uid in uids)
    assert chi_square_p_value(counts, expected) > ALPHA
    assert 0.05 * runs < accepted < 0.98 * runs  # both accepted and rejected proposals ran


def test_seed_makes_sampling_reproducible(tiny_pair):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair("qwen3")))

    def run(seed):
        mx.random.seed(seed)
        return [r.token for r in stream_generate(model, tokenizer, "Hi", 24, temp=1.0, stop_tokens=[])]

    assert run(7) == run(7)
    assert run(7) != run(8)
