"""Every released drafter layout drafts as the authors' own MLX code does.

The oracle is ``dflash/model_mlx.py`` from PyPI ``dflash==0.1.0`` (install it with
``pip install --no-deps dflash==0.1.0``). On the same target hidden states our
logits equal its logits (fp32, 1e-4), and whole greedy generations commit the
same tokens at every step, which are mlx_lm's greedy tokens.

One difference is deliberate. The official sliding-window layers keep context
K/V in mlx_lm's ``RotatingKVCache`` and build the window mask from the index of
each key in what the cache returns. After a one-row update to a full buffer (a
step that accepted no proposal) the cache returns its rows in ring order, not in
position order, so block row i >= 1 drops the first i slots of the ring
(whichever positions they hold: right after a wrap, the newest row) instead of
the i oldest positions: not the sliding window. We implement the true window; the generation tests run the official
model with a cache that always returns position order, and
``test_ring_order_is_the_only_difference`` shows that this artefact is all that
separates the two.
"""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache
from tiny import EOS_ID, LAYOUT_PROMPTS, LAYOUTS, SLIDING_WINDOW, decode

from dflash_mlx.models import load_drafter
from dflash_mlx.kernels import get_ops
from dflash_mlx.model import DFlashModel
from dflash_mlx.sampling import Greedy
from dflash_mlx.target import Target

official = pytest.importorskip(
    "dflash.model_mlx", reason="the official implementation is not installed: pip install --no-deps dflash==0.1.0"
)

OPS = get_ops(False)
MAX_TOKENS = 40


class TemporalRotatingKVCache(RotatingKVCache):
    """mlx_lm's RotatingKVCache, always returning its rows in position order (its concatenating path)."""

    def update_and_fetch(self, keys, values):
        return self._update_concat(keys, values)


@pytest.fixture(scope="module", autouse=True)
def local_official():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(official, "snapshot_download", lambda repo, **_: repo)  # tests never touch the hub
        yield patch


def official_steps(target_dir, draft_dir, prompt, block_size):
    # A fresh target each time: stream_generate hooks the model's layers for good.
    model, tokenizer = mlx_lm.load(str(target_dir))
    draft = official.load_draft(str(draft_dir))
    responses = official.stream_generate(model, draft, tokenizer, prompt, block_size=block_size, max_tokens=MAX_TOKENS)
    return [r.tokens for r in responses if r.tokens]


def our_steps(pair, prompt, block_size):
    # The drafter's proposals alone, as the official drafts: copies would change the steps.
    # One chain (no tree), as the official drafts.
    tokens, stats = decode(pair, prompt, MAX_TOKENS, engine_kwargs=dict(block_size=block_size, copy_proposals=False,
                                                                         tree_budget=0))
    steps, at = [], 0
    for n in [1] + stats.acceptance_lengths:  # the prefill's token, then each step's
        steps.append(tokens[at : at + n])
        at += n
    return steps


def until_eos(steps):
    out = []
    for tokens in steps:
        out.append(tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens)
        if EOS_ID in tokens:
            break
    return out


def full_block_steps(steps, block_size):
    """The steps both loops run with the full block (near max_tokens they size the last block differently)."""
    out, produced = [], 0
    for tokens in steps:
        if produced and produced + block_size > MAX_TOKENS:
            break
        out.append(tokens)
        produced += len(tokens)
    return out


def flat(steps):
    return [t for tokens in steps for t in tokens]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_equal_official(released_drafters, layout):
    target_dir, _, folders, _ = released_drafters
    ours, theirs = load_drafter(str(folders[layout])), official.load_draft(str(folders[layout]))
    model, _ = mlx_lm.load(str(target_dir))
    target = Target(model, ours.args.target_layer_ids)
    theirs.bind(model)
    _, hidden = target(mx.arange(30, 60, dtype=mx.int32)[None], target.make_cache())
    block = mx.array([17] + [ours.args.mask_token_id] * 15)
    our_cache, their_cache = ours.make_cache(), theirs.make_cache()
    our_picks, their_picks = ours.make_cache(), theirs.make_cache()  # DFlash2: the selector's greedy path
    reranked = 0
    # Two context updates (25 rows, more than the window, then 5): the caches carry over.
    for chunk in (hidden[:, :25], hidden[:, 25:]):
        embedded = target.embed(block)[None]
        logits = ours(embedded, chunk, our_cache, target.lm_head, OPS)
        want = theirs(block[None], chunk, their_cache, logits_start=1)
        np.testing.assert_allclose(np.array(logits), np.array(want), atol=1e-4, rtol=1e-4)
        if layout == "dflash2":
            got, _, _ = ours.propose(embedded, block[:1], chunk, our_picks, target.lm_head, Greedy(OPS))
            want = theirs.propose(block[None], chunk, their_picks, 0.0, logits_start=1)[0]
            assert got.tolist() == want.tolist()
            reranked += (got != mx.argmax(logits, axis=-1)).sum().item()
    if layout == "dflash2":
        assert reranked > 0  # the selector changed some picks: its path was really compared


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_generation_step_for_step_equals_official(released_drafters, layout, block_size, monkeypatch):
    monkeypatch.setattr(official, "RotatingKVCache", TemporalRotatingKVCache)
    target_dir, tokenizer, folders, answers = released_drafters
    model, _ = mlx_lm.load(str(target_dir))
    drafter = load_drafter(str(folders[layout]))
    pair = DFlashModel(Target(model, drafter.args.target_layer_ids), drafter)
    accepted = 0
    for text in LAYOUT_PROMPTS:
        prompt = tokenizer.encode(text)
        assert len(prompt) > 2 * SLIDING_WINDOW
        reference = answers[text][:MAX_TOKENS]
        ours = until_eos(our_steps(pair, prompt, block_size))
        theirs = until_eos(official_steps(target_dir, folders[layout], prompt, block_size))
        assert full_block_steps(ours, block_size) == full_block_steps(theirs, block_size)
        assert flat(ours)[:MAX_TOKENS] == flat(theirs)[:MAX_TOKENS] == reference[: len(flat(theirs))]
        accepted += sum(len(t) - 1 for t in ours)
    assert accepted >= 8  # the drafter really drafts: a random one accepts nothing


def test_ring_order_is_the_only_difference(released_drafters):
    """The official sliding layers match ours except right after a one-row update to a full
    window, where mlx_lm's ring order shifts the mask onto the wrong rows; with a cache that
    returns position order they match there too."""
    target_dir, _, folders, _ = released_drafters
    model, _ = mlx_lm.load(str(target_dir))
    ours = load_drafter(str(folders["2026"]))
    target = Target(model, ours.args.target_layer_ids)
    ring, temporal = official.load_draft(str(folders["2026"])), official.load_draft(str(folders["2026"]))
    ring.bind(model)
    temporal.bind(model)
    _, hidden = target(mx.arange(30, 60, dtype=mx.int32)[None], target.make_cache())
    block = mx.array([17] + [ours.args.mask_token_id] * 7)
    caches = {"ours": ours.make_cache(), "ring": ring.make_cache(),
              "temporal": [TemporalRotatingKVCache(c.max_size, c.keep) if isinstance(c, RotatingKVCache) else c
                           for c in temporal.make_cache()]}
    # A prompt longer than the window, two steps that accepted nothing (one new row each), one that accepted 2.
    for rows, one_row_into_full_window in ((slice(0, 20), False), (slice(20, 21), True), (slice(21, 22), True),
                                           (slice(22, 25), False)):
        chunk = hidden[:, rows]
        got = np.array(ours(target.embed(block)[None], chunk, caches["ours"], target.lm_head, OPS))
        want = np.array(temporal(block[None], chunk, caches["temporal"], logits_start=1))
        artefact = np.array(ring(block[None], chunk, caches["ring"], logits_start=1))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        if one_row_into_full_window:
            assert np.abs(artefact - got).max() > 1e-3
        else:
            np.testing.assert_allclose(artefact, got, atol=1e-4, rtol=1e-4)


def test_gemma4_block_input_equals_official():
    """Gemma 4 targets scale their embeddings by sqrt(hidden_size); the drafter's block input is
    that scaled embedding times input_embedding_scale, in the official code and in ours.
    (For gemma/gemma2/gemma3 targets, where mlx_lm scales inline and exposes no embed_scale, the
    official MLX code leaves the sqrt(hidden_size) out; we keep it: it is what the target's first
    layer sees.)"""
    from mlx_lm.utils import _get_classes

    config = dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=2, head_dim=32, global_head_dim=32, vocab_size=100,
                  vocab_size_per_layer_input=100, num_key_value_heads=1, num_kv_shared_layers=0,
                  hidden_size_per_layer_input=16)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    theirs = official.DFlashDraftModel(official.DFlashConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=64, vocab_size=100, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
        block_size=4, target_layer_ids=(0,), num_target_layers=2, input_embedding_scale=1.5)).bind(model)
    tokens = mx.array([[1, 5, 7]])
    ours = Target(model, [0]).embed(tokens) * 1.5
    np.testing.assert_allclose(np.array(ours), np.array(theirs.embed_tokens(tokens) * theirs.embed_scale), rtol=1e-6)
    assert not np.allclose(np.array(ours), 1.5 * np.array(theirs.embed_tokens(tokens)))  # the scale is really there
