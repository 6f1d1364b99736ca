"""Long prompts with the drafter window on: the output stays mlx_lm's greedy decoding, token for
token, for a full-attention and a hybrid (Gated DeltaNet) target at a near-8k-token prompt."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from test_hybrid import build, make_drafter
from tiny import OracleDrafter

from dflash_mlx.decode import DecodeCache, speculative_decode
from dflash_mlx.kernels import get_ops
from dflash_mlx.models import load_drafter
from dflash_mlx.sampling import SamplingParams, make_strategy
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
    # cache is trimmed on every step, after a first draft over the whole prompt.
    oracle = OracleDrafter(drafter, prompt + ref, wrong_every=5)
    state = DecodeCache.new(target, oracle, WINDOW)
    steps = list(speculative_decode(mx.array(prompt), target, oracle, make_strategy(SamplingParams(), None, get_ops()),
                                    block_size=8, max_tokens=MAX_TOKENS, prompt_cache=state))
    assert [t for s in steps for t in s.tokens] == ref
    assert any(0 < s.accepted < s.block_size - 1 for s in steps) and max(s.accepted for s in steps) >= 3
    assert all(c.keys.shape[2] <= sum(WINDOW) for c in state.draft_cache)  # the window held
