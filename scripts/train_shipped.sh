#!/usr/bin/env bash
# Reproduce the drafters shipped in specserve/drafters/shipped/ (SmolLM2-135M-Instruct targets).
# `ngram` rebuilds the corpus n-gram table (~1 hour the first time, generating the target's answers; then ~2
# minutes from their cache); the learned drafters train for hours.
# Both runs share one work dir (regenerated ShareGPT responses + cached target features) and resume
# from their checkpoints if interrupted. On the 2-core CPU VM they ran side by side, one thread each.
# The shipped DSpark and EAGLE-3 are these base runs fine-tuned on w4a8-labelled prefill data: then
#   scripts/train_prefill.sh features; scripts/train_prefill.sh dspark-ft (or eagle3-ft)
# and copy $WORK/out/dspark-ft (eagle3-ft) over the shipped artifact (docs/training.md, model cards).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-$HOME/.cache/specserve/train/smollm2-135m}
OUT=specserve/drafters/shipped
COMMON=(--data regen --target smollm2-135m --work-dir "$WORK" --num-prompts 880 --max-len 640 --batch-tokens 2048 --threads "${THREADS:-1}")
case "${1:-all}" in
  ngram|all) .venv/bin/specserve build-ngram-table --target smollm2-135m --out $OUT/smollm2-135m-ngram ;;&
  dspark|all) .venv/bin/specserve train-drafter --algorithm dspark --out $OUT/smollm2-135m-dspark "${COMMON[@]}" \
                --draft-vocab-size 16384 --block-size 8 --num-anchors 64 --gamma 4 --lr 1e-3 --steps 900 ;;&
  eagle3|all) .venv/bin/specserve train-drafter --algorithm eagle3 --out $OUT/smollm2-135m-eagle3 "${COMMON[@]}" \
                --draft-vocab-size 8192 --ttt-steps 4 --lr 1e-3 --steps 170 ;;
esac
