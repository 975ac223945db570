#!/usr/bin/env bash
# The n-gram table's scaling curve (docs/training.md): held-out τ vs corpus size. Each size builds a table from
# the first N training conversations (and REGEN regenerated answers, default 0) into $OUT/ngram-N and prints
# its size and held-out τ (K = 4).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ngram-scaling}
for n in ${SIZES:-650 1300 2600 5200 10488}; do
  .venv/bin/specserve build-ngram-table --target smollm2-135m --max-conversations "$n" --regen-prompts "${REGEN:-0}" \
    --out "$OUT/ngram-$n" | grep -E "table:|heldout_tau"
done
