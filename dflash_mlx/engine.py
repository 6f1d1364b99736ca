"""The decode engine: every request is a row, and every step drafts and verifies all rows together.

One step (``Engine.step``):

1. **join**: queued prompts are prefilled in chunks (``Target.prefill_rows``: several requests per
   forward), the drafter taking in each chunk's hidden states as it goes (only the rows its window
   will ever show); a request whose prompt is done gets its first token and joins the batch.
2. **plan**: the block policy (``policy.py``) picks the block size B for the rows running now, and
   whether the drafter runs, from each row's measured acceptance and what R rows x B tokens cost.
3. **propose**: one drafter forward drafts every row's B - 1 proposals (``Drafter``), and/or each row
   copies them from where its text last read as it ends now (``copying.py``).
4. **verify**: one target forward over every row's ``[anchor, proposals]``; each row's own rule
   (``sampling.py``) accepts its longest matching prefix and adds the target's own next token.
5. **commit**: each row keeps what it accepted, no more and no less than its neighbours; the caches
   drop each row's rejected tail (``Target.rollback``), the drafter gets the committed rows' hidden
   states as new context, finished rows leave (their caches go to the prompt cache).

A single request is a batch of one and runs the same step; at one row nothing is padded. One host
sync per step reads what every row committed (top-p sampling adds one, ``sampling.nucleus``). When
plain steps are expected and nobody waits to join, a plain step starts the next one's forward before
the host reads its tokens, as mlx_lm does, where that frees the host (``BlockPolicy.runs_ahead``).
Requests join and leave between steps; a request whose prompt extends an earlier one starts from the
prompt cache (``cache/prompt.py``). The engine is not thread-safe: one thread calls ``add``,
``cancel`` and ``step``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Iterable, Sequence

import mlx.core as mx
from mlx_lm.generate import StopSequences

from . import kernels, tree, tree_verify
from .cache.prompt import PromptCache
from .copying import CopyIndex, merge
from .costs import prefill_chunks
from .errors import DFlashError
from .model import MAX_BLOCK_SIZE, DFlashModel
from .policy import BlockPolicy, Plan, make_policy
from .request import (LogitsProcessor, Row, TokenEvent, apply_processors, batch_refusal, couples, row_tree_refusal,
                      tree_refusal)
from .sampling import Sampler, SamplingParams, Strategy, make_strategy, random_seed
from .stats import EngineStats, SpeculativeStats, Step

# With prefill_step_size None: the most prompt tokens per prefill forward (mlx_lm's step), and per
# step while rows decode (a joining prompt holds them up for at most that).
PREFILL_STEP_SIZE, DECODING_PREFILL_STEP = 2048, 512


class Engine:
    """Speculative decoding of any number of requests over one model pair.

    block_size: fixed, ``"auto"`` (per step, from the measured cost of R rows x B tokens at the
    context in use and each row's acceptance, ``policy.py``) or a ``BlockPolicy``; default the
    drafter's. max_rows: most rows decoded together; more requests wait. prefill_step_size: most
    prompt tokens of a request per prefill forward, of all requests sharing one, and per step while
    rows decode; None: a request's chunks are the size this machine prefills fastest
    (``costs.PrefillChunks``), in forwards of up to ``PREFILL_STEP_SIZE`` tokens, one forward a
    step (``DECODING_PREFILL_STEP`` tokens a step while rows decode): a long prompt's request may
    be cancelled, or the engine stopped, between its forwards. prompt_cache: a ``PromptCache`` whose
    entries requests start from and leaving rows are saved to (None: no reuse). draft_window:
    ``(keep, recent)`` bounds the drafter's context (``Drafter.make_cache``), ``"auto"`` (the
    default) the window the drafter records (``DrafterArgs.context_window``), None none.
    tree_budget: proposals per draft tree (``tree.py``), ``"auto"`` (per step, for the most
    expected tokens per second) or 0 for chains only; a step whose rows or target cannot verify
    trees verifies a chain (the stats say why). profile: time each step's draft and verify apart
    (one more host sync per step; ``stats.draft_seconds``/``verify_seconds``).
    """

    def __init__(
        self,
        model: DFlashModel,
        *,
        block_size: int | str | BlockPolicy | None = None,
        max_rows: int = 8,
        prefill_step_size: int | None = None,
        use_metal: bool | None = None,
        prompt_cache: PromptCache | None = None,
        copy_proposals: bool = True,
        draft_window: tuple[int, int] | str | None = "auto",
        tree_budget: int | str = "auto",
        profile: bool = False,
    ):
        if max_rows < 1 or (prefill_step_size is not None and prefill_step_size < 1):
            raise DFlashError(f"max_rows {max_rows} and prefill_step_size {prefill_step_size} must be at least 1")
        self.target, self.drafter, self.model = model.target, model.drafter, model
        self.ops = kernels.get_ops(use_metal)
        self.policy = block_size if isinstance(block_size, BlockPolicy) else make_policy(
            model, block_size, use_metal, tree_budget=tree_budget)
        timed = None if prefill_step_size else prefill_chunks(model, use_metal)
        # Prompt tokens per forward, per step while rows decode, and per request per forward.
        self.prefill_step_size = prefill_step_size or PREFILL_STEP_SIZE
        self.decoding_prefill = prefill_step_size or DECODING_PREFILL_STEP
        self.prefill_chunk = prefill_step_size or timed.size
        self.profile = profile
        self.draft_window = self.drafter.args.context_window() if draft_window == "auto" else draft_window
        self.drafter.make_cache(self.draft_window)  # checks the window
        self.reach = self.drafter.reach(self.draft_window)
        # DFlash2 picks each proposal given the one before with the row's own sampler.
        self.picks_in_order = not couples(model)
        reason = batch_refusal(model) if max_rows > 1 else None
        self.max_rows = 1 if reason else max_rows
        self.trees = tree_refusal(model, self.policy)  # why steps verify chains only, or None
        start_record = getattr(self.target, "start_record", None)  # a sharded target (distributed.Driver)
        self.stats = EngineStats(batched=self.max_rows > 1, reason=reason if reason else
                                 None if max_rows > 1 else "max_rows is 1",
                                 sharding=start_record() if start_record else None,
                                 prefill=timed.describe() if timed else f"{prefill_step_size} tokens (given)")
        self.head, self.mask_id = self.target.head(self.drafter.vocab_rows), self.drafter.args.mask_token_id
        self.copy_proposals, self.corpus = copy_proposals, self.drafter.corpus
        self.prompt_cache = None if prompt_cache is None else prompt_cache.bind(model, self.draft_window)
        self.rows: list[Row] = []  # in batch order
        self.pending: deque[Row] = deque()
        self.cache: list | None = None
        self.draft_cache: list | None = None
        self.ahead: tuple[mx.array, mx.array] | None = None  # logits and hidden of the anchors' forward
        self._uids = itertools.count()

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

        Sampling settings are ``stream_generate``'s. ``seed``: the request's own random stream (its
        text then does not depend on what else runs beside it; None draws one from MLX's global
        random state, so ``mx.random.seed`` fixes it). ``stop_tokens`` holds token ids or token
        sequences (no eos ids are added here). ``block_size`` caps the blocks of every step this
        request is in (rows share one block per step).
        """
        prompt = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
        if not prompt:
            raise DFlashError("the prompt is empty: give at least one token of prompt")
        if max_tokens < 1:
            raise DFlashError(f"max_tokens must be at least 1, got {max_tokens}")
        if block_size is not None and not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise DFlashError(f"block size {block_size!r} is out of range: use 1..{MAX_BLOCK_SIZE}")
        if seed is not None and sampler is not None:
            raise DFlashError("seed cannot reach a custom sampler (it draws from MLX's global state): "
                              "pass temp/top_p/top_k/min_p instead, or call mx.random.seed")
        params = SamplingParams(temp, top_p, top_k, min_p)
        # Coupled sampling keyed by the request's seed: its text does not depend on its neighbours.
        coupled = None if temp == 0 or sampler or self.picks_in_order else (
            random_seed() if seed is None else seed, self.target.vocab_size)
        strategy = make_strategy(params, sampler, self.ops, coupled)
        row = Row(
            uid=next(self._uids), prompt=prompt, max_tokens=max_tokens, strategy=strategy,
            processors=list(logits_processors or []),
            matcher=StopSequences([[t] if isinstance(t, int) else list(t) for t in stop_tokens]).matcher(),
            key=None if seed is None or coupled else mx.random.key(seed),
            logprobs=logprobs,
            stats=SpeculativeStats(self.policy.max_block_size, self.ops.path, self.ops.fallbacks,
                                   adaptive=self.policy.adaptive, copy_proposals=self.copy_proposals,
                                   corpus_tokens=len(self.corpus.tokens) if self.corpus else 0,
                                   sampling=strategy.name, sharding=self.stats.sharding, draft_window=self.reach,
                                   step_costs=self.policy.costs.source if self.policy.adaptive else None,
                                   prefill=self.stats.prefill,
                                   trees=self.trees or row_tree_refusal(strategy, logits_processors)),
            acceptance=self.policy.acceptance(),
            block_cap=block_size,
            copies=CopyIndex(prompt, self.corpus) if self.copy_proposals else None,
            cache=None, draft_cache=None,
        )
        row.tokens = list(prompt)
        hit = self.prompt_cache.fetch(prompt) if self.prompt_cache is not None else None
        if hit is not None:
            row.prefilled, row.cache, row.draft_cache = hit
            row.cached = row.prefilled
        else:
            row.cache, row.draft_cache = self.target.make_cache(), self.drafter.make_cache(self.draft_window)
        self.pending.append(row)
        return row.uid

    def cached_tokens(self, uid: int) -> int:
        """Prompt tokens a queued or running request took from the prompt cache."""
        return next((r.cached for r in [*self.pending, *self.rows] if r.uid == uid), 0)

    def cancel(self, uid: int) -> bool:
        """Drop a request, queued or running; its row is freed at once. False if unknown."""
        for row in self.pending:
            if row.uid == uid:
                self.pending.remove(row)
                return True
        if uid not in self.uids:
            return False
        i = self.uids.index(uid)
        self._save(i)
        self._keep([j for j in range(len(self.rows)) if j != i])
        return True

    def step(self) -> list[TokenEvent]:
        """Prefill queued prompts (one forward while no row decodes, up to ``decoding_prefill`` tokens while
        rows do), then one draft-verify step over every running row; a prompt finished while none decoded
        sends its first token at once, as mlx_lm's does after prefill (rows decoding never wait for one
        joining them). Returns the tokens."""
        events: list[TokenEvent] = []
        decoding = bool(self.rows)
        self._join(events)
        if self.rows and (decoding or not events):
            self._decode(events)
        self.stats.generation_tokens += len(events)
        return events

    # -- 1. join ------------------------------------------------------------

    def _join(self, events: list[TokenEvent]) -> None:
        # With nothing decoding, one forward: a cancel or a stop is then seen between a long prompt's forwards.
        idle = not self.rows
        budget = self.prefill_step_size if idle else self.decoding_prefill
        while self.pending and budget > 0 and len(self.rows) < self.max_rows and self.ahead is None:
            tic = time.perf_counter()
            chunks, room = [], min(budget, self.prefill_step_size)  # free rows' requests share a forward
            for row in itertools.islice(self.pending, self.max_rows - len(self.rows)):
                start = row.prefilled
                chunk = row.prompt[start : start + min(room, self.prefill_chunk)]
                row.prefilled, room = start + len(chunk), room - len(chunk)
                chunks.append((row, start, chunk))
                if not room:
                    break
            budget -= sum(len(chunk) for _, _, chunk in chunks)
            outputs = self.target.prefill_rows([r.cache for r, _, _ in chunks], [c for _, _, c in chunks])
            started = []
            for (row, start, chunk), (logits, hidden) in zip(chunks, outputs):
                self._absorb(row, start, hidden)
                done = row.prefilled == len(row.prompt)
                token, logprobs = self._first_token(row, logits) if done else (None, None)
                mx.eval(token, logprobs, [c.state for c in row.cache], [c.state for c in row.draft_cache])
                self.stats.prompt_tokens += len(chunk)
                if done:
                    self.pending.remove(row)
                    if self.prompt_cache is not None:
                        self.prompt_cache.prefilled(row.prompt, row.cache, row.draft_cache)
                    started.append((row, token, logprobs))
            self._start(started, events)
            self.stats.prompt_time += time.perf_counter() - tic
            if idle:
                break

    def _absorb(self, row: Row, start: int, hidden: mx.array) -> None:
        """The drafter takes in a prompt chunk at positions ``start``.. as context: only the rows its
        window will show at the prompt's end (the first ``keep`` and the last ``recent``); the others
        cost it nothing but their positions."""
        n, end = hidden.shape[1], len(row.prompt)
        if self.reach is None:
            self.drafter.absorb(hidden, row.draft_cache)
            return
        keep, recent = self.reach
        sink = max(min(keep, start + n) - start, 0)  # chunk rows at positions < keep
        tail = max(start, keep, end - recent) - start  # first chunk row the window keeps at the end
        if sink:
            self.drafter.absorb(hidden[:, :sink], row.draft_cache)
        if tail > sink:
            for c in row.draft_cache:
                c.skip([min(tail, n) - sink])
        if tail < n:
            self.drafter.absorb(hidden[:, tail:], row.draft_cache)

    def _first_token(self, row: Row, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        if row.processors:
            prompt = mx.array(row.prompt)
            logits = apply_processors(row.processors, prompt[:-1], prompt[-1:], logits)
            row.history = prompt
        token = row.strategy.at(len(row.prompt)).first(logits, row.subkey())
        return token, _log_softmax(logits[0]) if row.logprobs else None

    def _start(self, started: list[tuple[Row, mx.array, mx.array | None]], events: list[TokenEvent]) -> None:
        """Rows whose prompts are in: each sends its first token, and those that go on join the batch
        together (one concatenation of the batch's caches for all of them, not one per row)."""
        joining = []
        for row, token, logprobs in started:
            if self._emit(row, token.tolist(), 0, [logprobs], events):
                joining.append(row)
            else:
                self._save_row(row, row.cache, row.draft_cache)
        caches, drafts = [r.cache for r in joining], [r.draft_cache for r in joining]
        if caches and self.cache is None:
            self.cache, self.draft_cache = caches.pop(0), drafts.pop(0)
        if caches:
            self.target.join(self.cache, *caches)
            for i, batch in enumerate(self.draft_cache):
                batch.extend(*(d[i] for d in drafts))
        for row in joining:
            row.cache = row.draft_cache = None
        self.rows += joining

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
        self.target.keep(self.cache, keep)
        for c in self.draft_cache:
            c.filter(keep)

    def _save(self, i: int) -> None:
        """Row ``i``'s caches to the prompt cache as it leaves."""
        if self.prompt_cache is None:
            return
        length = min(self.target.lengths(self.cache)[i], self.draft_cache[0].positions[i]
                     + sum(h.shape[0] for h in self.rows[i].pending))
        cache = self.target.take(self.cache, i, length)
        draft = [c.take(i, c.positions[i]) for c in self.draft_cache]
        self._save_row(self.rows[i], cache, draft)

    def _save_row(self, row: Row, cache: list | None, draft: list) -> None:
        if self.prompt_cache is None or cache is None:
            return
        if row.pending:  # the drafter catches up, so that both caches hold the same tokens
            self.drafter.absorb(mx.concatenate(row.pending)[None], draft)
        length = draft[0].positions[0]
        self.prompt_cache.save(row.tokens[:length], cache, draft)

    # -- 2-5. one draft-verify step -----------------------------------------

    def _decode(self, events: list[TokenEvent]) -> None:
        tic, rows, R = time.perf_counter(), self.rows, len(self.rows)
        longest = max(self.policy.max_block_size, self.policy.copy_block_size) - 1
        for r in rows:  # as long as any block may be: a row's tokens past its max_tokens are dropped
            r.copy = r.copies.suggest(longest) if r.copies else None
        head_start = self.ahead is not None  # the step before ran this one's anchors (``_verify``)
        plan = self.policy.plan(rows, waiting=bool(self.pending), head_start=head_start,
                                trees=self._tree_refusal() is None)
        anchors = mx.array([[r.anchor] for r in rows], mx.int32)
        rules = [r.strategy.at(len(r.tokens)) for r in rows]  # each row's block starts at its own position
        proposed = self._propose(plan, anchors, rules)
        if self.profile:
            mx.eval(proposed.tokens)
        else:  # the drafter computes while the host builds the verify graph
            mx.async_eval(proposed.tokens)
        drafted_at = time.perf_counter()
        verified = self._verify(proposed, rules)
        self._commit(proposed, verified, events)
        done = time.perf_counter()
        self.stats.record_step(R, proposed.width, len(set(verified.accepted)) > 1, done - tic,
                               (drafted_at - tic, done - drafted_at) if self.profile else None,
                               proposed.tree is not None)
        self.policy.observe(rows, Plan(proposed.width, plan.draft, plan.tree), done - tic, self.ahead is not None,
                            head_start)

    def _propose(self, plan: Plan, anchors: mx.array, rules: list[Strategy]) -> "Proposals":
        """Every row's proposals after its anchor: a draft tree when the plan says so (trees may be
        verified this step: ``_tree_refusal``), else a chain of ``plan.block_size`` tokens, drafted,
        copied, or both merged."""
        rows, B = self.rows, plan.block_size
        R = len(rows)
        if B == 1:
            return Proposals(anchors, [None] * R, [None] * R)
        if plan.tree:
            return self._grow_trees(anchors, rules)
        copies = [r.copy.cut(B - 1) if r.copy is not None else None for r in rows]
        for r, c in zip(rows, copies):
            r.copy = c
        if not plan.draft:  # copies alone: no drafter forward; a row without one verifies its anchor repeated
            proposals = [mx.array(c.tokens, mx.int32) if c else mx.repeat(anchors[i], B - 1)
                         for i, c in enumerate(copies)]
            return Proposals(mx.concatenate([anchors, mx.stack(proposals)], axis=1), [None] * R,
                             [mx.ones((B - 1,), mx.bool_) if c else None for c in copies])
        drafted, qs, confidence = self._draft(anchors, B, rules)
        proposals, from_copy = [], []
        for i, (r, copy) in enumerate(zip(rows, copies)):
            p, q, copied = drafted[i], qs[i], None
            if copy is not None and r.merges:  # the likelier source from their first disagreement on
                rates = r.acceptance.copy_rates(copy)
                p, copied = merge(p, confidence[i], mx.array(copy.tokens, mx.int32),
                                  mx.array([rates.rate(j) for j in range(B - 1)]))
            elif copy is not None and r.acceptance.copy_goes_further(copy, B - 1, self.policy.optimism):
                # Chosen before the draft is looked at, so the rejection rule stays exact (q: point mass).
                p, q, copied = mx.array(copy.tokens, mx.int32), None, mx.ones((B - 1,), mx.bool_)
            proposals.append(p)
            qs[i] = q
            from_copy.append(copied)
        return Proposals(mx.concatenate([anchors, mx.stack(proposals)], axis=1), qs, from_copy, drafted)

    def _tree_refusal(self) -> str | None:
        """Why this step's rows verify a chain rather than draft trees, or None."""
        if self.trees is not None:
            return self.trees
        if self.ahead is not None:  # a plain step ran this one's anchors already: chains verify after them
            return "the anchors already ran ahead"
        return next((reason for r in self.rows if (reason := row_tree_refusal(r.strategy, r.processors))), None)

    def _grow_trees(self, anchors: mx.array, rules: list[Strategy]) -> "Proposals":
        """One drafter forward over the drafter's whole block; per row the best tree of the
        candidates it scores (``tree.build``; copies as a branch), at the budget the policy picks
        for the rows' expected accepted tokens against what verifying that many nodes costs."""
        rows, B = self.rows, self.policy.max_block_size
        drafted, _, _, scores = self._draft(anchors, B, rules, scored=True)
        copy_rates, copies = [], []
        for r in rows:
            copy = r.copy.cut(B - 1) if r.copy is not None else None
            r.copy = copy
            copies.append(copy.tokens if copy else [])
            rates = r.acceptance.copy_rates(copy) if copy else r.acceptance.copies[0]
            copy_rates.append([rates.rate(j) for j in range(B - 1)])
        grown = tree.build(scores, self.policy.max_tree_budget, [r.anchor for r in rows],
                           columns=self.drafter.vocab_rows, copies=copies, copy_rates=copy_rates)
        size = self.policy.tree_budget(rows, grown, bool(self.pending)) + 1
        grown = grown.first(size)
        return Proposals(mx.array(grown.tokens), [None] * len(rows), [None] * len(rows), drafted, grown)

    def _verify(self, proposed: "Proposals", rules: list[Strategy]) -> "Verified":
        """One target forward over every row's proposals and each row's own rule: what it commits.
        One host sync; a plain step expected to be followed by another starts that one's forward
        before the host reads this one's tokens, as mlx_lm does."""
        rows, R = self.rows, len(self.rows)
        if proposed.tree is not None:
            forward = tree_verify.verify(self.target, self.cache, proposed.tree)
            picks = tree.target_tokens(rules, forward.logits, proposed.tree)
            logprobs = [_log_softmax(forward.logits[i]) if r.logprobs else None for i, r in enumerate(rows)]
            mx.eval(picks, [] if proposed.drafted is None else proposed.drafted)
            walk = tree.walk(proposed.tree, picks)
            hidden = tree_verify.commit(self.target, self.cache, forward, walk.paths)
            return Verified(walk.committed(proposed.tree), walk.accepted, hidden,
                            [None if lp is None else lp[mx.array(path)] for lp, path in zip(logprobs, walk.paths)],
                            walk)
        block = proposed.tokens
        logits, hidden = self._verify_forward(block)
        results = []
        for i, r in enumerate(rows):
            row_logits = logits[i]
            if r.processors:
                row_logits = apply_processors(r.processors, r.history, block[i], row_logits)
            tokens, n = rules[i].verify(row_logits, block[i, 1:], proposed.qs[i], r.subkey())
            results.append((tokens, n, _log_softmax(row_logits) if r.logprobs else None))
        tokens, accepted, logprobs = zip(*results)
        # Log-probabilities stay lazy: computed only for a caller who reads them.
        outputs = (tokens, accepted, [x for x in (proposed.drafted, *proposed.from_copy) if x is not None])
        joining = self.pending and R < self.max_rows  # a request joins before the next step
        if (proposed.width == 1 and not joining and self.policy.runs_ahead
                and self.policy.expects_plain(rows, bool(self.pending), self._tree_refusal() is None)):
            # Evaluated apart: in one evaluation with the next forward, reading the tokens would wait for it.
            mx.async_eval(outputs)
            self.ahead = self.target(mx.stack([t[:1] for t in tokens]), self.cache)
            self.policy.start_ahead(self.ahead)
        mx.eval(outputs)
        accepted = mx.stack(accepted).tolist()
        if proposed.width > 1:  # a plain step rejects nothing (and may have run ahead since)
            self.target.rollback(self.cache, [proposed.width - 1 - n for n in accepted])
        return Verified([t.tolist()[: n + 1] for t, n in zip(tokens, accepted)], accepted, hidden, list(logprobs))

    def _draft(self, anchors: mx.array, B: int, rules: list[Strategy], scored: bool = False) -> tuple:
        """Every row's B-1 drafted proposals from one drafter forward, the distributions they were
        drawn from, and the drafter's probability of each (lazy: read only to weigh a copy); with
        ``scored``, also each row's scores over the draft vocabulary that rank a tree's candidates
        (the logits, perturbed by the coupled noise for a coupled row: its chain is their argmax)."""
        rows = self.rows
        masks = mx.full((len(rows), B - 1), self.mask_id, mx.int32)
        embeddings = self.target.embed(mx.concatenate([anchors, masks], axis=1))
        # The new context rows go in first, so that the block attends over the window alone, as the
        # drafter was trained (the window drops what falls out of it before the block sees it).
        context = self._pending_context(embeddings.dtype)
        if context.shape[1]:
            self.drafter.absorb(context, self.draft_cache)
        context = context[:, :0]
        if self.picks_in_order:
            pick = _RowPicks(rules, rows)
            tokens, q, confidence = self.drafter.propose(embeddings, anchors[:, 0], context, self.draft_cache,
                                                         self.head, pick)
            return tokens, [None if q is None else q[i] for i in range(len(rows))], confidence
        vocab = self.drafter.scores(embeddings, context, self.draft_cache, self.head, self.ops)
        tokens, qs, confidence = zip(*[self.drafter.pick(vocab[i], partial(rules[i].propose, key=r.subkey()))
                                       for i, r in enumerate(rows)])
        if not scored:
            return mx.stack(tokens), list(qs), mx.stack(confidence)
        columns = self.drafter.vocab_rows
        scores = mx.stack([rule.scores(vocab[i], columns) if hasattr(rule, "scores") else vocab[i]
                           for i, rule in enumerate(rules)])
        return mx.stack(tokens), list(qs), mx.stack(confidence), scores

    def _pending_context(self, dtype: mx.Dtype) -> mx.array:
        """Every row's hidden rows the drafter has not taken in, left-padded to a common count."""
        rows = self.rows
        counts = [sum(h.shape[0] for h in r.pending) for r in rows]
        width = max(counts)
        features = len(self.target.layer_ids) * self.target.hidden_size
        if len(rows) == 1:
            context = mx.concatenate(rows[0].pending)[None] if rows[0].pending else mx.zeros((1, 0, features), dtype)
        else:
            context = mx.stack([mx.concatenate([mx.zeros((width - n, features), dtype), *r.pending])
                                for r, n in zip(rows, counts)])
            for c in self.draft_cache:
                c.prepare([width - n for n in counts])
        for r in rows:
            r.pending = []
        return context

    def _verify_forward(self, block: mx.array) -> tuple[mx.array, mx.array]:
        """Logits and hidden states of every row's chain ``[anchor, proposals]``."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return self.target(block, self.cache)
        if block.shape[1] == 1:
            return ahead
        # The anchors' rows already ran: verify the proposals after them.
        rest = self.target(block[:, 1:], self.cache)
        return tuple(mx.concatenate(pair, axis=1) for pair in zip(ahead, rest))

    def _commit(self, proposed: "Proposals", verified: "Verified", events: list[TokenEvent]) -> None:
        """Each row keeps what it committed: the drafter's next context, its estimates, its tokens."""
        drafted = proposed.drafted.tolist() if proposed.drafted is not None else None
        keep, walk = [], verified.walk
        for i, (r, committed, n) in enumerate(zip(self.rows, verified.tokens, verified.accepted)):
            r.pending.append(verified.hidden[i, : n + 1])
            if r.processors:
                r.history = mx.concatenate([r.history, proposed.tokens[i, : n + 1]])
            copied = proposed.from_copy[i].tolist() if proposed.from_copy[i] is not None else []
            step = Step(committed, n, block_size=proposed.width, copied=sum(copied[:n]), copies=sum(copied))
            if walk is not None:
                step = Step(committed, n, block_size=int(proposed.tree.sizes[i]), copied=walk.copied[i],
                            copies=int(proposed.tree.copied[i].sum()), tree=True, off_chain=walk.left_chain[i])
                r.acceptance.depths.observe(proposed.tree, i, n)
            step.from_corpus = step.copied > 0 and r.copy is not None and r.copy.from_corpus
            r.stats.record(step)
            r.acceptance.record(drafted[i] if drafted is not None else None, r.copy, committed)
            lps = [verified.logprobs[i][j] for j in range(n + 1)] if verified.logprobs[i] is not None else [None] * (n + 1)
            if self._emit(r, committed, n, lps, events):
                keep.append(i)
            else:
                self._save(i)
        self._keep(keep)

    def _emit(self, row: Row, tokens: list[int], accepted: int, logprobs: list, events: list[TokenEvent]) -> bool:
        """Turn committed tokens into events; False once the request is finished."""
        for j, (token, lp) in enumerate(zip(tokens, logprobs)):
            row.produced += 1
            row.tokens.append(token)
            if row.copies:
                row.copies.extend([token])
            reason = "stop" if row.matcher.advance(token) else None
            if reason is None and row.produced == row.max_tokens:
                reason = "length"
            if reason:
                row.stats.run_ahead = self.policy.describe_run_ahead()
            events.append(TokenEvent(row.uid, token, j < accepted, reason, lp, row.stats if reason else None))
            if reason:
                return False
        row.anchor = tokens[-1]
        return True


@dataclass
class Proposals:
    """One step's proposals for every row: ``tokens`` (R, N), each row's anchor first; ``tree`` their
    shape when they are a draft tree (``tree.DraftTree``), None for a chain; per row ``qs``, the
    distribution its chain proposals were drawn from (rejection sampling only), and ``from_copy``,
    which were copied; ``drafted``: the drafter's own picks (R, B-1), to learn its acceptance."""

    tokens: mx.array
    qs: list
    from_copy: list
    drafted: mx.array | None = None
    tree: "tree.DraftTree | None" = None

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


@dataclass
class Verified:
    """What each row commits: ``tokens`` (accepted proposals, then the target's own), ``accepted``
    proposals, the hidden states of the committed rows (the drafter's next context), and the
    committed tokens' log-probabilities (rows that asked); ``walk``: a tree's walk."""

    tokens: list[list[int]]
    accepted: list[int]
    hidden: mx.array
    logprobs: list
    walk: "tree.Walk | None" = None


class _RowPicks:
    """Each row's own strategy as one picker over all rows (DFlash2's selector picks position by
    position for every row at once)."""

    def __init__(self, rules: list[Strategy], rows: list[Row]):
        self.rules, self.rows = rules, rows
        self.ops = rules[0].ops

    def propose(self, scores: mx.array) -> tuple[mx.array, mx.array | None]:
        picks = [rule.propose(scores[i : i + 1], row.subkey()) for i, (rule, row) in enumerate(zip(self.rules, self.rows))]
        tokens = mx.concatenate([p for p, _ in picks])
        if all(q is None for _, q in picks):
            return tokens, None
        # A deterministic row's q is never read (its rule matches tokens): its pick as a point mass.
        qs = [q if q is not None else (mx.arange(scores.shape[-1]) == p[:, None]).astype(scores.dtype) for p, q in picks]
        return tokens, mx.concatenate(qs)


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
