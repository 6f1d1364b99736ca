"""mlx_lm-shaped generation: ``stream_generate`` yields one response per token, ``generate`` collects them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Iterable

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import kernels
from .adaptive import AdaptiveBlockSize, make_policy
from .copying import corpus_tokens
from .decode import DecodeCache, LogitsProcessor, speculative_decode
from .models import Drafter
from .errors import DFlashError
from .model import MAX_BLOCK_SIZE, DFlashModel
from .sampling import Sampler, SamplingParams, make_strategy, random_seed
from .stats import SpeculativeStats, format_stats

@dataclass
class GenerationResponse:
    """One generated token, in the shape of mlx_lm's GenerationResponse.

    ``from_draft`` says whether the token was a drafter proposal the target
    accepted; ``stats`` holds the acceptance record so far. There is no
    ``logprobs`` field.
    """

    text: str
    token: int
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    stats: SpeculativeStats
    finish_reason: str | None = None


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | list[int] | mx.array) -> mx.array:
    """Token ids of a prompt given as text (BOS added unless it is already there) or as ids."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    prompt = mx.array(prompt, mx.int32).reshape(-1)
    if prompt.size == 0:
        raise DFlashError("the prompt is empty: give at least one token of prompt")
    return prompt


def stream_generate(
    model: DFlashModel,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    max_tokens: int = 256,
    *,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    sampler: Sampler | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    block_size: int | str | AdaptiveBlockSize | None = None,
    stop_tokens: Iterable[int] = (),
    use_metal: bool | None = None,
    prefill_step_size: int = 2048,
    draft_window: tuple[int, int] | None = None,
    prompt_cache: DecodeCache | None = None,
    copy_proposals: bool = True,
) -> Generator[GenerationResponse, None, None]:
    """Generate text with DFlash, yielding one response per token like mlx_lm.

    Greedy (``temp=0``) output is identical to mlx_lm's greedy decoding of the
    target; with ``temp``/``top_p``/``top_k``/``min_p`` tokens follow the same
    distribution as mlx_lm's ``make_sampler`` with those settings, drawn by coupled
    sampling (``sampling.Coupled``), so after ``mx.random.seed`` the text is the same
    at every block size, ``"auto"`` included. A custom
    ``sampler`` (any logprobs -> token function) also stays exact, but only
    proposals equal to its sample are accepted, so tau drops. ``logits_processors``
    are applied to every verify row with that row's own token history.

    ``block_size="auto"`` picks each step's block (up to the drafter's) from the
    measured cost curve and the running acceptance (``adaptive.py``); pass an
    ``AdaptiveBlockSize`` (``adaptive.make_policy``) to tune the policy.
    ``copy_proposals`` (on by default) lets tokens copied from earlier in the
    prompt or the output stand in for, or merge with, the drafter's proposals
    where they are expected to be accepted further (``copying.py``); the stats
    count the accepted tokens of each source. ``draft_window=(keep, recent)``
    bounds the drafter's context for long prompts. ``prompt_cache`` (a
    ``DecodeCache``) reuses the caches of an earlier call whose tokens the new
    prompt extends; it is updated in place.
    """
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be at least 1, got {max_tokens}")
    policy = block_size if isinstance(block_size, AdaptiveBlockSize) else None
    if block_size == "auto":
        policy = make_policy(model, use_metal=use_metal)
    block_size = max(policy.max_block_size, policy.copy_block_size) if policy else model.block_size if block_size is None else block_size
    if not isinstance(block_size, int):
        raise DFlashError(f"block size {block_size!r} is not an integer or 'auto'")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise DFlashError(f"block size {block_size} is out of range: use 1..{MAX_BLOCK_SIZE}")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = encode_prompt(tokenizer, prompt)
    params = SamplingParams(temp, top_p, top_k, min_p)
    ops = kernels.get_ops(use_metal)
    strategy = make_strategy(params, sampler, ops, coupling(model, params, sampler))
    stops = set(tokenizer.eos_token_ids) | set(stop_tokens)
    start_record = getattr(model.target, "start_record", None)  # a sharded target (distributed.Driver)
    stats = SpeculativeStats(block_size, ops.path, adaptive=policy is not None, kernel_fallbacks=ops.fallbacks,
                             copy_proposals=copy_proposals, corpus_tokens=corpus_tokens(model.drafter),
                             sharding=start_record() if start_record else None, sampling=strategy.name)
    if prompt_cache is None:
        prompt_cache = DecodeCache.new(model.target, model.drafter, draft_window)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()

    steps = speculative_decode(
        prompt,
        model.target,
        model.drafter,
        strategy,
        block_size=policy or block_size,
        max_tokens=max_tokens,
        logits_processors=logits_processors,
        prefill_step_size=prefill_step_size,
        prompt_cache=prompt_cache,
        copy_proposals=copy_proposals,
    )

    def tokens():
        for i, step in enumerate(steps):
            if i:  # step 0 is the prefill's token, not a draft-verify step
                stats.record(step)
            for j, token in enumerate(step.tokens):
                yield token, j < step.accepted

    tic = time.perf_counter()
    prompt_tps = 0.0
    token, from_draft, n = None, False, 0

    def response(finish_reason: str | None) -> GenerationResponse:
        return GenerationResponse(
            detokenizer.last_segment,
            token,
            from_draft,
            prompt.size,
            prompt_tps,
            n + 1,
            (n + 1) / (time.perf_counter() - tic),
            mx.get_peak_memory() / 1e9,
            stats,
            finish_reason,
        )

    for n, (token, from_draft) in enumerate(tokens()):
        if n == 0:
            prompt_tps = prompt.size / (time.perf_counter() - tic)
            tic = time.perf_counter()
        if token in stops:
            break
        detokenizer.add_token(token)
        if n + 1 == max_tokens:
            break
        yield response(None)
    detokenizer.finalize()
    yield response("stop" if token in stops else "length")


def couples(model: DFlashModel) -> bool:
    """Whether the pair samples with ``Coupled``: not with a DFlash2 drafter, whose selector picks
    among candidates the noise does not index (it keeps rejection sampling)."""
    return model.drafter.architecture == Drafter.architecture


def coupling(model: DFlashModel, params: SamplingParams, sampler: Sampler | None = None) -> tuple[int, int] | None:
    """``make_strategy``'s ``coupled``: (seed, vocabulary size) when ``params`` sample with
    ``Coupled``, the seed drawn from MLX's global random state (so ``mx.random.seed`` fixes the
    output, at any block size); None for greedy decoding, a custom sampler or a pair that does not
    couple (no random state is drawn then)."""
    if params.temp == 0 or sampler is not None or not couples(model):
        return None
    return random_seed(), model.target.vocab_size


def generate(
    model: DFlashModel,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a complete response; with ``verbose`` stream it and print stats."""
    if verbose:
        print("=" * 10)
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        text += response.text
        if verbose:
            print(response.text, end="", flush=True)
    if verbose:
        print()
        print("=" * 10)
        print(format_stats(response))
    return text
