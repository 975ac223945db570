#!/usr/bin/env bash
# The prefill-data drafter runs for SmolLM2-135M-Instruct (docs/training.md, "Prefill data"): one feature
# pass labels whole ShareGPT conversations into fp16 shards; DSpark and EAGLE-3 train on the shards
# that exist (picking up new ones each epoch). Every stage resumes where it stopped: rerun the same line.
#   scripts/train_prefill.sh features|dspark|dspark-ft|eagle3|eagle3-ft      (each in the background: nohup ... &)
# dspark-ft / eagle3-ft fine-tune the shipped DSpark / EAGLE-3 on these labels (a run carried on from an earlier one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-/work/train-data/smollm2}
# Labels in w4a8: the precision the default `serve` verifies in (models.default_quantization).
COMMON=(--target smollm2-135m --work-dir "$WORK" --max-len 768 --label-quantization w4a8 --threads "${THREADS:-1}")
case "$1" in
  features) exec nice -n 19 "$PY" -m specserve.cli train-drafter --algorithm dspark --out "$WORK/unused" "${COMMON[@]}" \
              --stage features --feature-tokens 1500000 --shard-tokens 16384 ;;
  dspark)   exec nice -n 19 "$PY" -m specserve.cli train-drafter --algorithm dspark --out "$WORK/out/dspark" "${COMMON[@]}" \
              --stage train --steps 280 --batch-tokens 8192 --num-anchors 96 --lr 1e-3 --draft-vocab-size 16384 \
              --block-size 8 --gamma 4 --checkpoint-minutes 10 --checkpoint-every 1000000 ;;
  dspark-ft) exec nice -n 19 "$PY" -m specserve.cli train-drafter --algorithm dspark --out "$WORK/out/dspark-ft" "${COMMON[@]}" \
              --stage train --init-from specserve/drafters/shipped/smollm2-135m-dspark --steps 200 --batch-tokens 8192 \
              --num-anchors 96 --lr 5e-4 --gamma 4 --checkpoint-minutes 10 --checkpoint-every 1000000 ;;
  eagle3)   exec nice -n 19 "$PY" -m specserve.cli train-drafter --algorithm eagle3 --out "$WORK/out/eagle3" "${COMMON[@]}" \
              --stage train --steps 98 --batch-tokens 8192 --lr 1e-3 --draft-vocab-size 8192 --ttt-steps 4 --freeze-head \
              --checkpoint-minutes 10 --checkpoint-every 12 ;;
  eagle3-ft) exec nice -n 19 "$PY" -m specserve.cli train-drafter --algorithm eagle3 --out "$WORK/out/eagle3-ft" "${COMMON[@]}" \
              --stage train --init-from specserve/drafters/shipped/smollm2-135m-eagle3 --steps 49 --batch-tokens 8192 \
              --lr 5e-4 --ttt-steps 4 --checkpoint-minutes 10 --checkpoint-every 12 ;;
  *) echo "usage: $0 features|dspark|dspark-ft|eagle3|eagle3-ft" >&2; exit 2 ;;
esac
