#!/usr/bin/env bash
# Set up (idempotent), lint, and run the whole test suite, slow end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
. .venv/bin/activate
ruff check specserve tests bench scripts   # the rules: pyproject.toml [tool.ruff]
exec python -m pytest -q "$@"
