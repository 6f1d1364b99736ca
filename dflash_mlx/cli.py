"""``dflash-mlx`` command line: one subcommand per module, flags named like mlx_lm's."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import DFlashError
from .flags import (add_block_arguments, add_pair_arguments, add_sampling_arguments, add_sharding_arguments,
                    default_block_size, positive_int, resolve_pair, seed_arg)

# subcommand -> (module exposing add_arguments(parser) and run(args), help)
SUBCOMMANDS = {
    "generate": ("dflash_mlx.cli", "Generate text with DFlash speculative decoding"),
    "train": ("dflash_mlx.train", "Train a DFlash drafter for an mlx_lm target"),
    "benchmark": ("dflash_mlx.benchmark", "Compare mlx_lm decoding and DFlash on benchmark prompts"),
    "serve": ("dflash_mlx.server", "HTTP server for OpenAI and Anthropic clients with DFlash speculative decoding"),
    "convert": ("dflash_mlx.convert", "Convert DFlash drafters, HF-layout targets and GGUF files to MLX (optionally quantized)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_pair_arguments(p)
    p.add_argument("--prompt", "-p", default="hello", help="Message for the model ('-' reads stdin)")
    p.add_argument("--system", "--system-prompt", dest="system", help="System prompt")
    p.add_argument("--max-tokens", "-m", type=positive_int, default=256, help="Maximum tokens to generate")
    add_sampling_arguments(p)
    p.add_argument("--seed", type=seed_arg, default=None, help="Random seed for sampling (any 64-bit integer)")
    add_block_arguments(p)
    add_sharding_arguments(p)
    p.add_argument("--prefill-step-size", type=positive_int, default=None,
                   help="Prompt tokens per prefill forward (default: the size this machine prefills fastest, measured once)")
    p.add_argument("--extra-eos-token", nargs="*", default=[], help="More stop tokens (strings)")
    p.add_argument("--ignore-chat-template", action="store_true", help="Feed the prompt as-is")
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="Print stats after the text (default: True)")


def _utf8(text: str, what: str) -> str:
    """``text`` if it is valid Unicode (argv keeps undecodable bytes as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DFlashError(f"{what} is not valid UTF-8 (at character {e.start}); fix: pass UTF-8 text") from None
    return text


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt != "-":
        return _utf8(args.prompt, "--prompt")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DFlashError(
            f"the prompt on stdin is not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
            "fix: convert it, e.g. with iconv -t UTF-8"
        ) from None


def _build_prompt(tokenizer, args: argparse.Namespace) -> str:
    from .server.request import render_chat

    prompt = _read_prompt(args)
    system = None if args.system is None else _utf8(args.system, "--system")
    if args.ignore_chat_template or not tokenizer.has_chat_template:
        return prompt if system is None else f"{system}\n\n{prompt}"
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    try:
        return render_chat(tokenizer, messages)
    except DFlashError as e:
        fix = "drop --system or pass --ignore-chat-template" if system else "pass --ignore-chat-template"
        raise DFlashError(f"{e}; fix: {fix}") from None


def run(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from .request import couples
    from .generation import stream_generate
    from .model import load
    from .server.protocol import check_flags
    from .stats import format_stats

    check_flags(args)
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
        block_size=default_block_size(args.block_size, args.temp, args.seed is not None, model.block_size, couples(model)),
        stop_tokens=stop_tokens,
        draft_window=args.draft_window,
        copy_proposals=args.copy_proposals,
        tree_budget=args.tree_budget,
        prefill_step_size=args.prefill_step_size,
    ):
        print(response.text, end="", flush=True)
    print()
    if args.verbose:
        print("=" * 10)
        print(format_stats(response))


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 1, like every other input error."""

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(
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
    sub_parser = Parser(prog=f"dflash-mlx {command}", description=help)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    code = 0
    try:
        module.run(args)
    except DFlashError as e:
        # Under mlx.launch every rank may fail; say which one (only rank 0 runs past loading).
        rank = os.environ.get("MLX_RANK", "0")
        where = "" if rank == "0" else f" (rank {rank})"
        print(f"dflash-mlx {command}: error{where}: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    if control := sys.modules.get("dflash_mlx.distributed.control"):  # imported only by a sharded run
        control.end_process(code)
    if code:
        sys.exit(code)
