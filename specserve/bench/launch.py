"""Servers a benchmark starts and stops: llama.cpp's `llama-server` and `specserve serve` on the same GGUF, each
on a free local port with the same threads, ready when GET /health answers 200.

llama-server configurations (the peer of `bench real` and `bench serving`):
  llama-server          plain decoding
  llama-server+draft    --spec-type draft-simple with the draft model (-md) of --speculative-draft-model-path
  llama-server+ngram    --spec-type ngram-mod (n-gram lookup over the context)
Everything else is llama-server's default. The binary is .venv/bin/llama-server (`scripts/setup.sh
llamacpp-server` builds it) or the first on PATH.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NOTE: stdlib only: bench/real.py's child processes import this module

LLAMA_SERVER_CONFIGS: dict[str, tuple[str, ...]] = {
    "llama-server": (),
    "llama-server+draft": ("--spec-type", "draft-simple"),
    "llama-server+ngram": ("--spec-type", "ngram-mod"),
}


def is_llama_server(name: str) -> bool:
    return name in LLAMA_SERVER_CONFIGS


def llama_server_binary() -> str:
    venv = Path(sys.executable).parent / "llama-server"
    found = str(venv) if venv.exists() else shutil.which("llama-server")
    if found is None:
        raise FileNotFoundError("llama-server is not built: run `scripts/setup.sh llamacpp-server` (it builds "
                                ".venv/bin/llama-server from the llama.cpp source llama-cpp-python ships)")
    return found


def llama_server_argv(name: str, model: str, port: int, threads: int, draft: str | None = None,
                      parallel: int = 1, ctx: int = 4096) -> list[str]:
    """The command line of configuration `name`: `parallel` slots of `ctx` tokens each."""
    if name not in LLAMA_SERVER_CONFIGS:
        raise ValueError(f"unknown llama-server configuration {name!r}; choose one of {', '.join(LLAMA_SERVER_CONFIGS)}")
    argv = [llama_server_binary(), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-c", str(ctx * parallel), "-np", str(parallel), *LLAMA_SERVER_CONFIGS[name]]
    if name == "llama-server+draft":
        if not draft:
            raise ValueError("llama-server+draft needs a draft model: --speculative-draft-model-path")
        argv += ["-md", draft, "-td", str(threads), "-tbd", str(threads)]
    return argv


def specserve_argv(model: str, port: int, threads: int, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "specserve.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--num-threads", str(threads), *flags]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launched:
    """A started server: its process, base URL, seconds from start to a 200 from /health, and its log."""

    proc: subprocess.Popen
    url: str
    ready_s: float
    log: Path

    def peak_rss_gib(self) -> float:
        """The server process's high-water resident set (VmHWM)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20

    def post(self, path: str, body: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Launched":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch(argv: list[str], port: int, env: dict[str, str] | None = None, timeout: float = 900) -> Launched:
    """Start `argv` (listening on `port`) and wait until GET /health answers 200; a server that exits first, or
    is not ready within `timeout` seconds, raises with the tail of its log."""
    log = Path(tempfile.mkstemp(prefix="bench-server-", suffix=".log")[1])
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{Path(argv[0]).name} exited ({proc.returncode}) before it was ready:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return Launched(proc, url, time.perf_counter() - t0, log)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{Path(argv[0]).name} was not ready in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
