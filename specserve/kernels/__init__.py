"""specserve's own C++ CPU kernels, registered as torch ops under `torch.ops.specserve.*`.

Every `csrc/*.cpp` file is compiled into one extension (`torch.utils.cpp_extension.load`); each file
registers its ops with `TORCH_LIBRARY_FRAGMENT(specserve, m)`, so kernels are added one file at a
time. The build is cached in the Python environment (<venv>/specserve-kernels/<hash of the sources, flags,
torch version and checkout path>), so the one `scripts/setup.sh` makes (`python -m specserve.kernels`) serves
every later process of that environment, whatever its HOME, user or PATH (the build always runs the
environment's own ninja); `load()` builds on first use if that was skipped. NOTE: kernels pick their instruction set at run time (CPUID), never at compile time, so a cached build
stays valid when the VM's CPU kind changes.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off"]
_loaded = False


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def source_digest() -> str:
    """A digest of the kernel sources: what a timing measured with these kernels is valid for."""
    h = hashlib.sha256()
    for src in sources() + sorted(CSRC.glob("*.h")):
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    h = hashlib.sha256(source_digest().encode())
    # NOTE: the checkout's path too: two checkouts with equal sources must not share a build (its
    # build.ninja names their paths: each would rebuild the other's, and a killed build leaves a lock)
    h.update(" ".join(CFLAGS).encode() + torch.__version__.encode() + str(CSRC.resolve()).encode())
    d = cache_root() / h.hexdigest()[:16]
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_root() -> Path:
    """SPECSERVE_KERNEL_CACHE; else the environment's own folder (sys.prefix: a build made by setup is found by
    every later process, also one started with another HOME); else, where the environment is not writable (a
    system Python), ~/.cache/specserve/kernels."""
    if "SPECSERVE_KERNEL_CACHE" in os.environ:
        return Path(os.environ["SPECSERVE_KERNEL_CACHE"])
    env = Path(sys.prefix) / "specserve-kernels"
    if os.access(env if env.exists() else sys.prefix, os.W_OK):
        return env
    return Path.home() / ".cache" / "specserve" / "kernels"


def load(verbose: bool = False) -> None:
    """Build (once) and load the extension; afterwards the ops are under torch.ops.specserve."""
    global _loaded
    if _loaded:
        return
    from torch.utils.cpp_extension import load as _load

    # NOTE: the environment's own ninja, whatever PATH says: torch runs the first `ninja` on PATH, and two ninja
    # versions (the venv's 1.13, Debian's 1.11) do not read each other's build log, so a process started
    # without the venv activated rebuilt every kernel setup had built (and setup then rebuilt them again)
    path = os.environ.get("PATH", "")
    env_bin = str(Path(sys.executable).parent)
    if (Path(env_bin) / "ninja").exists():
        os.environ["PATH"] = env_bin + os.pathsep + path
    try:
        _load(name="specserve_kernels", sources=[str(s) for s in sources()], extra_cflags=CFLAGS,
              extra_ldflags=["-fopenmp"], build_directory=str(build_dir()), is_python_module=False, verbose=verbose)
    finally:
        os.environ["PATH"] = path
    _loaded = True
