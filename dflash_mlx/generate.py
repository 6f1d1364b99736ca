"""mlx_lm-shaped API: ``load``, ``stream_generate``, ``generate``."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Generator, Iterable

import mlx.core as mx
import mlx_lm
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import kernels
from .adaptive import AdaptiveBlockSize, CostCurve, make_policy
from .decode import DecodeCache, LogitsProcessor, speculative_decode
from .checkpoint import read_config, resolve
from .drafter import Drafter, load_drafter
from .errors import DFlashError
from .sampling import Sampler, SamplingParams, make_strategy
from .target import Target

MAX_BLOCK_SIZE = 32


@dataclass
class DFlashModel:
    """A target and the drafter that speculates for it."""

    target: Target
    drafter: Drafter
    cost_curve: CostCurve | None = None  # measured on first adaptive use (see adaptive.py)

    @property
    def block_size(self) -> int:
        return self.drafter.args.block_size


def check_pair(target: Target, drafter: Drafter) -> None:
    a = drafter.args
    if a.hidden_size != target.hidden_size:
        raise DFlashError(
            f"drafter hidden size {a.hidden_size} does not match the target's {target.hidden_size}: "
            "use the drafter trained for this target"
        )
    if a.vocab_size != target.vocab_size:
        raise DFlashError(
            f"drafter vocab size {a.vocab_size} does not match the target's {target.vocab_size}: "
            "use the drafter trained for this target"
        )
    if not 0 <= a.mask_token_id < target.vocab_size:
        raise DFlashError(
            f"drafter mask_token_id {a.mask_token_id} is outside the target vocabulary "
            f"(size {target.vocab_size}): fix dflash_config.mask_token_id in the drafter config"
        )


def load_target(path_or_repo: str) -> tuple[mx.array, TokenizerWrapper]:
    path = resolve(str(path_or_repo), "model")
    config = read_config(path)
    try:
        return mlx_lm.load(str(path))
    except ValueError as e:
        if "not supported" in str(e):
            raise DFlashError(
                f"unsupported target architecture {config.get('model_type')!r}: "
                "mlx_lm cannot load it; upgrade mlx-lm or pick another model"
            ) from None
        raise DFlashError(f"could not load the target from {path}: {e}") from None
    except FileNotFoundError as e:
        raise DFlashError(f"could not load the target from {path}: {e}") from None


def load(model: str, draft: str) -> tuple[DFlashModel, TokenizerWrapper]:
    """Load a target (folder or Hub id, anything mlx_lm loads) and its DFlash drafter."""
    target_model, tokenizer = load_target(model)
    drafter = load_drafter(draft)
    target = Target(target_model, drafter.args.target_layer_ids)
    check_pair(target, drafter)
    return DFlashModel(target, drafter), tokenizer


@dataclass
class SpeculativeStats:
    """Acceptance record of one generation. tau counts the target's own token."""

    block_size: int  # the largest block used (the adaptive policy's upper bound)
    kernels: str
    kernel_fallbacks: set[str] = field(default_factory=set)  # ops a Metal kernel refused (ran the twin)
    acceptance_lengths: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)  # verified rows per step; 1 = plain decoding
    adaptive: bool = False

    @property
    def speculative(self) -> bool:
        """Whether any step drafted; an adaptive run that fell back to plain decoding did not."""
        if self.block_sizes:
            return any(b > 1 for b in self.block_sizes)
        return self.block_size > 1

    @property
    def plain_fraction(self) -> float:
        """Share of steps decoded without a draft (the adaptive fallback)."""
        b = self.block_sizes
        return sum(1 for x in b if x == 1) / len(b) if b else 0.0

    @property
    def tau(self) -> float:
        n = self.acceptance_lengths
        return sum(n) / len(n) if n else 0.0

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))


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


def _encode(tokenizer: TokenizerWrapper, prompt: str | list[int] | mx.array) -> mx.array:
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
) -> Generator[GenerationResponse, None, None]:
    """Generate text with DFlash, yielding one response per token like mlx_lm.

    Greedy (``temp=0``) output is identical to mlx_lm's greedy decoding of the
    target; with ``temp``/``top_p``/``top_k``/``min_p`` tokens follow the same
    distribution as mlx_lm's ``make_sampler`` with those settings. A custom
    ``sampler`` (any logprobs -> token function) also stays exact, but only
    proposals equal to its sample are accepted, so tau drops. ``logits_processors``
    are applied to every verify row with that row's own token history.

    ``block_size="auto"`` picks each step's block (up to the drafter's) from the
    measured cost curve and the running acceptance (``adaptive.py``); pass an
    ``AdaptiveBlockSize`` (``adaptive.make_policy``) to tune the policy.
    ``draft_window=(keep, recent)`` bounds the drafter's context for long
    prompts. ``prompt_cache`` (a ``DecodeCache``) reuses the caches of an
    earlier call whose tokens the new prompt extends; it is updated in place.
    """
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be at least 1, got {max_tokens}")
    policy = block_size if isinstance(block_size, AdaptiveBlockSize) else None
    if block_size == "auto":
        policy = make_policy(model, use_metal=use_metal)
    block_size = policy.max_block_size if policy else model.block_size if block_size is None else block_size
    if not isinstance(block_size, int):
        raise DFlashError(f"block size {block_size!r} is not an integer or 'auto'")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise DFlashError(f"block size {block_size} is out of range: use 1..{MAX_BLOCK_SIZE}")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode(tokenizer, prompt)
    params = SamplingParams(temp, top_p, top_k, min_p)
    ops = kernels.get_ops(use_metal)
    strategy = make_strategy(params, sampler, ops)
    stops = set(tokenizer.eos_token_ids) | set(stop_tokens)
    stats = SpeculativeStats(block_size, ops.path, adaptive=policy is not None, kernel_fallbacks=ops.fallbacks)
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
    )

    def tokens():
        for i, step in enumerate(steps):
            if i:  # step 0 is the prefill's token, not a draft-verify step
                stats.acceptance_lengths.append(len(step.tokens))
                stats.block_sizes.append(step.block_size)
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


def format_stats(r: GenerationResponse) -> str:
    s = r.stats
    if s.adaptive:
        used = " ".join(f"{k}:{v}" for k, v in sorted(Counter(s.block_sizes).items()))
        mode = f"adaptive block size up to {s.block_size}, used (size:steps) {used}"
        if not s.speculative:
            mode += "; speculation off: plain decoding was faster"
    elif s.speculative:
        mode = f"speculative, block size {s.block_size}"
    else:
        mode = "speculation off (block size 1): plain target decoding"
    hist = " ".join(f"{k}:{v}" for k, v in s.histogram().items())
    return "\n".join(
        [
            f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec",
            f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec",
            f"Acceptance: tau {s.tau:.2f} tokens/step over {len(s.acceptance_lengths)} steps ({mode}; kernels: {s.kernels})",
            *(f"Kernel fallback to the MLX twin: {reason}" for reason in sorted(s.kernel_fallbacks)),
            f"Acceptance histogram (tokens/step:count): {hist}",
            f"Peak memory: {r.peak_memory:.3f} GB",
        ]
    )
