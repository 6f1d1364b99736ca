"""Stream a DFlash generation token by token with the Python API, then print its acceptance stats.

    python examples/stream_generate.py                      # the built-in SmolLM2 pair
    python examples/stream_generate.py --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16
"""

import argparse

import dflash_mlx
from dflash_mlx.default import default_pair

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="target (default: the built-in SmolLM2-135M-Instruct)")
parser.add_argument("--draft", help="its DFlash drafter")
parser.add_argument("--prompt", default="Write a haiku about the sea.")
parser.add_argument("--max-tokens", type=int, default=128)
args = parser.parse_args()

model_path, draft_path = (args.model, args.draft) if args.model else default_pair()
model, tokenizer = dflash_mlx.load(model_path, draft_path)

messages = [{"role": "user", "content": args.prompt}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)

for response in dflash_mlx.stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens):
    print(response.text, end="", flush=True)
print()

stats = response.stats
print(f"{response.generation_tokens} tokens at {response.generation_tps:.1f} tokens/s, "
      f"tau {stats.tau:.2f} tokens per target forward, histogram {stats.histogram()}")
