"""After a rejected block, the target cache is as if nothing had been speculated."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import dflash_mlx


def greedy(model, prompt, n):
    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(mx.argmax(logits).item())
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("accepted", [0, 3, 7])
def test_next_verify_after_rollback_matches_plain_run(tiny_pair, family, accepted):
    model, tokenizer = dflash_mlx.load(*map(str, tiny_pair(family)))
    target = model.target
    prompt = mx.array(tokenizer.encode("Rollback must be exact."))
    truth = greedy(target.model, prompt, 12)

    # Speculative run: verify a block whose proposals go wrong after `accepted` tokens.
    cache = target.make_cache()
    target.prefill(prompt, cache)
    proposals = truth[1 : 1 + accepted] + [(t + 1) % target.vocab_size for t in truth[1 + accepted : 8]]
    logits, _ = target(mx.array([truth[:1] + proposals]), cache)
    verified = mx.argmax(logits[0], axis=-1).tolist()
    assert verified[: accepted + 1] == truth[1 : accepted + 2]
    target.rollback(cache, 7 - accepted)
    committed = truth[: accepted + 2]  # anchor, accepted proposals, bonus
    next_block = mx.array([committed[-1:] + truth[accepted + 2 : accepted + 5]])
    spec_logits, _ = target(next_block, cache)

    # Plain run over the committed tokens, then the same next block.
    plain = make_prompt_cache(target.model)
    target.model(prompt[None], cache=plain)
    target.model(mx.array([committed[:-1]]), cache=plain)
    plain_logits = target.model(next_block, cache=plain)

    assert cache[0].offset == plain[0].offset == prompt.size + accepted + 1 + 4
    np.testing.assert_allclose(np.array(spec_logits), np.array(plain_logits), rtol=1e-4, atol=1e-4)
