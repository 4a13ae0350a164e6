#!/usr/bin/env bash
# The default EAGLE-3 head for SmolLM2, made on one CUDA GPU: features from the committed
# answers through the engine's bfloat16 model, then training under bfloat16 autocast.
# Same code and settings as the whole-data recipe in docs/training.md (3 epochs);
# only the device differs. Target: under 8 minutes on an H100/H200.
#
#   bash benchmarks/train_on_gpu.sh [OUT_DIR] [WORK_DIR]     (from the repository root)
#
# Resumable like the CPU run: stop it and start it again with the same directories.
set -euo pipefail
OUT=${1:-${TMPDIR:-/tmp}/cluster-gpu-head}
WORK=${2:-${TMPDIR:-/tmp}/cluster-gpu-work}
RESUME=()
if compgen -G "$WORK/runs/*/train_state.pt" > /dev/null; then RESUME=(--resume); fi
start=$(date +%s)
python -m cluster.cli train-draft --device cuda --out "$OUT" --work-dir "$WORK" \
    --answers-dir data/answers/smollm2-135m-instruct --num-prompts 11264 \
    --follow-up-fraction 0 --epochs "${EPOCHS:-3}" --lr 0.002 --compile --checkpoint-every 100 \
    --draft-vocab-size "${DRAFT_VOCAB:-8192}" --ttt-steps 3 "${RESUME[@]}"
echo "train_on_gpu: $(( $(date +%s) - start )) s in all; head in $OUT"
