"""The kernels `scripts/setup.sh` builds serve every later process of the environment: a second process with the
same checkout (another HOME, the venv not activated) loads the cached build and compiles nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specserve import kernels

_PROBE = """
import json, os, sys, time
from specserve import kernels
d = kernels.build_dir()
before = {p.name: p.stat().st_mtime_ns for p in d.iterdir() if p.suffix in (".o", ".so")}
t = time.perf_counter()
kernels.load()
after = {p.name: p.stat().st_mtime_ns for p in d.iterdir() if p.suffix in (".o", ".so")}
print(json.dumps({"dir": str(d), "before": before, "after": after, "seconds": time.perf_counter() - t}))
"""


def test_a_second_process_loads_the_cached_build(tmp_path: Path) -> None:
    kernels.load()  # this process: built here if setup did not (the case the check below is about)
    # another HOME (a service user, a CI job) and a PATH without the venv's bin (not activated: another ninja
    # may come first, whose build log the venv's cannot read)
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env = dict(os.environ, HOME=str(tmp_path), PATH=path)
    p = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert Path(r["dir"]) == kernels.build_dir()
    assert "specserve_kernels.so" in r["before"] and r["after"] == r["before"]  # nothing recompiled or relinked
    assert not (tmp_path / ".cache" / "specserve" / "kernels").exists()
