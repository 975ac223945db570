"""Run the real HTTP server on a free loopback port, in a thread of the test process, over a tiny
random model (fp64, word-level tokenizer "w0".."w96", a toy chat template)."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from specserve.config import EngineConfig
from specserve.server.app import create_app
from specserve.server.config import ServerConfig

from .tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

# roles are spelled as vocabulary words so every rendered prompt tokenizes without unknowns
CHAT_TEMPLATE = ("{% for m in messages %}{{ {'system': 'w1', 'user': 'w2', 'assistant': 'w3'}.get(m['role'], 'w4') }} "
                 "{{ m['content'] }} w5 {% endfor %}{% if add_generation_prompt %}w3{% endif %}")


def make_tiny_dir(path: Path) -> str:
    cfg = tiny_config("llama")
    d = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=1), path)
    (Path(d) / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn in a daemon thread; `url` is its base address."""

    def __init__(self, model_dir: str, engine_factory: Callable[[], Any] | None = None, api_key: str | None = None,
                 server_options: dict[str, Any] | None = None, **engine_options: Any) -> None:
        import uvicorn

        opts = {"dtype": "float64", "kv_cache_memory": "16MB", "seed": 0, **engine_options}
        self.config = EngineConfig.from_sources({"model": model_dir, **opts}, environ={})
        port = free_port()
        scfg = ServerConfig(port=port, api_key=api_key, served_model_name="tiny", log_interval=0, **(server_options or {}))
        factory = engine_factory(self.config) if engine_factory else None
        app = create_app(self.config, scfg, engine_factory=factory)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.url = f"http://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, wait_ready: bool = True, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        if wait_ready:
            wait_healthy(self.url, deadline - time.monotonic())
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy after {timeout:.0f} s")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (model_name label dropped)."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            out[key.replace('model_name="tiny",', "").replace('{model_name="tiny"}', "")
                .replace(',model_name="tiny"', "")] = float(val)
    return out


def sse_events(text: str) -> list[str]:
    """Split an SSE body; asserts the framing: every event is `data: ...` ended by a blank line."""
    assert text.endswith("\n\n"), text[-50:]
    events = text[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e
    return [e[len("data: "):] for e in events]
