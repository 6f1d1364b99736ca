"""mlx_lm-shaped generation over the engine: ``stream_generate`` yields one response per token,
``generate`` collects them, ``batch_generate`` decodes many prompts together."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Iterable, Sequence

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache.prompt import PromptCache
from .engine import Engine
from .flags import default_block_size
from .request import LogitsProcessor, TokenEvent, couples
from .errors import DFlashError
from .model import DFlashModel
from .policy import BlockPolicy
from .sampling import Sampler
from .stats import EngineStats, SpeculativeStats, format_stats


@dataclass
class GenerationResponse:
    """One generated token, in the shape of mlx_lm's GenerationResponse.

    ``from_draft`` says whether the token was a proposal (drafted or copied) the target accepted;
    ``logprobs`` are the log-probabilities (V,) the token was committed from (after logits
    processors); ``stats`` holds the acceptance record so far.
    """

    text: str
    token: int
    logprobs: mx.array | None
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    stats: SpeculativeStats
    finish_reason: str | None = None


class Responses:
    """A request's ``TokenEvent``s as the ``GenerationResponse``s mlx_lm's stream_generate yields:
    the text detokenized as it comes (a stop token is not part of it), prompt and generation speed."""

    def __init__(self, tokenizer: TokenizerWrapper, prompt_tokens: int, started: float | None = None):
        self.detokenizer = tokenizer.detokenizer
        self.prompt_tokens = prompt_tokens
        self.started = time.perf_counter() if started is None else started
        self.first: float | None = None  # when the first token came
        self.tokens = 0

    @property
    def generation_tps(self) -> float:
        return self.tokens / max(time.perf_counter() - self.first, 1e-9) if self.first else 0.0

    def __call__(self, event: TokenEvent, stats: SpeculativeStats) -> GenerationResponse:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.tokens += 1
        if event.finish_reason != "stop":  # the stop token is not part of the answer, as in mlx_lm
            self.detokenizer.add_token(event.token)
        if event.finish_reason:
            self.detokenizer.finalize()
        return GenerationResponse(
            self.detokenizer.last_segment, event.token, event.logprobs, event.from_draft, self.prompt_tokens,
            self.prompt_tokens / max(self.first - self.started, 1e-9), self.tokens, self.generation_tps,
            mx.get_peak_memory() / 1e9, event.stats or stats, event.finish_reason,
        )


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | list[int] | mx.array) -> list[int]:
    """Token ids of a prompt given as text (BOS added unless it is already there) or as ids."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    ids = mx.array(prompt, mx.int32).reshape(-1).tolist()
    if not ids:
        raise DFlashError("the prompt is empty: give at least one token of prompt")
    return ids


def _wrapped(tokenizer) -> TokenizerWrapper:
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


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
    block_size: int | str | BlockPolicy | None = None,
    stop_tokens: Iterable[int | Sequence[int]] = (),
    use_metal: bool | None = None,
    prefill_step_size: int | None = None,
    draft_window: tuple[int, int] | str | None = "auto",
    prompt_cache: PromptCache | None = None,
    copy_proposals: bool = True,
    tree_budget: int | str = "auto",
) -> Generator[GenerationResponse, None, None]:
    """Generate text with DFlash, yielding one response per token like mlx_lm.

    Greedy (``temp=0``) output is identical to mlx_lm's greedy decoding of the target; with
    ``temp``/``top_p``/``top_k``/``min_p`` tokens follow the same distribution as mlx_lm's
    ``make_sampler`` with those settings, drawn by coupled sampling (``sampling.Coupled``), so after
    ``mx.random.seed`` the text is the same at every block size, ``"auto"`` included. A custom
    ``sampler`` (any logprobs -> token function) also stays exact, but only proposals equal to its
    sample are accepted, so tau drops. ``logits_processors`` are applied to every verify row with
    that row's own token history. ``stop_tokens``: more stop token ids, or sequences of ids.

    ``block_size="auto"`` picks each step's block (up to the drafter's) from the measured cost and
    the running acceptance (``policy.py``); a ``BlockPolicy`` (``policy.make_policy``) tunes it; None
    (the default) is auto as on the command line (``default_block``).
    ``copy_proposals`` (on by default) lets tokens copied from earlier in the prompt or the output
    stand in for, or merge with, the drafter's proposals (``copying.py``). ``tree_budget``: the
    proposals of a draft tree verified in one target forward (``tree.py``: the drafter's likeliest
    branches and the copies), ``"auto"`` per step for the most expected tokens per second, 0 for
    one chain. ``draft_window=(keep, recent)`` bounds the drafter's context for long prompts;
    ``"auto"`` (the default) takes the drafter's own (``DrafterArgs.context_window``), None none. ``prompt_cache`` (a ``PromptCache``)
    reuses the caches of earlier calls whose tokens the new prompt extends, and keeps this one's.
    """
    tokenizer = _wrapped(tokenizer)
    ids = encode_prompt(tokenizer, prompt)
    engine = Engine(model, block_size=default_block(block_size, model, temp, sampler), max_rows=1,
                    prefill_step_size=prefill_step_size, use_metal=use_metal, prompt_cache=prompt_cache,
                    copy_proposals=copy_proposals, draft_window=draft_window, tree_budget=tree_budget)
    uid = engine.add(ids, max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, sampler=sampler,
                     stop_tokens=[*tokenizer.eos_token_ids, *stop_tokens], logits_processors=logits_processors,
                     logprobs=True)
    stats = engine.pending[0].stats
    responses = Responses(tokenizer, len(ids))
    try:
        while not engine.idle:
            for event in engine.step():
                yield responses(event, stats)
    finally:  # a caller that stops early leaves its caches to the prompt cache as a finished one does
        engine.cancel(uid)


def default_block(block_size: int | str | BlockPolicy | None, model: DFlashModel, temp: float,
                  sampler: Sampler | None) -> int | str | BlockPolicy:
    """``block_size`` as given, else the command line's default (``flags.default_block_size``): auto,
    unless the draws of a sampled run follow the block sizes (rejection sampling, an opaque
    ``sampler``): those keep a fixed block, so that ``mx.random.seed`` still reproduces the text
    (whether the caller seeded MLX cannot be seen, so every sampled call counts as seeded)."""
    if block_size is None and sampler is not None:
        return model.block_size
    return default_block_size(block_size, temp, seeded=True, drafter_block_size=model.block_size,
                              coupled=couples(model))


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


@dataclass
class BatchResponse:
    """mlx_lm's ``BatchResponse``: one text per prompt, in prompt order.

    ``stats`` is the engine's record (rows per step, ragged steps, tokens and seconds); ``caches``
    is always None (pass a ``PromptCache`` as ``prompt_cache`` to keep caches across calls).
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
    prefill_step_size: int | None = None,
    use_metal: bool | None = None,
    copy_proposals: bool = True,
    draft_window: tuple[int, int] | str | None = "auto",
    prompt_cache: PromptCache | None = None,
    tree_budget: int | str = "auto",
) -> BatchResponse:
    """Generate a response for every prompt, decoding them together with DFlash.

    Arguments mirror ``mlx_lm.batch_generate`` (the sampling ones are ``stream_generate``'s, applied
    to every prompt); each output is what ``stream_generate`` gives for that prompt alone: greedy
    token for token, sampled in distribution. ``seed`` gives prompt i the seed ``seed + i``.
    Generation stops at the tokenizer's eos ids and ``stop_tokens``; the stop token is not part of
    the text. ``prefill_step_size``: prompt tokens per forward and per step while other rows decode
    (None: ``Engine``'s choice, measured).
    """
    if prompt_caches is not None or return_prompt_caches:
        raise DFlashError("batch_generate takes no per-prompt caches: drop prompt_caches/return_prompt_caches "
                          "and pass a PromptCache as prompt_cache to reuse prefixes across calls")
    tokenizer = _wrapped(tokenizer)
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(prompts):
        raise DFlashError(f"max_tokens has {len(limits)} entries for {len(prompts)} prompts: give one per prompt")
    engine = Engine(model, block_size=default_block(block_size, model, temp, sampler), max_rows=completion_batch_size,
                    prefill_step_size=prefill_step_size, use_metal=use_metal, copy_proposals=copy_proposals,
                    draft_window=draft_window, prompt_cache=prompt_cache, tree_budget=tree_budget)
    stops = [*tokenizer.eos_token_ids, *stop_tokens]
    uids = [
        engine.add(encode_prompt(tokenizer, prompt), max_tokens=limit, temp=temp, top_p=top_p, top_k=top_k,
                   min_p=min_p, sampler=sampler, seed=None if seed is None else seed + i, stop_tokens=stops,
                   logits_processors=logits_processors, logprobs=return_logprobs)
        for i, (prompt, limit) in enumerate(zip(prompts, limits))
    ]
    tokens = {uid: [] for uid in uids}
    logprobs = {uid: [] for uid in uids}
    finished = 0
    while not engine.idle:
        for event in engine.step():
            if event.finish_reason != "stop":
                tokens[event.uid].append(event.token)
                if return_logprobs:
                    logprobs[event.uid].append(event.logprobs[event.token].item())
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
