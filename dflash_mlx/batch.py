"""The batch engine: concurrent requests drafted and verified together.

Each step, one drafter forward drafts every active row's block and one target
forward verifies all the blocks; each row then commits its own accepted prefix
plus its own next token (no clamping to the batch's shortest), and the caches
drop each row's own rejected tail (``RaggedKVCache``, ``Target.rollback_rows``).

Requests join and leave between steps. Joining prompts are prefilled together (``batch_prefill``,
``prefill_step_size`` tokens per forward; the drafter absorbs each chunk's hidden states as it
goes), and each one's one-row caches join the batch when it is done. While rows decode, a step
prefills one chunk, so they wait for at most that; an idle engine prefills all that fits first.

When a plain step (block 1) is expected next and nobody waits to join, a plain step starts the
next one's forward before the host reads its tokens, as mlx_lm's batch generator does; a request
that arrives then starts its prefill one step later.

A server worker drives it as a scheduler loop::

    engine = BatchEngine(model, completion_batch_size=8)
    while True:
        for request in arrived():            # between steps, any number
            uids[request] = engine.add(request.tokens, max_tokens=..., temp=..., seed=...)
        for request in disconnected():
            engine.cancel(uids[request])     # frees the row at once
        for event in engine.step():          # one TokenEvent per committed token
            send(event.uid, event.token)     # event.finish_reason ends the request
        if engine.idle:
            wait_for_requests()
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from functools import partial
from typing import Iterable, Sequence

import mlx.core as mx
from mlx_lm.generate import StopSequences

from . import kernels
from .batch_adaptive import BatchBlockSize, make_batch_policy
from .cache.prompt import PromptCache
from .batch_copies import RowCopies, propose_rows
from .batch_prefill import PREFILL_STEP_SIZE, prefill_chunks
from .batch_request import BatchRequest, TokenEvent
from .copying import corpus_tokens
from .decode import LogitsProcessor, Step, apply_processors
from .models import Drafter
from .errors import DFlashError
from .model import MAX_BLOCK_SIZE, DFlashModel
from .cache.ragged import RaggedKVCache
from .sampling import KeyedPicks, Sampler, SamplingParams, Strategy, make_strategy, random_seed, token_logprobs
from .stats import EngineStats, SpeculativeStats


def batch_refusal(model: DFlashModel, completion_batch_size: int) -> str | None:
    """Why the engine would decode ``model``'s requests one at a time, or None if it batches them."""
    if completion_batch_size == 1:
        return "completion_batch_size is 1"
    if model.drafter.architecture != Drafter.architecture:
        return f"{model.drafter.architecture} drafters pick proposals row by row"
    return model.target.cache_policy.batch_refusal


class BatchEngine:
    """Continuous batching of DFlash requests over one model pair.

    block_size: fixed, ``"auto"`` (per step, from the measured cost of R rows x
    B tokens and each row's acceptance, ``batch_adaptive``) or a
    ``BatchBlockSize``; default the drafter's (with many rows, ``"auto"`` is
    what keeps the verify cost of R x B rows in check). completion_batch_size:
    most rows decoded together; more requests wait. prefill_step_size: most
    prompt tokens prefilled per step. Not thread-safe: one thread (the server's
    worker) calls ``add``, ``cancel`` and ``step``.
    """

    def __init__(
        self,
        model: DFlashModel,
        *,
        block_size: int | str | BatchBlockSize | None = None,
        completion_batch_size: int = 8,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        use_metal: bool | None = None,
        prompt_cache_size: int = 4,
        copy_proposals: bool = True,
    ):
        if completion_batch_size < 1 or prefill_step_size < 1:
            raise DFlashError(
                f"completion_batch_size {completion_batch_size} and prefill_step_size "
                f"{prefill_step_size} must be at least 1"
            )
        if not (block_size is None or block_size == "auto" or isinstance(block_size, BatchBlockSize)
                or (isinstance(block_size, int) and 1 <= block_size <= MAX_BLOCK_SIZE)):
            raise DFlashError(f"block size {block_size!r} is invalid: use 1..{MAX_BLOCK_SIZE} or 'auto'")
        self.target, self.drafter = model.target, model.drafter
        self.ops = kernels.get_ops(use_metal)
        self.policy = make_batch_policy(model, use_metal=use_metal) if block_size == "auto" else (
            block_size if isinstance(block_size, BatchBlockSize) else None)
        self.block_size = self.policy.max_block_size if self.policy else block_size or model.block_size
        self.prefill_step_size = prefill_step_size
        # DFlash2 picks each proposal given the one before with the row's own sampler.
        self.picks_in_order = self.drafter.architecture != Drafter.architecture
        reason = batch_refusal(model, completion_batch_size)
        self.max_rows = 1 if reason else completion_batch_size
        self.stats = EngineStats(batched=reason is None, reason=reason)
        self.fallbacks = set(self.ops.fallbacks)
        if self.ops.path != "mlx":
            self.fallbacks.add("block_attention: batched rows use mx.fast.scaled_dot_product_attention")
        self.head, self.mask_id = self.target.head(self.drafter.vocab_rows), self.drafter.args.mask_token_id
        self.rows: list[BatchRequest] = []  # in batch order
        self.pending: deque[BatchRequest] = deque()
        self.cache: list | None = None
        self.draft_cache: list | None = None
        self.ahead: tuple[mx.array, mx.array] | None = None  # logits and hidden of the anchors' forward
        self._uids = itertools.count()
        self.copy_proposals = copy_proposals
        # Recurrent target layers cannot be trimmed back to a shared prefix.
        self.prompt_cache = PromptCache(0 if self.target.cache_policy.mixers else prompt_cache_size)

    @property
    def idle(self) -> bool:
        return not self.rows and not self.pending

    @property
    def uids(self) -> list[int]:
        """Request ids of the batch rows, in row order."""
        return [r.uid for r in self.rows]

    def add(
        self,
        prompt: Sequence[int] | mx.array,
        *,
        max_tokens: int = 256,
        temp: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        sampler: Sampler | None = None,
        seed: int | None = None,
        stop_tokens: Iterable[int | Sequence[int]] = (),
        logits_processors: list[LogitsProcessor] | None = None,
        logprobs: bool = False,
        block_size: int | None = None,
    ) -> int:
        """Queue a request; it joins the batch once its prompt is prefilled. Returns its uid.

        Settings are the request's own, as in ``stream_generate``; ``seed`` gives
        it a random stream of its own (at a fixed block size its output does not
        depend on what else is batched with it); ``stop_tokens`` holds token ids
        or token sequences (the eos ids are not added here). ``block_size`` caps the
        blocks of every step this request is in (rows share one block per step).
        """
        prompt = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
        if not prompt:
            raise DFlashError("the prompt is empty: give at least one token of prompt")
        if max_tokens < 1:
            raise DFlashError(f"max_tokens must be at least 1, got {max_tokens}")
        if block_size is not None and not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise DFlashError(f"block size {block_size!r} is invalid: use 1..{MAX_BLOCK_SIZE}")
        if seed is not None and sampler is not None:
            raise DFlashError("seed cannot reach a custom sampler (it draws from MLX's global state): "
                              "pass temp/top_p/top_k/min_p instead, or call mx.random.seed")
        stops = [[t] if isinstance(t, int) else list(t) for t in stop_tokens]
        # Coupled sampling keyed by the request's seed: its text does not depend on its neighbours.
        coupled = None if temp == 0 or sampler or self.picks_in_order else (
            random_seed() if seed is None else seed, self.target.vocab_size)
        strategy = make_strategy(SamplingParams(temp, top_p, top_k, min_p), sampler, self.ops, coupled)
        request = BatchRequest(
            uid=next(self._uids), prompt=prompt, max_tokens=max_tokens, strategy=strategy,
            processors=list(logits_processors or []),
            matcher=StopSequences(stops).matcher(),
            key=None if seed is None else mx.random.key(seed),
            logprobs=logprobs,
            stats=SpeculativeStats(self.block_size, self.ops.path, self.fallbacks, adaptive=self.policy is not None,
                                   copy_proposals=self.copy_proposals, corpus_tokens=corpus_tokens(self.drafter),
                                   sampling=strategy.name),
            block_cap=block_size,
            copies=RowCopies(prompt, self.block_size, self.drafter.corpus) if self.copy_proposals else None,
            tracker=self.policy.track() if self.policy else None,
            cache=self.target.make_batch_cache(),
            draft_cache=[RaggedKVCache() for _ in self.drafter.layers],
        )
        request.tokens = list(prompt)
        if hit := self.prompt_cache.fetch(prompt):
            request.prefilled, request.cache, request.draft_cache = hit
        self.pending.append(request)
        return request.uid

    def cached_tokens(self, uid: int) -> int:
        """Prompt tokens a queued or running request took from the prompt cache (or has prefilled)."""
        return next((r.prefilled for r in [*self.pending, *self.rows] if r.uid == uid), 0)

    def cancel(self, uid: int) -> bool:
        """Drop a request, queued or running; its row is freed at once. False if unknown."""
        for request in self.pending:
            if request.uid == uid:
                self.pending.remove(request)
                return True
        if uid not in self.uids:
            return False
        row = self.uids.index(uid)
        self.prompt_cache.save(self.rows[row].tokens, self.cache, self.draft_cache, row)
        self._keep([i for i, r in enumerate(self.rows) if r.uid != uid])
        return True

    def step(self) -> list[TokenEvent]:
        """Prefill queued prompts (up to ``prefill_step_size`` tokens), then one
        draft-verify step over every running row. Returns the committed tokens."""
        events: list[TokenEvent] = []
        self._prefill(events)
        if self.rows:
            self._decode(events)
        self.stats.generation_tokens += len(events)
        return events

    # -- joining --------------------------------------------------------------

    def _prefill(self, events: list[TokenEvent]) -> None:
        budget = self.prefill_step_size if self.rows else math.inf
        while self.pending and budget > 0 and len(self.rows) < self.max_rows and self.ahead is None:
            tic = time.perf_counter()
            chunks, room = [], min(budget, self.prefill_step_size)  # free rows' requests share a forward
            for request in itertools.islice(self.pending, self.max_rows - len(self.rows)):
                chunk = request.prompt[request.prefilled : request.prefilled + room]
                request.prefilled, room = request.prefilled + len(chunk), room - len(chunk)
                chunks.append((request, chunk))
                if not room:
                    break
            budget -= sum(len(chunk) for _, chunk in chunks)
            outputs = prefill_chunks(self.target, [(r.cache, chunk) for r, chunk in chunks], self.prefill_step_size)
            for (request, chunk), (logits, hidden) in zip(chunks, outputs):
                # The drafter takes the chunk as context now, under a throw-away one-token block.
                self.drafter(self.target.embed(mx.array([[self.mask_id]])), hidden, request.draft_cache, self.head,
                             self.ops)
                done = request.prefilled == len(request.prompt)
                token, logprob = self._first_token(request, logits) if done else (None, None)
                mx.eval(token, logprob, [c.state for c in request.cache], [c.state for c in request.draft_cache])
                self.stats.prompt_tokens += len(chunk)
                if done:
                    self.pending.remove(request)
                    self._start(request, token, logprob, events)
            self.stats.prompt_time += time.perf_counter() - tic

    def _first_token(self, request: BatchRequest, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        if request.processors:
            prompt = mx.array(request.prompt)
            logits = apply_processors(request.processors, prompt[:-1], prompt[-1:], logits)
            request.history = prompt
        token = request.strategy.at(len(request.prompt)).first(logits, request.subkey())
        return token, token_logprobs(logits, token) if request.logprobs else None

    def _start(self, request: BatchRequest, token: mx.array, logprob: mx.array | None, events: list[TokenEvent]) -> None:
        if not self._emit(request, token.tolist(), 0, logprob, events):
            self.prompt_cache.save(request.tokens, request.cache, request.draft_cache, 0)
            return
        if self.cache is None:
            self.cache, self.draft_cache = request.cache, request.draft_cache
        else:
            for batch, row in zip(self.cache + self.draft_cache, request.cache + request.draft_cache):
                batch.extend(row)
        request.cache = request.draft_cache = None
        self.rows.append(request)

    def _keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices into ``self.rows``)."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.draft_cache = self.ahead = None
            return
        if self.ahead is not None:
            self.ahead = tuple(x[mx.array(keep)] for x in self.ahead)
        for c in self.cache + self.draft_cache:
            c.filter(keep)

    # -- one draft-verify step ---------------------------------------------

    def _decode(self, events: list[TokenEvent]) -> None:
        tic, rows, R = time.perf_counter(), self.rows, len(self.rows)
        # Not shortened near a row's max_tokens (the extra tokens are dropped): a
        # seeded row's random draws must not depend on its neighbours' progress.
        B = self.policy.next_block_size([r.tracker for r in rows]) if self.policy else self.block_size
        B = min([B] + [r.block_cap for r in rows if r.block_cap])
        anchors = mx.array([[r.anchor] for r in rows], mx.int32)
        drafted, from_copy = None, [None] * R
        rules = [r.strategy.at(len(r.tokens)) for r in rows]  # each row's block starts at its own position
        if B > 1:
            drafted, qs, confidence = self._draft(anchors, B, rules)
            proposals, qs, from_copy = propose_rows(rows, drafted, qs, confidence)
        else:
            proposals, qs = mx.zeros((R, 0), mx.int32), [mx.zeros((0, self.target.vocab_size))] * R
        block = mx.concatenate([anchors, proposals], axis=1)
        if self.ahead is None:
            logits, hidden = self.target(block, self.cache)
        elif B == 1:
            logits, hidden = self.ahead
        else:  # the anchors' rows already ran: verify the proposals after them
            rest = self.target(proposals, self.cache)
            logits, hidden = (mx.concatenate(pair, axis=1) for pair in zip(self.ahead, rest))
        self.ahead = None
        results = []
        for i, r in enumerate(rows):
            row_logits = logits[i]
            if r.processors:
                row_logits = apply_processors(r.processors, r.history, block[i], row_logits)
            tokens, n = rules[i].verify(row_logits, proposals[i], qs[i], r.subkey())
            results.append((tokens, n, token_logprobs(row_logits, tokens) if r.logprobs else None))
        tokens, accepted, logprobs = zip(*results)
        outputs = (tokens, accepted, [x for x in (*logprobs, drafted, *from_copy) if x is not None])
        if B == 1 and not (self.pending and len(rows) < self.max_rows) and self._expects_plain():
            # Evaluated apart: one evaluation of both would hold the host until the next forward is done.
            mx.async_eval(outputs)
            self.ahead = self.target(mx.stack([t[:1] for t in tokens]), self.cache)
            mx.async_eval(self.ahead)
        mx.eval(outputs)
        accepted = mx.stack(accepted).tolist()
        drafted = drafted.tolist() if drafted is not None else None
        if B > 1:  # a plain step rejects nothing (and may have run ahead since)
            self.target.rollback_rows(self.cache, [B - 1 - n for n in accepted])
        self.stats.steps += 1
        self.stats.rows[R] += 1
        self.stats.block_sizes[B] += 1
        self.stats.ragged_steps += len(set(accepted)) > 1
        keep = []
        for i, (r, n) in enumerate(zip(rows, accepted)):
            committed = tokens[i].tolist()[: n + 1]
            # Without a draft this step, the drafter has not consumed the pending context yet.
            r.context = [hidden[i, : n + 1]] if B > 1 else r.context + [hidden[i, : n + 1]]
            if r.processors:
                r.history = mx.concatenate([r.history, block[i, : n + 1]])
            copied = from_copy[i].tolist() if from_copy[i] is not None else []
            r.stats.record(Step(committed, n, block_size=B, copied=sum(copied[:n]), copies=sum(copied),
                                from_corpus=bool(r.copies and r.copies.from_corpus)))
            if r.copies and drafted is not None:
                r.copies.record(drafted[i], committed)
            if r.tracker:
                r.tracker.observe(B, n)
            lp = None if logprobs[i] is None else logprobs[i][: n + 1]
            if self._emit(r, committed, n, lp, events):
                keep.append(i)
            else:
                self.prompt_cache.save(r.tokens, self.cache, self.draft_cache, i)
        self._keep(keep)
        self.stats.decode_time += (seconds := time.perf_counter() - tic)
        if self.policy:
            self.policy.observe(R, B, seconds, self.ahead is not None)

    def _expects_plain(self) -> bool:
        if any(r.block_cap == 1 for r in self.rows):
            return True
        return self.policy.expects_plain([r.tracker for r in self.rows]) if self.policy else self.block_size == 1

    def _draft(self, anchors: mx.array, B: int, rules: list[Strategy]) -> tuple[mx.array, list[mx.array | None], mx.array]:
        """Every row's B-1 proposals from one drafter forward, the draft distributions, and the
        drafter's probability of each proposal (lazy: read only to weigh a copy against it)."""
        rows = self.rows
        masks = mx.full((len(rows), B - 1), self.mask_id, mx.int32)
        embeddings = self.target.embed(mx.concatenate([anchors, masks], axis=1))
        counts = [sum(c.shape[0] for c in r.context) for r in rows]
        width = max(counts)
        features = len(self.target.layer_ids) * self.target.hidden_size
        # Left-padded, so each row's block follows its own context (RaggedKVCache.prepare).
        context = mx.stack([
            mx.concatenate([mx.zeros((width - n, features), embeddings.dtype), *r.context])
            for r, n in zip(rows, counts)
        ])
        for c in self.draft_cache:
            c.prepare([width - n for n in counts])
        if self.picks_in_order:  # one row (see __init__)
            tokens, q, confidence = self.drafter.propose(embeddings, anchors[:, 0], context, self.draft_cache,
                                                         self.head, KeyedPicks(rules[0], rows[0].subkey))
            qs = [None if q is None else q[0]]
        else:
            draft_logits = self.drafter(embeddings, context, self.draft_cache, self.head, self.ops)
            tokens, qs, confidence = zip(*[self.drafter.pick(draft_logits[i], partial(rules[i].propose, key=r.subkey()))
                                           for i, r in enumerate(rows)])
            tokens, confidence = mx.stack(tokens), mx.stack(confidence)
        for r in rows:
            r.context = []
        return tokens, list(qs), confidence

    def _emit(self, request: BatchRequest, tokens: list[int], accepted: int, logprobs, events: list[TokenEvent]) -> bool:
        """Turn committed tokens into events; False once the request is finished."""
        lps = [None] * len(tokens) if logprobs is None else logprobs.tolist()
        for j, (token, lp) in enumerate(zip(tokens, lps)):
            request.produced += 1
            request.tokens.append(token)
            if request.copies:
                request.copies.index.extend([token])
            reason = "stop" if request.matcher.advance(token) else None
            if reason is None and request.produced == request.max_tokens:
                reason = "length"
            events.append(TokenEvent(request.uid, token, j < accepted, reason, lp,
                                     request.stats if reason else None))
            if reason:
                return False
        request.anchor = tokens[-1]
        return True

