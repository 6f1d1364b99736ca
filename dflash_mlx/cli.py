"""``dflash-mlx`` command line: one subcommand per module, flags named like mlx_lm's."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import DFlashError
from .flags import add_block_arguments, add_pair_arguments, add_sampling_arguments, add_sharding_arguments, resolve_pair

# subcommand -> (module exposing add_arguments(parser) and run(args), help)
SUBCOMMANDS = {
    "generate": ("dflash_mlx.cli", "Generate text with DFlash speculative decoding"),
    "train": ("dflash_mlx.train", "Train a DFlash drafter for an mlx_lm target"),
    "benchmark": ("dflash_mlx.benchmark", "Compare mlx_lm decoding and DFlash on benchmark prompts"),
    "serve": ("dflash_mlx.server", "OpenAI-compatible HTTP server with DFlash speculative decoding"),
    "convert": ("dflash_mlx.convert", "Convert DFlash drafters, HF-layout targets and GGUF files to MLX (optionally quantized)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_pair_arguments(p)
    p.add_argument("--prompt", "-p", default="hello", help="Message for the model ('-' reads stdin)")
    p.add_argument("--system", "--system-prompt", dest="system", help="System prompt")
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="Maximum tokens to generate")
    add_sampling_arguments(p)
    p.add_argument("--seed", type=int, default=None, help="Random seed for sampling")
    add_block_arguments(p)
    add_sharding_arguments(p)
    p.add_argument("--extra-eos-token", nargs="*", default=[], help="More stop tokens (strings)")
    p.add_argument("--ignore-chat-template", action="store_true", help="Feed the prompt as-is")
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="Print stats after the text (default: True)")


def _build_prompt(tokenizer, args: argparse.Namespace) -> str:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.ignore_chat_template or tokenizer.chat_template is None:
        return prompt if args.system is None else f"{args.system}\n\n{prompt}"
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def run(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from .generation import stream_generate
    from .model import load
    from .stats import format_stats

    resolve_pair(args)
    model, tokenizer = load(args.model, args.draft, pipeline=args.pipeline)
    stop_tokens = []
    for text in args.extra_eos_token:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise DFlashError(f"--extra-eos-token {text!r} is {len(ids)} tokens: give single-token strings")
        stop_tokens.append(ids[0])
    if args.seed is not None:
        mx.random.seed(args.seed)
    response = None
    for response in stream_generate(
        model,
        tokenizer,
        _build_prompt(tokenizer, args),
        args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        block_size=args.block_size,
        stop_tokens=stop_tokens,
        draft_window=args.draft_window,
    ):
        print(response.text, end="", flush=True)
    print()
    if args.verbose:
        print("=" * 10)
        print(format_stats(response))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="dflash-mlx", description="Lossless DFlash speculative decoding for MLX."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help, add_help=False)
    command = parser.parse_args(argv[:1]).command
    # Only the chosen subcommand's module is imported: start-up stays fast and a
    # broken optional module cannot take the other subcommands down.
    module_name, help = SUBCOMMANDS[command]
    module = importlib.import_module(module_name)
    sub_parser = argparse.ArgumentParser(prog=f"dflash-mlx {command}", description=help)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    try:
        module.run(args)
    except DFlashError as e:
        # Under mlx.launch every rank may fail; say which one (only rank 0 runs past loading).
        rank = os.environ.get("MLX_RANK", "0")
        where = "" if rank == "0" else f" (rank {rank})"
        print(f"dflash-mlx {command}: error{where}: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
