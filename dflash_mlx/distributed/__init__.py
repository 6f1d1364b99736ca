"""DFlash on a target sharded over mx.distributed ranks, launched with ``mlx.launch``.

mlx_lm does the sharding: tensor parallel (``model.shard``: every rank holds a slice
of every layer and all_sums after each, so every rank sees full hidden states) or
pipeline parallel (``model.model.pipeline``: each rank holds a run of layers, rank 0
the last ones, and the final hidden state is all_gathered to every rank).
``sharded_load`` reads only each rank's weights.

Rank 0 drives and the other ranks follow. Rank 0 runs everything that decides: the
drafter, sampling, the accept rule, the block-size policy, the CLI or the server.
Before each operation on the target's caches (make one, prefill, verify) it sends the
order over the control channel (``control.py``), and every rank then runs its share
of the same forward, so mlx_lm's collectives inside the model pair up; a rollback
rides along with the next order. The other ranks never sample or accept, so the
decision is the same everywhere by construction. The drafter runs once, on rank 0:
its proposals travel in the verify order (a few bytes); drafting on every rank would
save only that message, and only if every rank drafted bit-identical proposals.

Taps: under tensor parallelism every tapped layer's output is on rank 0 already.
Under pipeline parallelism the taps other ranks hold reach rank 0 through one
all_sum of zero-padded rows per forward, run after the pipeline's send/recv and
before its all_gather on every rank (collectives pair up by their order).

On every rank but 0, ``Shards.load`` does not return: the process follows rank 0
and ends when rank 0 ends. So the same command (CLI, server, benchmark, a script
calling ``dflash_mlx.load``) runs unchanged under ``mlx.launch``, and whatever runs
after ``load`` runs on rank 0 alone.
"""

from __future__ import annotations

import importlib
import io
import itertools
import re
import statistics
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..checkpoint import resolve
from .control import Control, fault
from ..errors import DFlashError
from ..stats import ShardingStats
from ..target import Target

CALIBRATION_ROWS = (1, 32)  # hidden-state rows of the all_sums timed at load
CALIBRATION_REPEATS = 3
CALIBRATION_CHAIN = 8
_COLLECTIVE = re.compile(r'label ="[^"]*(?:AllReduce|AllGather|ReduceScatter|Send|Recv)')


class ShardedTarget(Target):
    """The Target over one rank's shard of the model."""

    def __init__(self, model: nn.Module, layer_ids: list[int], rank: int, head: nn.Module | None = None):
        # Rank 0 holds the last layers of a pipeline, so it can check every id; other
        # stages hold fewer layers than the ids name and take rank 0's word for them.
        super().__init__(model, layer_ids if rank == 0 else [])
        self.layer_ids, self.rank = list(layer_ids), rank
        if head is not None:  # the drafter needs the whole head; the model's own is a vocabulary slice
            self.lm_head = self._head_module = head
        self.remote_ids: list[int] = []  # tapped layers that other ranks hold
        self.gather_seconds = 0.0

    def connect(self, group, remote_ids: list[int]) -> None:
        """Agree on rollback limits and time a collective; every rank calls this at the same point."""
        self.group, self.remote_ids = group, remote_ids
        restricted = mx.distributed.all_sum(int(self.cache_policy.restricted), group=group, stream=mx.cpu)
        self.cache_policy.restricted = restricted.item() > 0  # every rank refuses the same rollbacks
        self.latency = {}
        for rows in CALIBRATION_ROWS:
            times = []
            for _ in range(CALIBRATION_REPEATS + 1):  # the first warms up
                x = mx.zeros((1, rows, self.hidden_size), self.dtype)
                for _ in range(CALIBRATION_CHAIN):  # dependent collectives in one graph, as in a forward
                    x = mx.distributed.all_sum(x, group=group)
                tic = time.perf_counter()
                mx.eval(x)
                times.append((time.perf_counter() - tic) / CALIBRATION_CHAIN)
            self.latency[rows] = statistics.median(times[1:])
        graph = io.StringIO()  # built, never evaluated: no collective runs here
        mx.export_to_dot(graph, self.model(mx.zeros((1, 1), mx.int32)))
        self.collectives = len(_COLLECTIVE.findall(graph.getvalue()))

    def collective_seconds(self, rows: int) -> float:
        """Estimated time of the model's own collectives in a forward of ``rows`` tokens."""
        (r0, t0), (r1, t1) = sorted(self.latency.items())
        return self.collectives * max(0.0, t0 + (t1 - t0) * (min(rows, r1) - r0) / (r1 - r0))

    def _hidden(self, taps: dict[int, mx.array], tokens: mx.array, cache: list) -> mx.array:
        if self.remote_ids:
            taps = {**taps, **self._gather(taps, tokens, cache)}
        if len(taps) < len(self.layer_ids):  # a pipeline stage other than rank 0, which never drafts
            return mx.zeros((*tokens.shape, 0), self.dtype)
        # Under tensor parallelism every rank evaluates the taps, as rank 0 does: a tapped
        # last layer holds collectives that no cache state depends on.
        return super()._hidden(taps, tokens, cache)

    def _gather(self, taps: dict[int, mx.array], tokens: mx.array, cache: list) -> dict[int, mx.array]:
        """The taps other ranks hold, on every rank: one all_sum of zero-padded rows."""
        # The pipeline's send/recv first: left to the scheduler, this all_sum could run
        # before a stage's send on one rank and after it on another.
        mx.eval(list(taps.values()), [c.state for c in cache])
        zeros = mx.zeros((*tokens.shape, self.hidden_size), self.dtype)
        rows = mx.concatenate([taps.get(i, zeros) for i in self.remote_ids], axis=-1)
        tic = time.perf_counter()
        rows = mx.distributed.all_sum(rows, group=self.group)
        mx.eval(rows)  # before the pipeline's all_gather, which only the logits hold
        self.gather_seconds += time.perf_counter() - tic
        return dict(zip(self.remote_ids, mx.split(rows, len(self.remote_ids), axis=-1)))


def _settle() -> None:
    """Wait for work still running on mlx_lm's generation stream.

    mlx_lm's generate evaluates one forward ahead, asynchronously, and returns with
    the last one still running. Its collectives must finish before the next
    operation's start, or they would interleave with them differently on each rank.
    """
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


class _Cache(list):
    """A cache on rank 0, named by ``id`` in the orders to the other ranks."""

    id: int


@contextmanager
def _collectives() -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # MLX's ring backend: a peer's socket closed mid-collective
        fault(0, f"a collective with the other ranks failed: {e}")


class Driver:
    """Rank 0's handle on its ShardedTarget: each cache operation is ordered on every rank first.

    Used like a Target (other attributes are the wrapped target's). Every forward is
    evaluated here, so all of a step's collectives happen inside these methods.
    """

    def __init__(self, target: ShardedTarget, shards: "Shards"):
        self.target, self.shards = target, shards
        self._ids = itertools.count()
        self._rollback: list[int] | None = None  # [cache id, tokens] for the next order
        self._freed: list[int] = []  # ids of caches rank 0 dropped
        self.record: ShardingStats | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    def _order(self, op: str, cache: _Cache | None = None, **fields) -> float:
        order = {"op": op, **fields}
        if cache is not None:
            order["cache"] = cache.id
        if self._rollback:
            order["rollback"], self._rollback = self._rollback, None
        if self._freed:  # appended by weakref finalizers, so emptied in place
            order["free"] = self._freed[:]
            del self._freed[: len(order["free"])]
        tic = time.perf_counter()
        self.shards.control.send(order)
        return time.perf_counter() - tic

    def _named(self, cache: list | None) -> _Cache | None:
        """``cache`` under a new id; the other ranks drop theirs once rank 0 lets go of it."""
        if cache is None:
            return None
        named = _Cache(cache)
        named.id = next(self._ids)
        weakref.finalize(named, self._freed.append, named.id)
        return named

    def make_cache(self, rows: int = 1) -> list:
        cache = self._named(self.target.make_cache(rows))
        self._order("cache", cache, rows=rows)
        return cache

    def __call__(self, tokens: mx.array, cache: _Cache, logits_at: list[int] | None = None) -> tuple[mx.array, mx.array]:
        control = self._order("forward", cache, tokens=tokens.tolist(), logits_at=logits_at)
        gathered = self.target.gather_seconds
        with _collectives():
            logits, hidden = self.target(tokens, cache, logits_at)
            mx.eval(logits, hidden)
        if self.record is not None:
            r = self.record
            r.steps += 1
            r.control_seconds += control
            r.gather_seconds += self.target.gather_seconds - gathered
            r.collective_seconds += self.target.collective_seconds(tokens.size)
        return logits, hidden

    def prefill_rows(self, caches: list[_Cache], chunks: list[list[int]]) -> list[tuple[mx.array, mx.array]]:
        self._order("prefill", None, caches=[c.id for c in caches], chunks=chunks)
        with _collectives():
            outputs = self.target.prefill_rows(caches, chunks)
            mx.eval(outputs)
        return outputs

    prefill = Target.prefill  # through prefill_rows, so that the other ranks follow

    def rollback(self, cache: _Cache, drops: int | list[int]) -> None:
        drops = [drops] * self.target.rows(cache) if isinstance(drops, int) else list(drops)
        self.target.rollback(cache, drops)  # refuses what any rank would refuse
        if any(drops):
            if self._rollback:  # one rollback rides along per order
                self._order("noop")
            self._rollback = [cache.id, drops]

    def stretch(self, cache: _Cache, length: int) -> None:
        self._order("stretch", cache, length=length)
        self.target.stretch(cache, length)

    def join(self, cache: _Cache, other: _Cache) -> None:
        self._order("join", cache, other=other.id)
        self.target.join(cache, other)

    def keep(self, cache: _Cache, rows: list[int]) -> None:
        self._order("keep", cache, rows=rows)
        self.target.keep(cache, rows)

    def take(self, cache: _Cache, row: int, length: int) -> _Cache | None:
        taken = self._named(self.target.take(cache, row, length))
        if taken is not None:
            self._order("take", cache, row=row, length=length, into=taken.id)
        return taken

    def on_all_ranks(self, fn: Callable[..., Any], *args) -> Any:
        """``fn(model, tokenizer, *args)`` on every rank with its shard; rank 0's result.

        For code that runs the sharded model the mlx_lm way, every rank alike (e.g.
        mlx_lm's own generate). ``fn`` must be a module-level function that finishes
        its work before returning, and ``args`` JSON values.
        """
        self._order("call", fn=f"{fn.__module__}:{fn.__qualname__}", args=list(args))
        with _collectives():
            result = fn(self.target.model, self.shards.tokenizer, *args)
            _settle()
        return result

    def start_record(self) -> ShardingStats:
        """A fresh communication record; the verify steps from now on add to it."""
        mode = "pipeline parallel" if self.shards.pipeline else "tensor parallel"
        self.record = ShardingStats(mode, self.shards.size, self.target.collectives)
        return self.record


def follow(target: ShardedTarget, control: Control, tokenizer: TokenizerWrapper) -> None:
    """Every rank but 0: run rank 0's orders on this shard until rank 0 ends the process."""
    caches: dict[int, list] = {}
    while True:
        order = control.next_order()
        try:
            if order.get("rollback"):
                cache_id, drops = order["rollback"]
                target.rollback(caches[cache_id], drops)
            for cache_id in order.get("free", ()):
                caches.pop(cache_id, None)
            op, cache = order["op"], caches.get(order.get("cache"))
            if op == "cache":
                caches[order["cache"]] = target.make_cache(order["rows"])
            elif op == "forward":
                mx.eval(target(mx.array(order["tokens"], mx.int32), cache, order["logits_at"]))
            elif op == "prefill":
                mx.eval(target.prefill_rows([caches[i] for i in order["caches"]], order["chunks"]))
            elif op == "stretch":
                target.stretch(cache, order["length"])
            elif op == "join":
                target.join(cache, caches.pop(order["other"]))
            elif op == "keep":
                target.keep(cache, order["rows"])
            elif op == "take":
                caches[order["into"]] = target.take(cache, order["row"], order["length"])
            elif op == "call":
                module, name = order["fn"].split(":")
                getattr(importlib.import_module(module), name)(target.model, tokenizer, *order["args"])
                _settle()
        except Exception as e:  # a failed collective, or the ranks have parted ways
            fault(target.rank, f"cannot follow rank 0's {order['op']} order: {type(e).__name__}: {e}")


class Shards:
    """This process's part in a sharded run: its rank, the control channel, the sharding mode."""

    def __init__(self, group, pipeline: bool):
        self.group, self.pipeline = group, pipeline
        self.rank, self.size = group.rank(), group.size()
        self.control = Control.connect(group)
        self.full_head: nn.Module | None = None
        self.tokenizer: TokenizerWrapper | None = None

    joined = False  # the other ranks follow the first sharded target until the process ends

    @classmethod
    def join(cls, pipeline: bool) -> "Shards | None":
        """Join the launched ranks; None when this is the only one."""
        group = mx.distributed.init()
        if group.size() > 1:
            if cls.joined:
                raise DFlashError(
                    "this launched process already loaded a sharded target, and the other ranks follow "
                    "it until the process ends: load one pair per mlx.launch"
                )
            cls.joined = True
            return cls(group, pipeline)
        if pipeline:
            raise DFlashError(
                "--pipeline needs two or more ranks: run under `mlx.launch -n 2 --backend ring -- "
                "dflash-mlx ...` (or --hostfile for several machines)"
            )
        return None

    def load(self, path_or_repo: str, chat_template: str | None = None) -> tuple[nn.Module, TokenizerWrapper]:
        """Load this rank's shard of the target. On every rank but 0: follow rank 0, never return."""
        model, self.tokenizer = _sharded_load(path_or_repo, self.size, self.pipeline, chat_template)
        self.pipeline = getattr(model.model, "pipeline_size", 1) > 1  # mlx_lm's choice without tensor parallelism
        if self.rank:
            start = self.control.next_order()
            target = ShardedTarget(model, start["layer_ids"], self.rank)
            target.connect(self.group, start["remote"])
            follow(target, self.control, self.tokenizer)
        if not self.pipeline:
            self.full_head = _full_head(model, path_or_repo)
        return model, self.tokenizer

    def target(self, model: nn.Module, layer_ids: list[int]) -> Driver:
        """Rank 0: the target the drafter speculates for, with the other ranks following it."""
        target = ShardedTarget(model, layer_ids, 0, self.full_head)
        remote = [i for i in layer_ids if not target.holds(i)]
        self.control.send({"op": "start", "layer_ids": list(layer_ids), "remote": remote})
        target.connect(self.group, remote)
        return Driver(target, self)


def _sharded_load(path_or_repo: str, size: int, pipeline: bool, chat_template: str | None) -> tuple[nn.Module, TokenizerWrapper]:
    """mlx_lm's ``sharded_load`` (tensor parallel where the model allows) with one-line errors."""
    from mlx_lm.utils import sharded_load

    local = Path(path_or_repo).expanduser()
    source = str(local) if local.exists() else path_or_repo  # a Hub id: each rank fetches its files
    try:
        return sharded_load(source, pipeline_group=mx.distributed.init() if pipeline else None,
                            tokenizer_config={"trust_remote_code": True, **({"chat_template": chat_template} if chat_template else {})})
    except FileNotFoundError as e:
        raise DFlashError(
            f"could not load the target shard from {path_or_repo}: {e}; pipeline loading needs "
            "model.safetensors.index.json (which layer is in which file): save the model with mlx_lm.convert"
        ) from None
    except (ValueError, AssertionError) as e:
        text = str(e)
        if "not support pipelining" in text:
            raise DFlashError("mlx_lm cannot pipeline this target: drop --pipeline to shard it tensor parallel") from None
        if "not support any sharding" in text:
            raise DFlashError(
                "mlx_lm cannot shard this target across ranks: run it on one machine, or pick a target "
                "mlx_lm shards (llama, qwen2, qwen3, qwen3_5, deepseek, ...)"
            ) from None
        raise DFlashError(f"could not shard the target {path_or_repo} over {size} ranks: {text}") from None


def _full_head(model: nn.Module, path_or_repo: str) -> nn.Module | None:
    """The whole output head where tensor parallelism split it by vocabulary (qwen3_5), else None.

    The drafter scores every token on rank 0 alone, so rank 0 reads the head once
    more, whole; the rest of the checkpoint stays unread (lazy loading).
    """
    from mlx_lm.utils import load_model

    text = getattr(model, "language_model", model)
    head = getattr(text, "lm_head", None)
    if head is None or head.weight.shape[0] == text.args.vocab_size:
        return None
    full, _ = load_model(resolve(path_or_repo, "model"), lazy=True, strict=False)
    full_head = getattr(full, "language_model", full).lm_head
    mx.eval(full_head.parameters())
    return full_head
