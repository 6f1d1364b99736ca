#!/usr/bin/env bash
# Train a small DFlash drafter for your own mlx_lm target, then decode with it.
#
#   bash examples/train_drafter.sh path/to/mlx-target my-drafter
#
# The target answers the prompts itself (so the drafter learns *its* distribution), its hidden
# states are cached in my-drafter/cache, and a held-out tau is printed at the end. Reruns with a
# larger --num-prompts reuse what is there. Sizes below are for a quick first try; see
# benchmarks/default_drafter.sh for the settings of the built-in drafter.
set -euo pipefail
TARGET=${1:?usage: train_drafter.sh TARGET OUT}
OUT=${2:?usage: train_drafter.sh TARGET OUT}
# PROMPTS: prompt sources (gsm8k, sharegpt, stdlib, a .txt or .jsonl file), as `dflash-mlx train --prompts`.
NUM_PROMPTS=${NUM_PROMPTS:-200}
STEPS=${STEPS:-300}

dflash-mlx train --model "$TARGET" --out "$OUT" --prompts ${PROMPTS:-gsm8k stdlib} \
    --num-prompts "$NUM_PROMPTS" --eval-prompts 4 --num-layers 2 --block-size 8 \
    --steps "$STEPS" --max-response-tokens 128 --eval-max-tokens 64 ${TRAIN_EXTRA:-}

dflash-mlx generate --model "$TARGET" --draft "$OUT" --prompt "What is 15% of 80?" --max-tokens 64
