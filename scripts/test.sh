#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, slow end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
. .venv/bin/activate
exec python -m pytest -q "$@"
