#!/usr/bin/env bash
# How the shipped default drafter (dflash_mlx/default_drafter/) was made, and how it was benchmarked.
# One seeded training command; the target's answers are regenerated greedily by the target itself
# (3 h on a 2-core x86 CPU): benchmarks/data/smollm2_answers.jsonl.gz holds them, and unpacked into
# $OUT/data.jsonl first (benchmarks/data/README.md) it skips that.
# RANKS=2 trains on two local ranks, one per core, each with one OpenBLAS thread (docs/training.md):
# the same drafter as one process up to float rounding. The shipped weights were trained so, with
# the ranks started by hand (docs/sharding.md: mlx.launch spins a core).
set -euo pipefail
OUT=${OUT:-runs/smollm2-drafter}
LAUNCH=()
if [ "${RANKS:-1}" -gt 1 ]; then
  LAUNCH=(mlx.launch -n "$RANKS" --backend ring --)
  export OPENBLAS_NUM_THREADS=1
fi

# 1. Train (target: the embedded SmolLM2-135M-Instruct, converted on first use).
#    2 layers: predicting the token after the anchor needs one layer to move the anchor into the
#    mask rows and a second to look it up in the context. The draft vocabulary (8192 ids) cuts the
#    head, most of a draft's and of a training step's cost on this target. The texts (Python manual
#    pages and source files, read teacher-forced) and the window it decodes with (16:256) teach it
#    to draft after long prompts.
"${LAUNCH[@]}" dflash-mlx train --out "$OUT" --prompts gsm8k stdlib sharegpt --num-prompts "${NUM_PROMPTS:-3516}" \
  --texts docs code --num-texts 240 --draft-window 16:256 \
  --max-response-tokens 256 --gen-batch-size 32 --num-layers 2 --target-layer-ids 2 15 28 \
  --draft-vocab-size 8192 --init target --block-size 8 --steps "${STEPS:-4000}" --batch-seqs 4 \
  --anchors 32 --lr 1e-3 --save-every 100 --eval-prompts 4 --eval-max-tokens 96 --seed 0 --resume

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
