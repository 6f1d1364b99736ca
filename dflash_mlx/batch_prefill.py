"""Prompts of requests joining the batch engine, prefilled together.

A joining request holds one-row caches until its prompt is in (``BatchEngine._prefill``). The
chunks of several such requests go through one target forward: their rows are stacked into one
ragged cache, each chunk right-padded to the longest (attention is causal, so no prompt token sees
a pad, and each row's pads are trimmed off after), then split back into one-row caches. Recurrent
layers would run the pads through their state, so those targets prefill one request at a time.
"""

from __future__ import annotations

import mlx.core as mx

from .cache.ragged import RaggedKVCache
from .target import Target

# Prompt tokens per prefill step of the batch engine: a request that joins running rows holds them
# up for one forward of this many tokens per step (mlx_lm prefills 2048 at a time).
PREFILL_STEP_SIZE = 512


def prefill_chunks(target: Target, chunks: list[tuple[list, list[int]]], step_size: int) -> list[tuple[mx.array, mx.array]]:
    """For each (one-row caches, prompt tokens): the last token's logits (1, V) and the tokens'
    hidden states (1, n, k*H). Each list of caches is refilled in place."""
    if len(chunks) == 1 or target.cache_policy.mixers:
        return [target.prefill(mx.array(tokens), cache, step_size) for cache, tokens in chunks]
    lengths = [len(tokens) for _, tokens in chunks]
    width = max(lengths)
    rows = mx.array([tokens + [0] * (width - len(tokens)) for _, tokens in chunks], mx.int32)
    joint = []
    for layer in zip(*(cache for cache, _ in chunks)):
        stacked = RaggedKVCache(0, layer[0].window)
        for c in layer:
            stacked.extend(c)
        joint.append(stacked)
    logits, hidden = target(rows, joint, logits_at=[n - 1 for n in lengths])
    target.cache_policy.forget()
    for c in joint:
        c.trim_rows([width - n for n in lengths])
    for r, (cache, _) in enumerate(chunks):
        cache[:] = [c.take(r, c.lengths[r]) for c in joint]
    return [(logits[r : r + 1, 0], hidden[r : r + 1, :n]) for r, n in enumerate(lengths)]
