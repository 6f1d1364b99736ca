"""The drafter's corpus, side by side in one process: mlx_lm, DFlash without the corpus, and
DFlash with corpus copies from a given shortest match.

    python benchmarks/bench_corpus.py [--min-match 4 6] [--num-prompts 5] [--out FILE]

Built-in pair, block size auto, greedy, 128 tokens, the three benchmark datasets. For every
prompt each system runs once, in an order rotated from prompt to prompt, so a busy spell of this
shared machine falls on all of them; every output is checked against mlx_lm's. Speedups are
tokens/s over mlx_lm's in the same run.
"""

from __future__ import annotations

import argparse

from side_by_side import report

import dflash_mlx  # before mlx: it loads OpenBLAS
from dflash_mlx import copying
from dflash_mlx.default import default_pair


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-match", type=int, nargs="+", default=[4, 6])
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model, tokenizer = dflash_mlx.load(*default_pair())
    tokens = model.drafter.corpus.tokens
    # A corpus index finds matches as long as its key at least (copying.corpus_index).
    corpora = {f"min match {k}": copying.CopyIndex(tokens, key_length=k) for k in args.min_match}
    systems = dict.fromkeys(["no corpus", *corpora], "auto")

    def use_corpus(system: str) -> None:
        model.drafter.corpus = corpora.get(system)

    report(model, tokenizer, systems, args.num_prompts, args.out, use_corpus)


if __name__ == "__main__":
    main()
