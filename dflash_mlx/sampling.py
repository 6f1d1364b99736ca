"""How proposals are drawn and verified, for each way of picking tokens.

Four strategies, all lossless:
- ``Greedy``: argmax proposals, accept while they equal the target's argmax.
- ``Coupled``: temperature / top-p / top-k / min-p by Gumbel-max with noise fixed
  per position: the target's token at position t is argmax(log p_t + g_t), with
  g_t drawn from (seed, t) alone, and a proposal is accepted iff it equals it.
  The drafter proposes argmax(log q_t + g_t) with the same noise, so it agrees
  with the target about as often as rejection sampling would have it accepted
  (0.35 vs 0.37 of first proposals on GSM8K, 0.21 vs 0.22 on MT-Bench, built-in
  pair at temperature 0.7). What is committed is fixed by the seed and the
  target alone, whatever was proposed: copies may be merged into sampled blocks,
  any block size may be chosen, and a seeded generation is the same at every one.
- ``Rejection``: the same settings with known distributions p and q; proposals
  sampled from q, accepted with probability min(1, p/q) (DFlash2 drafters, whose
  selector picks among candidates the noise does not index).
- ``Match``: any opaque mlx_lm ``sampler``; the target row is sampled with it and
  an argmax proposal is accepted only if it equals that sample (exact for any
  sampler, but accepts less than ``Rejection``).

``at(position)`` binds a strategy to a block whose first verified row predicts
absolute position ``position`` (only ``Coupled`` uses it).

Every method takes an optional PRNG ``key`` (a request with a seed has its own
stream); without one, MLX's global random state is used. An opaque sampler
always draws from the global state; ``Coupled`` draws from its seed alone.

``propose`` picks from any rows of scores: a DFlash drafter's logits, or one
position's candidate scores at a time for the DFlash2 selector, which places the
returned distribution back in the vocabulary (Drafter.propose).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import DFlashError
from .kernels import KernelOps

Sampler = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        if self.temp < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise DFlashError(
                f"bad sampling settings (temp {self.temp}, top_p {self.top_p}, top_k {self.top_k}, "
                f"min_p {self.min_p}): need temp >= 0, 0 < top_p <= 1, top_k >= 0, 0 <= min_p <= 1"
            )


# Verify rows look for top-p's nucleus among their largest entries first: mlx_lm sorts the whole
# vocabulary, where a topk and a sort of the candidates cost a small part of that.
NUCLEUS_CANDIDATES = 1024


def nucleus(logprobs: mx.array, top_p: float) -> mx.array:
    """mlx_lm's ``apply_top_p`` (keep each row's smallest top set whose mass reaches ``top_p``),
    found among each row's ``NUCLEUS_CANDIDATES`` largest entries when they hold it. One host
    read checks that they do in every row (else the rows are sorted whole, as mlx_lm does), so
    it waits for ``logprobs``: for rows about to be read anyway, not for queued draft picks."""
    if logprobs.shape[-1] <= NUCLEUS_CANDIDATES:
        return apply_top_p(logprobs, top_p)
    top = mx.sort(mx.topk(logprobs, NUCLEUS_CANDIDATES, axis=-1), axis=-1)  # ascending
    probs = mx.exp(top)
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    mass = top_p * mx.exp(logprobs).sum(axis=-1, keepdims=True)
    if not mx.all(mass_above[..., :1] + probs[..., :1] >= mass).item():
        return apply_top_p(logprobs, top_p)
    # Below the candidates every entry has at least their whole mass above it: all dropped.
    threshold = mx.take_along_axis(top, (mass_above >= mass).sum(axis=-1, keepdims=True), axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def filtered_logprobs(logits: mx.array, params: SamplingParams, read: bool = False) -> mx.array:
    """Row-wise log-probabilities at temperature 1 after mlx_lm's top-p, min-p and top-k
    filters (-inf where cut), up to a constant per row when no filter applies. ``read``: the
    rows are about to be read, so top-p may take ``nucleus``'s host read."""
    logprobs = logits.astype(mx.float32)
    if params.top_p == 1 and params.min_p == 0 and not 0 < params.top_k < logits.shape[-1]:
        return logprobs  # the normaliser cancels in softmax and argmax alike
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if params.top_p < 1:
        logprobs = nucleus(logprobs, params.top_p) if read else apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logits.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Row-wise sampling distribution, the same one mlx_lm's make_sampler draws from."""
    return mx.softmax(filtered_logprobs(logits, params) / params.temp, axis=-1)


def random_seed() -> int:
    """64 bits from MLX's global random state (``mx.random.seed`` fixes them)."""
    high, low = mx.random.randint(0, 2**32, (2,), dtype=mx.uint32).tolist()
    return high << 32 | low


def position_key(seed: int, position: int) -> mx.array:
    """The PRNG key of one absolute position of a generation: splitmix64 of seed and position."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return mx.random.key(z ^ (z >> 31))


class Greedy:
    name = "greedy"
    deterministic = True  # proposals are a function of the drafter's logits: copies may be merged in

    def __init__(self, ops: KernelOps):
        self.ops = ops

    def at(self, position: int) -> "Greedy":
        return self

    def first(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def propose(self, draft_logits: mx.array, key: mx.array | None = None, columns=None) -> tuple[mx.array, None]:
        return mx.argmax(draft_logits, axis=-1).astype(mx.int32), None

    def verify(self, logits: mx.array, proposals: mx.array, _q, key: mx.array | None = None) -> tuple[mx.array, mx.array]:
        return self.ops.greedy_accept(logits, proposals)

    def pick_nodes(self, logits: mx.array, depths: mx.array) -> mx.array:
        """The target's token at each node of a draft tree (logits (N, V)): its argmax."""
        return mx.argmax(logits, axis=-1).astype(mx.int32)


class Coupled:
    """Gumbel-max sampling with one noise vector per absolute position (see the module notes).

    Exact: g_t depends on (seed, t) alone, so given the committed prefix the target's token
    argmax(log p_t + g_t) is a fresh draw from p_t, whatever the proposals were; a rejected
    block's later rows looked at g_t under a prefix that was not committed, and nothing
    committed depended on them. ``seed``: 64-bit; ``vocab_size``: the target's (the noise of
    a position covers the whole vocabulary, so the drafter's picks over its draft vocabulary
    see the same noise at each id as the target's row).
    """

    name = "coupled"
    deterministic = True  # the committed tokens do not depend on the proposals: any source may be merged in

    def __init__(self, params: SamplingParams, ops: KernelOps, seed: int, vocab_size: int, position: int = 0):
        self.params, self.ops, self.seed, self.vocab_size, self.position = params, ops, seed, vocab_size, position
        self._noise: list[mx.array] = []  # rows of the block bound by ``at``, built as needed

    def at(self, position: int) -> "Coupled":
        return Coupled(self.params, self.ops, self.seed, self.vocab_size, position)

    def noise(self, rows: int) -> mx.array:
        """Gumbel noise (rows, V) of positions ``position .. position + rows - 1``."""
        while len(self._noise) < rows:
            key = position_key(self.seed, self.position + len(self._noise))
            self._noise.append(mx.random.gumbel((self.vocab_size,), key=key))
        return mx.stack(self._noise[:rows])

    def scores(self, logits: mx.array, columns: mx.array | None = None, read: bool = False,
               noise: mx.array | None = None) -> mx.array:
        """The perturbed scores whose argmax is the pick: rows (..., L, V') of positions
        ``position ..`` over vocabulary ids ``columns``. Over a drafter's block they rank a draft
        tree's candidates (``tree.build``), rank 0 being the chain's proposal."""
        if noise is None:
            noise = self.noise(logits.shape[-2]) if logits.ndim > 1 else self.noise(1)[0]
        if columns is not None:
            noise = mx.take(noise, columns, axis=-1)
        return filtered_logprobs(logits, self.params, read) / self.params.temp + noise

    def _pick(self, logits: mx.array, columns: mx.array | None = None, read: bool = False,
              noise: mx.array | None = None) -> mx.array:
        return mx.argmax(self.scores(logits, columns, read, noise), axis=-1).astype(mx.int32)

    def first(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        return self._pick(logits, read=True)

    def propose(self, draft_logits: mx.array, key: mx.array | None = None,
                columns: mx.array | None = None) -> tuple[mx.array, None]:
        """Picks for the rows of one block (draft_logits (..., L, V') over vocabulary ids ``columns``)."""
        return self._pick(draft_logits, columns), None

    def verify(self, logits: mx.array, proposals: mx.array, _q, key: mx.array | None = None) -> tuple[mx.array, mx.array]:
        return self.ops.match_accept(self._pick(logits, read=True), proposals)

    def pick_nodes(self, logits: mx.array, depths: mx.array) -> mx.array:
        """The target's token at each node of a draft tree (logits (N, V)), a node at depth d
        predicting position ``position + d``: siblings share a position and so its noise, one
        vector per depth drawn once and gathered per node."""
        noise = mx.take(self.noise(int(depths.max().item()) + 1), depths, axis=0)
        return self._pick(logits, read=True, noise=noise)


class Rejection:
    name = "rejection"
    deterministic = False  # proposals are sampled: a choice between sources must not look at them

    def __init__(self, params: SamplingParams, ops: KernelOps):
        self.params, self.ops = params, ops

    def at(self, position: int) -> "Rejection":
        return self

    def first(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        return mx.random.categorical(mx.log(probabilities(logits, self.params)), key=key).astype(mx.int32)

    def propose(self, draft_logits: mx.array, key: mx.array | None = None, columns=None) -> tuple[mx.array, mx.array]:
        q = probabilities(draft_logits, self.params)
        return mx.random.categorical(mx.log(q), key=key).astype(mx.int32), q

    def verify(self, logits: mx.array, proposals: mx.array, q: mx.array | None, key: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """``q``: the distributions the proposals were drawn from; None for copied proposals,
        drawn from point masses (all probability on the copied token)."""
        p = probabilities(logits, self.params)
        if q is None:
            q = (mx.arange(p.shape[-1])[None] == proposals[:, None]).astype(p.dtype)
        uniforms = mx.random.uniform(shape=(logits.shape[0],), key=key)
        return self.ops.rejection_accept(p, q, proposals, uniforms)


class Match:
    name = "match"
    deterministic = True

    def __init__(self, sampler: Sampler, ops: KernelOps):
        self.sampler, self.ops = sampler, ops

    def at(self, position: int) -> "Match":
        return self

    def _sample(self, logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.sampler(logprobs).astype(mx.int32)

    def first(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        return self._sample(logits)

    def propose(self, draft_logits: mx.array, key: mx.array | None = None, columns=None) -> tuple[mx.array, None]:
        return mx.argmax(draft_logits, axis=-1).astype(mx.int32), None

    def verify(self, logits: mx.array, proposals: mx.array, _q, key: mx.array | None = None) -> tuple[mx.array, mx.array]:
        return self.ops.match_accept(self._sample(logits), proposals)


Strategy = Greedy | Coupled | Rejection | Match


def make_strategy(params: SamplingParams, sampler: Sampler | None, ops: KernelOps,
                  coupled: tuple[int, int] | None = None) -> Strategy:
    """``coupled=(seed, vocab_size)``: sample with ``Coupled`` instead of ``Rejection``."""
    if sampler is not None:
        return Match(sampler, ops)
    if params.temp == 0:
        return Greedy(ops)
    return Coupled(params, ops, *coupled) if coupled else Rejection(params, ops)
