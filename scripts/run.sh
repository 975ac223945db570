#!/usr/bin/env bash
# Set up (idempotent) and start the OpenAI-compatible server on the embedded default model
# (SmolLM2-135M-Instruct) at http://127.0.0.1:30000. Extra arguments go to `specserve serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
exec specserve serve "$@"
