"""Long prompts with the drafter window on: the output stays mlx_lm's greedy decoding, token for
token, for a full-attention and a hybrid (Gated DeltaNet) target at a near-8k-token prompt; and the
window means what it says: the drafter sees its first and last rows, nothing between."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from test_hybrid import build, make_drafter
from tiny import OracleDrafter

from dflash_mlx import DFlashModel, Engine
from dflash_mlx.cache.context import ContextCache
from dflash_mlx.kernels import get_ops
from dflash_mlx.models import load_drafter
from dflash_mlx.target import Target

PROMPT_TOKENS, MAX_TOKENS, WINDOW = 7936, 24, (16, 256)


def pair(family: str, tiny_pair):
    if family == "qwen3_5":
        model = build(family)
        return model, Target(model, [0, 2]), make_drafter(model)
    target_path, draft_path = tiny_pair(family)
    model, _ = mlx_lm.load(str(target_path))
    drafter = load_drafter(str(draft_path))
    return model, Target(model, drafter.args.target_layer_ids), drafter


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_windowed_greedy_equals_mlx_lm_after_an_8k_prompt(family, tiny_pair):
    model, target, drafter = pair(family, tiny_pair)
    V = target.vocab_size
    prompt = [(7 * i + (i * i) % 13) % (V - 4) + 4 for i in range(PROMPT_TOKENS)]
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)]
    # Long accepted runs with every 5th position wrong: rejections mid-block, so the window's
    # cache is cut on every step, after a prompt of which it took in only the window's rows.
    oracle = OracleDrafter(drafter, prompt + ref, wrong_every=5)
    engine = Engine(DFlashModel(target, oracle), block_size=8, max_rows=1, draft_window=WINDOW)
    engine.add(prompt, max_tokens=MAX_TOKENS)
    events = []
    while not engine.idle:
        events += engine.step()
        if engine.draft_cache is not None:
            assert all(c.lengths[0] <= sum(WINDOW) for c in engine.draft_cache)  # the window held
    assert [e.token for e in events] == ref
    stats = events[-1].stats
    accepted = [n - 1 for n in stats.acceptance_lengths]
    assert any(0 < n < b - 1 for n, b in zip(accepted, stats.block_sizes)) and max(accepted) >= 3
    assert stats.draft_window == WINDOW


@pytest.mark.parametrize("keep, recent", [(4, 8), (0, 5)])
def test_the_window_is_the_drafter_on_the_windowed_context_alone(tiny_pair, keep, recent):
    """Context taken in chunk by chunk under a window drafts what the drafter drafts over the first
    ``keep`` and the last ``recent`` rows alone, at their own positions."""
    _, target, drafter = pair("llama", tiny_pair)
    mx.random.seed(0)
    context = mx.random.normal((1, 30, len(drafter.args.target_layer_ids) * drafter.args.hidden_size))
    block = target.embed(mx.array([[7] + [drafter.args.mask_token_id] * 3]))
    ops, head = get_ops(False), target.head()
    windowed = drafter.make_cache((keep, recent))
    for start in range(0, 30, 7):  # chunk by chunk, as a prompt's prefill
        drafter.absorb(context[:, start : start + 7], windowed)
    alone = [ContextCache() for _ in drafter.layers]  # unbounded: only what is put in
    drafter.absorb(context[:, :keep], alone)
    for c in alone:
        c.skip([30 - keep - recent])
    drafter.absorb(context[:, 30 - recent :], alone)
    got = drafter(block, context[:, :0], windowed, head, ops)
    want = drafter(block, context[:, :0], alone, head, ops)
    assert windowed[0].positions == alone[0].positions == [30]
    assert mx.allclose(got, want, atol=1e-4).item()
