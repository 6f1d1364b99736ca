"""Command-line flags shared by the subcommands, named like mlx_lm's and like the Python arguments."""

from __future__ import annotations

import argparse
import math

from .errors import DFlashError


def block_size_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a block size: give an integer or 'auto'") from None


def tree_budget_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a tree budget: give an integer >= 0 or 'auto'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a tree budget: give an integer >= 0 or 'auto'")
    return value


def draft_window_arg(text: str) -> tuple[int, int] | str | None:
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        keep, recent = (int(x) for x in text.split(":"))
        return keep, recent
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEEP:RECENT (e.g. 16:256), auto or none") from None


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


# Size suffixes: mlx_lm.server's (M, G, MB, GB: powers of ten) and binary ones.
_SIZE_UNITS = {"": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
               "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def byte_size(text: str) -> int:
    """A positive number of bytes: 123, 500M, 8GB, 10GiB."""
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number):].strip().upper()
    try:
        value = int(float(number) * _SIZE_UNITS[unit])
    except (ValueError, KeyError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, e.g. 500000000, 500M, 8GB or 10GiB") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return value


def port_arg(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port: use 0..65535 (0: any free port)")
    return value


INT64 = (-(2**63), 2**63 - 1)  # the seeds the OpenAI API allows


def mlx_seed(seed: int) -> int:
    """A 64-bit signed seed (clients send -1 for "random") as MLX's unsigned one, one to one."""
    if not INT64[0] <= seed <= INT64[1]:
        raise ValueError(f"seed {seed} is outside the 64-bit integer range [{INT64[0]}, {INT64[1]}]")
    return seed % 2**64


def seed_arg(text: str) -> int:
    try:
        return mlx_seed(_integer(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_pair_arguments(p: argparse.ArgumentParser, required: bool = False) -> None:
    """--model and --draft; optional ones default to the embedded SmolLM2 pair."""
    default = "" if required else " (default: the embedded SmolLM2-135M-Instruct pair)"
    p.add_argument("--model", required=required, default=None,
                   help=f"Target model: local folder or Hub repo id, anything mlx_lm loads{default}")
    p.add_argument("--draft", required=required, default=None,
                   help=f"DFlash drafter: local folder or Hub repo id{default}")


def resolve_pair(args: argparse.Namespace) -> None:
    """Fill in the embedded default pair when neither --model nor --draft was given."""
    if (args.model is None) != (args.draft is None):
        raise DFlashError("pass both --model and --draft, or neither for the embedded default pair")
    if args.model is None:
        from .default import default_pair

        args.model, args.draft = default_pair()


def add_sampling_arguments(p: argparse.ArgumentParser, temp_help: str = "Sampling temperature (0: greedy)") -> None:
    p.add_argument("--temp", type=finite_float, default=0.0, help=temp_help)
    p.add_argument("--top-p", type=finite_float, default=1.0, help="Sampling top-p")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="Sampling top-k (0: off)")
    p.add_argument("--min-p", type=finite_float, default=0.0, help="Sampling min-p (0: off)")


# Seeded rejection sampling's fixed block (capped at the drafter's; DFlash2 drafters, whose picks
# are not coupled): on the built-in pair it sampled faster than the drafter's 8 on every dataset.
SEEDED_BLOCK_SIZE = 4


def default_block_size(block_size: int | str | None, temp: float, seeded: bool, drafter_block_size: int,
                       coupled: bool = True) -> int | str:
    """``--block-size`` (or ``block_size=``) as given, else auto. Coupled sampling commits the same
    text at every block size, so a seed survives auto's timing-based choices; rejection sampling's
    draws follow the block sizes, so a ``seeded`` run without coupling (``coupled=False``) takes a
    fixed ``SEEDED_BLOCK_SIZE``."""
    if block_size is not None:
        return block_size
    if temp > 0 and seeded and not coupled:
        return min(SEEDED_BLOCK_SIZE, drafter_block_size)
    return "auto"


def add_block_arguments(p: argparse.ArgumentParser) -> None:
    """Block-size and drafter-window flags."""
    p.add_argument("--block-size", type=block_size_arg, default=None,
                   help="Tokens per draft block; 'auto' adapts it per step, up to the drafter's block size, "
                        "from the measured verify cost and the running acceptance (default: auto; a seeded "
                        "sampled run with a DFlash2 drafter takes 4, at most the drafter's, since its draws "
                        "follow the block sizes)")
    p.add_argument("--tree-budget", type=tree_budget_arg, default="auto", metavar="N|auto",
                   help="Proposals per draft tree (the drafter's likeliest branches and the copies, verified in "
                        "one target forward); 'auto' picks it per step from the measured cost and acceptance "
                        "(default), 0 verifies a single chain")
    p.add_argument("--draft-window", type=draft_window_arg, default="auto", metavar="KEEP:RECENT|auto|none",
                   help="The drafter's context: its first KEEP and last RECENT rows; auto (default): the window "
                        "the drafter records (dflash_config.draft_window), else its sliding windows, else 16:256; "
                        "none: the whole context")
    p.add_argument("--no-copy-proposals", dest="copy_proposals", action="store_false",
                   help="Propose drafted tokens only, never tokens copied from earlier in the prompt or output")


def add_sharding_arguments(p: argparse.ArgumentParser) -> None:
    """How the target is split across the ranks of ``mlx.launch`` (ignored by a single process)."""
    p.add_argument("--pipeline", action="store_true",
                   help="Under mlx.launch: give each rank a run of the target's layers (pipeline parallel) "
                        "instead of a slice of every layer (tensor parallel, the default where mlx_lm can)")
