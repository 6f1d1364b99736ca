"""Convert a drafter to 4-bit MLX once, then generate with it.

The converter writes a temporary folder next to the destination and moves it into place only once
it loads back and runs; the drafter keeps its released layout (config.json with dflash_config).

    python examples/convert_4bit.py --draft z-lab/Qwen3-8B-DFlash-b16 --model Qwen/Qwen3-8B --out qwen3-8b-dflash-4bit
"""

import argparse
from pathlib import Path

import dflash_mlx
from dflash_mlx.convert import convert
from dflash_mlx.default import default_pair

parser = argparse.ArgumentParser()
parser.add_argument("--model")
parser.add_argument("--draft")
parser.add_argument("--out", default="drafter-4bit")
parser.add_argument("--max-tokens", type=int, default=64)
args = parser.parse_args()

model_path, draft_path = (args.model, args.draft) if args.model else default_pair()
if not Path(args.out).exists():
    result = convert(draft_path, args.out, quantize=True, q_bits=4, q_group_size=32)
    print(f"converted: {result.bits_per_weight:.2f} bits per weight, {result.size_bytes / 2**20:.1f} MiB")

model, tokenizer = dflash_mlx.load(model_path, args.out)
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 times 7?"}], add_generation_prompt=True)
# Greedy output is the target's own whatever the drafter's precision: quantizing changes only tau.
print(dflash_mlx.generate(model, tokenizer, prompt, max_tokens=args.max_tokens, verbose=True))
