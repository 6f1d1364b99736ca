"""Talk to `dflash-mlx serve` with the official `openai` client (pip install openai).

    dflash-mlx serve --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --port 8080 &
    python examples/openai_client.py --base-url http://127.0.0.1:8080/v1
"""

import argparse

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
parser.add_argument("--max-tokens", type=int, default=128)
args = parser.parse_args()

client = OpenAI(base_url=args.base_url, api_key="not-needed")  # checked only when serve has --api-key

# Streaming: tokens arrive as the target verifies each drafted block.
stream = client.chat.completions.create(
    model="default_model",
    messages=[{"role": "user", "content": "Name three colours of the sea."}],
    max_tokens=args.max_tokens,
    stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()

# Not streaming, sampled: temperature and top_p are honoured exactly (same distribution as the target's).
reply = client.chat.completions.create(
    model="default_model",
    messages=[{"role": "user", "content": "And one more?"}],
    max_tokens=args.max_tokens,
    temperature=0.7,
    top_p=0.9,
    seed=0,
)
print(reply.choices[0].message.content)
print(f"usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens")
