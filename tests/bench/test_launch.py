"""Servers a benchmark starts (bench/launch.py): llama-server's configurations as command lines, specserve's as
`serve` flags, readiness by /health, a server that dies first reported with its log; and, where
`scripts/setup.sh llamacpp-server` has built it, `bench real` against the real llama-server."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specserve.bench import launch
from specserve.bench.common import config_flags

GEMMA = Path.home() / ".cache" / "specserve" / "models" / "gemma-3-270m-q4_k_m.gguf"


def test_llama_server_configurations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "llama_server_binary", lambda: "llama-server")
    plain = launch.llama_server_argv("llama-server", "m.gguf", 8080, 2, parallel=8)
    assert plain == ["llama-server", "-m", "m.gguf", "--host", "127.0.0.1", "--port", "8080", "-t", "2", "-tb", "2",
                     "-c", "32768", "-np", "8"]
    draft = launch.llama_server_argv("llama-server+draft", "m.gguf", 8080, 2, "d.gguf")
    assert draft[-8:] == ["--spec-type", "draft-simple", "-md", "d.gguf", "-td", "2", "-tbd", "2"]
    assert launch.llama_server_argv("llama-server+ngram", "m.gguf", 1, 2)[-2:] == ["--spec-type", "ngram-mod"]
    with pytest.raises(ValueError, match="llama-server\\+draft needs a draft model: --speculative-draft-model-path"):
        launch.llama_server_argv("llama-server+draft", "m.gguf", 1, 2)
    with pytest.raises(ValueError, match="unknown llama-server configuration 'llama-server\\+eagle'"):
        launch.llama_server_argv("llama-server+eagle", "m.gguf", 1, 2)


def test_a_missing_llama_server_names_the_setup_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="scripts/setup.sh llamacpp-server"):
        launch.llama_server_binary()


def test_specserve_configurations_as_serve_flags() -> None:
    assert config_flags("plain", "--launch") == ["--speculative-algorithm", "NONE"]
    assert config_flags("AUTO+cost:speculative-draft-model-path=/m/d.gguf", "--launch") == [
        "--speculative-algorithm", "AUTO", "--speculative-window", "cost", "--speculative-draft-model-path", "/m/d.gguf"]
    with pytest.raises(ValueError, match="'oops' is not flag=value"):
        config_flags("NGRAM:oops", "--launch")


_SERVER = """
import http.server, sys, time
time.sleep(0.3)  # loading: /health is not up yet
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_launch_waits_for_health_and_reports_a_server_that_dies() -> None:
    port = launch.free_port()
    with launch.launch([sys.executable, "-c", _SERVER, str(port)], port, timeout=60) as srv:
        assert srv.ready_s >= 0.3 and srv.proc.poll() is None and srv.peak_rss_gib() > 0
    assert srv.proc.poll() is not None  # stopped on leaving the block
    with pytest.raises(RuntimeError, match=r"exited \(3\) before it was ready:\nno model here"):
        launch.launch([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"], launch.free_port())


@pytest.mark.slow
@pytest.mark.skipif(not (Path(sys.executable).parent / "llama-server").exists() or not GEMMA.exists(),
                    reason="needs `scripts/setup.sh llamacpp-server` and Gemma-3-270M (scripts/fetch_gemma.py)")
def test_bench_real_runs_llama_server_beside_specserve(tmp_path: Path) -> None:
    """The llama-server row of `bench real`: same token ids, its own load time and peak RSS, the baseline the
    other rows are a ratio of; llama-server's text is compared with its own plain decoding's."""
    import subprocess

    out = tmp_path / "real.json"
    p = subprocess.run([sys.executable, "-m", "specserve.cli", "bench", "real", str(GEMMA), "--configs", "llama-server",
                        "llama-server+ngram", "plain", "--num-prompts", "1", "--max-new-tokens", "8",
                        "--prefill-tokens", "64", "--output", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())["results"]
    assert r["llama-server"]["vs_baseline"] == 1.0 and len(r["llama-server"]["outputs"][0]) == 8
    assert r["llama-server"]["load_s"] > 0 and r["llama-server"]["peak_rss_gib"] > 0.1
    assert r["llama-server+ngram"]["text_equals_plain"] is True  # against llama-server plain
    assert r["plain"]["vs_baseline"] > 0 and r["plain"]["text_equals_plain"] is None
