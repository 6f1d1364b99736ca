"""mlx_lm-shaped batch generation: ``batch_generate`` runs many prompts through the ``BatchEngine``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .batch import BatchEngine
from .batch_prefill import PREFILL_STEP_SIZE
from .decode import LogitsProcessor
from .errors import DFlashError
from .generation import encode_prompt
from .model import DFlashModel
from .sampling import Sampler
from .stats import EngineStats


@dataclass
class BatchResponse:
    """mlx_lm's ``BatchResponse``: one text per prompt, in prompt order.

    ``stats`` is the engine's record (rows per step, ragged steps, tokens and
    seconds); ``caches`` is always None: the batch engine keeps no prompt caches.
    """

    texts: list[str]
    stats: EngineStats
    caches: None = None
    token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None


def batch_generate(
    model: DFlashModel,
    tokenizer: TokenizerWrapper,
    prompts: Sequence[str | list[int]],
    prompt_caches: None = None,
    max_tokens: int | list[int] = 128,
    verbose: bool = False,
    return_prompt_caches: bool = False,
    return_token_ids: bool = False,
    return_logprobs: bool = False,
    *,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    sampler: Sampler | None = None,
    seed: int | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    stop_tokens: Iterable[int | Sequence[int]] = (),
    block_size: int | str | None = None,
    completion_batch_size: int = 8,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    use_metal: bool | None = None,
    copy_proposals: bool = True,
) -> BatchResponse:
    """Generate a response for every prompt, decoding them together with DFlash.

    Arguments mirror ``mlx_lm.batch_generate`` (the sampling ones are
    ``stream_generate``'s, applied to every prompt); each output is what
    ``stream_generate`` gives for that prompt alone: greedy token for token,
    sampled in distribution. ``seed`` gives prompt i the seed ``seed + i``.
    Generation stops at the tokenizer's eos ids and ``stop_tokens``; the stop
    token is not part of the text.
    """
    if prompt_caches is not None or return_prompt_caches:
        raise DFlashError("batch_generate keeps no prompt caches: drop prompt_caches/return_prompt_caches")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(prompts):
        raise DFlashError(f"max_tokens has {len(limits)} entries for {len(prompts)} prompts: give one per prompt")
    engine = BatchEngine(
        model,
        block_size=block_size,
        completion_batch_size=completion_batch_size,
        prefill_step_size=prefill_step_size,
        use_metal=use_metal,
        copy_proposals=copy_proposals,
    )
    stops = [*tokenizer.eos_token_ids, *stop_tokens]
    uids = [
        engine.add(
            encode_prompt(tokenizer, prompt).tolist(),
            max_tokens=limit,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            sampler=sampler,
            seed=None if seed is None else seed + i,
            stop_tokens=stops,
            logits_processors=logits_processors,
            logprobs=return_logprobs,
        )
        for i, (prompt, limit) in enumerate(zip(prompts, limits))
    ]
    tokens = {uid: [] for uid in uids}
    logprobs = {uid: [] for uid in uids}
    finished = 0
    while not engine.idle:
        for event in engine.step():
            if event.finish_reason != "stop":
                tokens[event.uid].append(event.token)
                logprobs[event.uid].append(event.logprob)
            if event.finish_reason and verbose:
                finished += 1
                print(f"[batch_generate] Finished processing {finished}/{len(uids)} ...", end="\r")
    stats = engine.stats
    if verbose:
        print(f"[batch_generate] Finished processing {finished}/{len(uids)}")
        print(f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
        print(f"[batch_generate] Generation: {stats.generation_tokens} tokens, "
              f"{stats.generation_tps:.3f} tokens-per-sec, {stats.mean_rows:.2f} rows per step")
        print(f"[batch_generate] Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    return BatchResponse(
        [tokenizer.decode(tokens[uid]) for uid in uids],
        stats,
        token_ids=[tokens[uid] for uid in uids] if return_token_ids else None,
        logprobs=[logprobs[uid] for uid in uids] if return_logprobs else None,
    )
