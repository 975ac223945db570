"""`python -m specserve.launch_server ARGS`: `specserve serve ARGS`, for people who type SGLang's
`python -m sglang.launch_server --model-path M ...` (docs/usage.md, "Coming from SGLang")."""
from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
