"""Block policies side by side in one process: mlx_lm, auto as shipped, and auto that never decodes
plainly.

    python benchmarks/bench_policy.py [--num-prompts 5] [--out FILE]

Built-in pair, greedy, 128 tokens, the three benchmark datasets, one calibration shared by every
policy. For every prompt each system runs once, in an order rotated from prompt to prompt, so a
busy spell of this shared machine falls on all of them; every output is checked against mlx_lm's.
Speedups are tokens/s over mlx_lm's in the same run. "never plain" is not a policy to ship (a
drafter that accepts nothing would pay for every draft); it measures what plain decoding costs
where the policy chose it.
"""

from __future__ import annotations

import argparse

from side_by_side import report

import dflash_mlx  # before mlx: it loads OpenBLAS
from dflash_mlx.costs import costs
from dflash_mlx.default import default_pair
from dflash_mlx.policy import BlockPolicy


class NeverPlain(BlockPolicy):
    """The adaptive policy with plain decoding taken out of its options."""

    def plan(self, rows, waiting=False, head_start=False, trees=False):
        options = self._options(rows, waiting=waiting, head_start=head_start, trees=trees)
        return max(options[1:], key=lambda option: option[0])[1]

    def expects_plain(self, rows, waiting=False, trees=False) -> bool:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model, tokenizer = dflash_mlx.load(*default_pair())
    table, B = costs(model), model.block_size
    print("verify ms", {b: round(1e3 * s) for b, s in table.table.rows[1].verify.items()}, flush=True)
    policies = {  # a fresh policy per prompt, as "auto" makes
        "auto": lambda: BlockPolicy(B, table),
        "never plain": lambda: NeverPlain(B, table),
    }
    report(model, tokenizer, policies, args.num_prompts, args.out)


if __name__ == "__main__":
    main()
