#!/usr/bin/env bash
# The n-gram table's scaling curves (docs/training.md), held-out τ (K = 4) vs data:
#   SIZES   human text: tables from the first N training conversations (plus REGEN regenerated answers,
#           default 0) into $OUT/ngram-N
#   REGENS  the target's own answers: tables from every training conversation plus the target's greedy answers
#           to the first R of their first turns (cached by build-ngram-table: only the first run generates)
#           into $OUT/ngram-regen-R
# Each prints the table's size and its held-out τ.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ngram-scaling}
for n in ${SIZES-650 1300 2600 5200 10488}; do
  .venv/bin/specserve build-ngram-table --target smollm2-135m --max-conversations "$n" --regen-prompts "${REGEN:-0}" \
    --out "$OUT/ngram-$n" | grep -E "table:|heldout_tau"
done
for r in ${REGENS-}; do
  .venv/bin/specserve build-ngram-table --target smollm2-135m --regen-prompts "$r" --out "$OUT/ngram-regen-$r" \
    | grep -E "regenerated:|table:|heldout_tau"
done
