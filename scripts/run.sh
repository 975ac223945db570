#!/usr/bin/env bash
# Set up (idempotent) and start the engine on the embedded default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
exec specserve chat "$@"
