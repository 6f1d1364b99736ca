#!/usr/bin/env bash
# How the shipped default drafter (dflash_mlx/default_drafter/) was made, and how it was benchmarked.
# One seeded training command; the target's answers are regenerated greedily by the target itself.
# On an idle machine let OpenBLAS use every core; on a CPU shared with other jobs
# OPENBLAS_NUM_THREADS=1 is faster (measured: 15-22 s vs 33-35 s for the same hidden-state pass).
set -euo pipefail
OUT=${OUT:-runs/smollm2-drafter}

# 1. Train (target: the embedded SmolLM2-135M-Instruct, converted on first use).
#    2 layers: predicting the token after the anchor needs one layer to move the anchor into the
#    mask rows and a second to look it up in the context. The draft vocabulary (8192 ids) cuts the
#    head, most of a draft's and of a training step's cost on this target.
dflash-mlx train --out "$OUT" --prompts gsm8k stdlib sharegpt --num-prompts "${NUM_PROMPTS:-1717}" \
  --max-response-tokens 256 --gen-batch-size 32 --num-layers 2 --target-layer-ids 2 15 28 \
  --draft-vocab-size 8192 --init target --block-size 8 --steps "${STEPS:-2600}" --batch-seqs 4 \
  --anchors 32 --lr 1e-3 --save-every 100 --eval-prompts 4 --eval-max-tokens 96 --seed 0

# 2. Ship it in float16 (half the bytes; widened back to float32 in the user cache on first use).
python - "$OUT" <<'PY'
import sys
import mlx.core as mx
import dflash_mlx
from dflash_mlx.default import shipped_drafter
from dflash_mlx.models import load_drafter
from dflash_mlx.models import save_drafter
save_drafter(load_drafter(sys.argv[1]), shipped_drafter(), mx.float16)
PY

# 3. Benchmark the default pair (no model arguments) against plain mlx_lm decoding.
dflash-mlx benchmark --dataset gsm8k humaneval mt-bench --num-prompts "${BENCH_PROMPTS:-5}" \
  --max-tokens 128 --output "$OUT/benchmark.json"
