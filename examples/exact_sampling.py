"""A custom sampler and a logits processor with DFlash, and why the output stays exact.

Logits processors (here mlx_lm's repetition penalty) are applied to every verified row with that
row's own token history, so greedy decoding with a processor is token for token what mlx_lm
produces with the same processor. A custom sampler is any logprobs -> token function: each target
row is sampled with it and a drafted token is kept only if it equals that sample, so the output
follows the sampler's distribution exactly (fewer drafts are accepted than with `temp`/`top_p`,
whose distributions are known and verified by rejection sampling).

    python examples/exact_sampling.py [--model M --draft D]
"""

import argparse

import mlx.core as mx
from mlx_lm import generate as mlx_lm_generate
from mlx_lm.sample_utils import make_repetition_penalty

import dflash_mlx
from dflash_mlx.default import default_pair

parser = argparse.ArgumentParser()
parser.add_argument("--model")
parser.add_argument("--draft")
parser.add_argument("--max-tokens", type=int, default=64)
args = parser.parse_args()

model_path, draft_path = (args.model, args.draft) if args.model else default_pair()
model, tokenizer = dflash_mlx.load(model_path, draft_path)
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "List the planets."}], add_generation_prompt=True)

# 1. Greedy with a logits processor: identical to plain mlx_lm with the same processor.
penalty = [make_repetition_penalty(1.3, 32)]
ours = dflash_mlx.generate(model, tokenizer, prompt, max_tokens=args.max_tokens, logits_processors=penalty)
plain = mlx_lm_generate(model.target.model, tokenizer, prompt, max_tokens=args.max_tokens,
                        logits_processors=[make_repetition_penalty(1.3, 32)])
print(ours)
print("identical to mlx_lm:", ours == plain)
assert ours == plain


# 2. A sampler of your own: temperature 0.8 over the 20 likeliest tokens, written by hand.
def top20_sampler(logprobs: mx.array) -> mx.array:
    kth = mx.sort(logprobs, axis=-1)[..., -20:-19]
    masked = mx.where(logprobs >= kth, logprobs, -mx.inf)
    return mx.random.categorical(masked / 0.8)


mx.random.seed(0)
response = None
for response in dflash_mlx.stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=top20_sampler):
    print(response.text, end="", flush=True)
print(f"\ncustom sampler: tau {response.stats.tau:.2f} (each accepted draft equals the sampler's own draw)")
