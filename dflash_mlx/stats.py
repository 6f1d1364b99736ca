"""What a generation reports about its speculation: acceptance, block sizes, kernels, batching."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ShardingStats:
    """How a sharded target ran (``distributed.py``) and its communication per verify step."""

    mode: str  # "tensor parallel" or "pipeline parallel"
    ranks: int
    collectives: int  # the model's own collectives per forward, counted in its graph
    steps: int = 0
    control_seconds: float = 0.0  # sending rank 0's orders to the other ranks
    gather_seconds: float = 0.0  # pipeline: bringing the taps other ranks hold to rank 0
    collective_seconds: float = 0.0  # the model's collectives: count x latency calibrated at load

    @property
    def seconds_per_step(self) -> float:
        return (self.control_seconds + self.gather_seconds + self.collective_seconds) / max(self.steps, 1)

    def describe(self) -> str:
        ms = lambda s: 1e3 * s / max(self.steps, 1)  # noqa: E731
        return (
            f"{self.mode} over {self.ranks} ranks; communication {1e3 * self.seconds_per_step:.2f} ms/step "
            f"(orders {ms(self.control_seconds):.2f}, tap gather {ms(self.gather_seconds):.2f}, "
            f"~{ms(self.collective_seconds):.2f} in the model's {self.collectives} collectives per forward, "
            "latency calibrated at load)"
        )


@dataclass
class Step:
    """What one row committed in one draft-verify step."""

    tokens: list[int]  # committed: accepted proposals, then the target's token
    accepted: int  # how many of them were proposals (drafted or copied)
    block_size: int = 0  # tokens verified (1: plain decoding, no proposals)
    copied: int = 0  # how many of the accepted proposals were copied from earlier text
    copies: int = 0  # how many of the block's proposals were copied
    from_corpus: bool = False  # whether the copy came from the drafter's corpus, not from this text
    tree: bool = False  # whether the proposals were a draft tree (``block_size``: its nodes, root included)
    off_chain: bool = False  # whether the accepted path left the drafter's top choices


@dataclass
class SpeculativeStats:
    """Acceptance record of one generation. tau counts the target's own token."""

    block_size: int  # the largest block used (the adaptive policy's upper bound)
    kernels: str
    kernel_fallbacks: set[str] = field(default_factory=set)  # ops a Metal kernel refused (ran the twin)
    acceptance_lengths: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)  # verified rows per step; 1 = plain decoding
    adaptive: bool = False
    sharding: ShardingStats | None = None  # set when the target is sharded over several ranks
    copy_proposals: bool = True  # whether copies from earlier text could be proposed
    copied: int = 0  # accepted proposals that were copied
    corpus_copied: int = 0  # of those, the ones copied from the drafter's corpus
    corpus_tokens: int = 0  # the size of the drafter's corpus (0: it has none)
    drafted: int = 0  # accepted proposals the drafter made
    copy_steps: int = 0  # steps whose block held copied tokens
    sampling: str = "greedy"  # the verify rule (sampling.py): greedy, coupled, rejection or match
    trees: str | None = None  # why steps verified chains only, or None when they may verify trees
    draft_window: tuple[int, int] | None = None  # (sink, recent) context rows the drafter sees; None: all
    tree_steps: int = 0  # steps that verified a draft tree
    tree_nodes: int = 0  # their nodes, roots included
    off_chain: int = 0  # tree steps whose accepted path left the drafter's top choices
    step_costs: str | None = None  # where the adaptive policy's step costs came from (costs.Costs.source)
    prefill: str | None = None  # tokens per prefill forward and why (costs.PrefillChunks.describe)
    run_ahead: str | None = None  # whether plain steps started their successors early, and why

    def record(self, step: Step) -> None:
        """One draft-verify step."""
        self.acceptance_lengths.append(len(step.tokens))
        self.block_sizes.append(step.block_size)
        self.copied += step.copied
        self.corpus_copied += step.copied if step.from_corpus else 0
        self.drafted += step.accepted - step.copied
        self.copy_steps += step.copies > 0
        if step.tree:
            self.tree_steps += 1
            self.tree_nodes += step.block_size
            self.off_chain += step.off_chain

    def describe_trees(self) -> str:
        if not self.tree_steps:
            return f"none ({self.trees})" if self.trees else "none (no step drafted)"
        return (f"{self.tree_steps} steps, {self.tree_nodes / self.tree_steps:.1f} nodes per tree, the accepted path "
                f"off the drafter's top choices in {self.off_chain}")

    def describe_corpus(self) -> str:
        if not self.corpus_tokens:
            return "the drafter has no corpus"
        return f"{self.corpus_copied} from the drafter's corpus of {self.corpus_tokens:,} tokens"

    @property
    def speculative(self) -> bool:
        """Whether any step drafted; an adaptive run that fell back to plain decoding did not."""
        if self.block_sizes:
            return any(b > 1 for b in self.block_sizes)
        return self.block_size > 1

    @property
    def tau(self) -> float:
        n = self.acceptance_lengths
        return sum(n) / len(n) if n else 0.0

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))

    def describe(self) -> str:
        """The speculation mode in words, for the stats block."""
        if self.adaptive:
            used = " ".join(f"{k}:{v}" for k, v in sorted(Counter(self.block_sizes).items()))
            mode = f"adaptive block size up to {self.block_size}, used (size:steps) {used}"
            if not self.speculative:
                mode += "; speculation off: plain decoding was faster"
            return mode
        if self.speculative:
            return f"speculative, block size {self.block_size}"
        return "speculation off (block size 1): plain target decoding"


def format_stats(response) -> str:
    """mlx_lm's verbose stats block plus acceptance, for a final ``GenerationResponse``."""
    s = response.stats
    hist = " ".join(f"{k}:{v}" for k, v in s.histogram().items())
    return "\n".join(
        [
            f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec",
            f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec",
            f"Acceptance: tau {s.tau:.2f} tokens/step over {len(s.acceptance_lengths)} steps "
            f"({s.describe()}; kernels: {s.kernels}" + (f"; run ahead: {s.run_ahead}" if s.run_ahead else "") + ")",
            *(f"Kernel fallback to the MLX twin: {reason}" for reason in sorted(s.kernel_fallbacks)),
            f"Accepted proposals: {s.drafted} drafted, {s.copied} copied"
            + (f" ({s.copy_steps} steps held copies; {s.describe_corpus()})" if s.copy_proposals
               else " (copy proposals off)"),
            f"Acceptance histogram (tokens/step:count): {hist}",
            *([f"Verify rule: {s.sampling}"] if s.sampling != "greedy" else []),
            f"Draft trees: {s.describe_trees()}",
            "Drafter context: " + ("the whole context" if s.draft_window is None else
                                   f"the first {s.draft_window[0]} and the last {s.draft_window[1]} rows"),
            *([f"Sharded: {s.sharding.describe()}"] if s.sharding else []),
            *([f"Step costs: {s.step_costs}"] if s.step_costs else []),
            *([f"Prefill chunks: {s.prefill}"] if s.prefill else []),
            f"Peak memory: {response.peak_memory:.3f} GB",
        ]
    )


@dataclass
class EngineStats:
    """What the engine did, for a server's /metrics and the benchmark."""

    batched: bool  # False: requests are served one at a time, see ``reason``
    reason: str | None = None
    sharding: ShardingStats | None = None  # set when the target is sharded over several ranks
    prefill: str | None = None  # tokens per prefill forward and why (costs.PrefillChunks.describe)
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    decode_time: float = 0.0
    steps: int = 0
    rows: Counter = field(default_factory=Counter)  # rows per step -> steps
    block_sizes: Counter = field(default_factory=Counter)  # block size -> steps
    ragged_steps: int = 0  # steps whose rows accepted different numbers of proposals
    tree_steps: int = 0  # steps that verified draft trees
    draft_seconds: list[float] = field(default_factory=list)  # per step, when the engine profiles
    verify_seconds: list[float] = field(default_factory=list)

    def record_step(self, rows: int, block_size: int, ragged: bool, seconds: float,
                    profile: tuple[float, float] | None = None, tree: bool = False) -> None:
        """One step of ``rows`` rows and ``block_size`` tokens (or tree nodes) each; ``profile``: its
        draft and verify seconds."""
        self.steps += 1
        self.tree_steps += tree
        self.rows[rows] += 1
        self.block_sizes[block_size] += 1
        self.ragged_steps += ragged
        self.decode_time += seconds
        if profile is not None:
            self.draft_seconds.append(profile[0])
            self.verify_seconds.append(profile[1])

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.decode_time if self.decode_time else 0.0

    @property
    def mean_rows(self) -> float:
        return sum(r * n for r, n in self.rows.items()) / self.steps if self.steps else 0.0
