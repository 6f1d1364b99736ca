"""``dflash-mlx`` command line: one subcommand per module, flags named like mlx_lm's."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import DFlashError

# subcommand -> (module exposing add_arguments(parser) and run(args), help)
SUBCOMMANDS = {
    "generate": ("dflash_mlx.cli", "Generate text with DFlash speculative decoding"),
    "train": ("dflash_mlx.train", "Train a DFlash drafter for an mlx_lm target"),
    "benchmark": ("dflash_mlx.benchmark", "Compare mlx_lm decoding and DFlash on benchmark prompts"),
    "serve": ("dflash_mlx.server", "OpenAI-compatible HTTP server with DFlash speculative decoding"),
    "convert": ("dflash_mlx.convert", "Convert DFlash drafters, HF-layout targets and GGUF files to MLX (optionally quantized)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Target model: local folder or Hub repo id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="DFlash drafter: local folder or Hub repo id (default: the embedded one)")
    p.add_argument("--prompt", "-p", default="hello", help="Message for the model ('-' reads stdin)")
    p.add_argument("--system", "--system-prompt", dest="system", help="System prompt")
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="Maximum tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p")
    p.add_argument("--top-k", type=int, default=0, help="Sampling top-k (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="Sampling min-p (0: off)")
    p.add_argument("--seed", type=int, default=None, help="Random seed for sampling")
    add_block_arguments(p)
    p.add_argument("--extra-eos-token", nargs="*", default=[], help="More stop tokens (strings)")
    p.add_argument("--ignore-chat-template", action="store_true", help="Feed the prompt as-is")
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="Print stats after the text (default: True)")


def block_size_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a block size: give an integer or 'auto'") from None


def draft_window_arg(text: str) -> tuple[int, int]:
    try:
        keep, recent = (int(x) for x in text.split(":"))
        return keep, recent
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEEP:RECENT, e.g. 64:1024") from None


def add_block_arguments(p: argparse.ArgumentParser) -> None:
    """Block-size and drafter-window flags, shared by generate and serve."""
    p.add_argument("--block-size", type=block_size_arg, default=None,
                   help="Tokens per draft block (default: the drafter's); 'auto' adapts it per step "
                        "from the measured verify cost and the running acceptance")
    p.add_argument("--draft-window", type=draft_window_arg, default=None, metavar="KEEP:RECENT",
                   help="Bound the drafter's context to the first KEEP and last RECENT tokens (long prompts)")


def _build_prompt(tokenizer, args: argparse.Namespace) -> str:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.ignore_chat_template or tokenizer.chat_template is None:
        return prompt if args.system is None else f"{args.system}\n\n{prompt}"
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def run(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from .generate import format_stats, load, stream_generate

    if (args.model is None) != (args.draft is None):
        raise DFlashError("pass both --model and --draft, or neither for the embedded default pair")
    if args.model is None:
        from .default import default_pair

        args.model, args.draft = default_pair()
    model, tokenizer = load(args.model, args.draft)
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
        print(f"dflash-mlx {command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
