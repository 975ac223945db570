"""Replicas behind SGLang's router (PyPI `sglang-router`, a Rust load balancer) on loopback, as docs/server.md
("Replicas behind a router") runs them: the router registers each replica through /health, /server_info and
/model_info under its served model name, spreads requests round robin, and when a replica is SIGKILLed in the
middle of a batch it re-sends that replica's non-streamed requests to the survivor (a stream already under way
is cut), takes the dead replica out on its health check, keeps serving, and takes it back once restarted.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
import sglang_router  # noqa: F401  (in the test extra: without it this module fails, it is never skipped)

from tests.server_fixtures import SPEC, model_dir  # noqa: F401  (fixture)
from tests.server_utils import ServerThread, free_port

# The recipe's router flags (docs/server.md). Health checks every second, a replica out after two failures.
# Retries back off 0.1 + 0.2 + ... + 3.2 s: a request that failed on a dead replica keeps retrying until after
# the health check has taken that replica out (concurrent retries can draw the dead replica more than once).
ROUTER_FLAGS = ["--policy", "round_robin", "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                "--worker-startup-check-interval", "1", "--retry-max-retries", "7",
                "--retry-initial-backoff-ms", "100", "--retry-backoff-multiplier", "2"]


class Proc:
    """A subprocess in its own process group, its output in a log file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with open(log, "w") as f:
            self.p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self) -> str:
        return f"--- {self.log.name} ---\n" + self.log.read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        """SIGKILL the whole group (children too), then reap the leader."""
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(30)

    def live_group(self) -> list[int]:
        """Processes of the group still alive (zombies excluded: they are already dead)."""
        pids = []
        for d in Path("/proc").iterdir():
            try:
                state, _ppid, pgrp = (d / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            except (OSError, ValueError):
                continue
            if int(pgrp) == self.p.pid and state != "Z":
                pids.append(int(d.name))
        return pids


class Router(Proc):
    def __init__(self, worker_urls: list[str], tmp: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        super().__init__([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
                          "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *ROUTER_FLAGS],
                         tmp / "router.log")

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["url"]: w for w in httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]}

    def wait_health(self, want: dict[str, bool], timeout: float, procs: list[Proc]) -> None:
        wait_for(lambda: {u: w["is_healthy"] for u, w in self.workers().items()} == want, timeout,
                 f"router's workers {want}", procs)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Everything a test starts; all of it is killed at teardown, and nothing may outlive that."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()
    assert {p.log.name: p.live_group() for p in started if p.live_group()} == {}


def wait_for(pred: Callable[[], bool], timeout: float, what: str, procs: list[Proc]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (httpx.HTTPError, ValueError):  # not listening yet, or an empty body while it starts
            pass
        time.sleep(0.02)
    raise AssertionError(f"no {what} after {timeout:.0f} s\n" + "\n".join(p.tail() for p in procs))


def metric(url: str, name: str) -> float:
    """A Prometheus series of /metrics, summed over its labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def finished(url: str) -> float:
    return metric(url, "specserve:request_success_total")


def client(url: str) -> openai.OpenAI:
    # no client retries: what is retried here, the router retried
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def chat(c: openai.OpenAI, content: str, max_tokens: int, **kw: Any) -> Any:
    return c.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                     max_tokens=max_tokens, temperature=0, **kw)


def test_router_registers_replicas_by_served_name_and_round_robins(model_dir: str, tmp_path: Path,  # noqa: F811
                                                                   procs: list[Proc],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Two in-process replicas of the tiny model: the router finds /server_info and /model_info (no 404), lists
    the replicas under their served name (without /server_info's served_model_name: "unknown"), alternates
    between them, and its rewritten bodies draw no "ignoring unknown request fields" warning."""
    reps = [ServerThread(model_dir, **SPEC).start() for _ in range(2)]
    try:
        router = Router([r.url for r in reps], tmp_path)
        procs.append(router)
        router.wait_health({r.url: True for r in reps}, 60, procs)
        assert {w["model_id"] for w in router.workers().values()} == {"tiny"}
        assert [m["id"] for m in httpx.get(f"{router.url}/v1/models").json()["data"]] == ["tiny"]
        assert "returned 404" not in router.log.read_text()
        assert httpx.get(f"{reps[0].url}/model_info").json() == {"model_path": model_dir, "tokenizer_path": None,
                                                                 "is_generation": True}
        before = [finished(r.url) for r in reps]
        c = client(router.url)
        with caplog.at_level(logging.WARNING, logger="specserve.server"):
            texts = [chat(c, "w9 w8", 4).choices[0].message.content for _ in range(4)]
            assert [finished(r.url) - b for r, b in zip(reps, before)] == [2, 2]
            g = httpx.post(f"{router.url}/generate", timeout=60,
                           json={"text": "w1 w2", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
        assert len(set(texts)) == 1 and len(g["output_ids"]) == 4
        assert not [r.getMessage() for r in caplog.records if "ignoring unknown" in r.getMessage()]
        # the same fields at other values are not no-ops: still reported
        with caplog.at_level(logging.WARNING, logger="specserve.server"):
            chat(client(reps[0].url), "w9", 2, extra_body={"no_stop_trim": True, "separate_reasoning": True})
        assert [r.getMessage() for r in caplog.records if "ignoring unknown" in r.getMessage()] == \
            ["ignoring unknown request fields: no_stop_trim"]
    finally:
        for r in reps:
            r.stop()


def _open_stream(c: openai.OpenAI) -> Iterator[Any]:
    it = iter(chat(c, "Tell me a story.", 200, stream=True, extra_body={"ignore_eos": True}))
    next(it)  # the first chunk: the router has picked this stream's replica
    return it


def _drain(it: Iterator[Any]) -> str:
    """The stream's finish_reason, or "cut" when the connection dies under it."""
    reason = "none"
    try:
        for ch in it:
            if ch.choices and ch.choices[0].finish_reason:
                reason = ch.choices[0].finish_reason
    except (openai.APIConnectionError, httpx.TransportError):
        return "cut"
    return reason


@pytest.mark.slow
def test_replica_killed_mid_batch(tmp_path: Path, procs: list[Proc]) -> None:
    """Two `specserve serve` replicas of SmolLM2 behind the router; one is SIGKILLed while it runs a stream and
    three non-streamed requests. The three are re-sent to the survivor and complete in full, the stream is cut
    (the survivor's completes), the router marks the dead replica unhealthy, later requests all succeed, and
    the replica, restarted, rejoins."""
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]

    def replica(url: str, log: str) -> Proc:
        return Proc([sys.executable, "-m", "specserve.cli", "serve", "--port", url.rsplit(":", 1)[1],
                     "--speculative-algorithm", "NGRAM", "--num-threads", "1", "--kv-cache-memory", "64MB",
                     "--log-interval", "0"], tmp_path / log)

    procs.extend(replica(u, f"replica{i}.log") for i, u in enumerate(urls))
    router = Router(urls, tmp_path)
    procs.append(router)
    router.wait_health(dict.fromkeys(urls, True), 300, procs)
    c = client(router.url)

    before = [finished(u) for u in urls]
    texts = [chat(c, "Hi!", 8).choices[0].message.content for _ in range(4)]
    assert [finished(u) - b for u, b in zip(urls, before)] == [2, 2] and len(set(texts)) == 1

    victim, (survivor, dead) = procs[1], urls
    base = finished(survivor)
    streams = [_open_stream(c) for _ in range(2)]  # opened one after the other: one per replica
    with cf.ThreadPoolExecutor(8) as pool:
        batch = [pool.submit(chat, c, "Tell me a story.", 64, extra_body={"ignore_eos": True}) for _ in range(6)]
        ends = [pool.submit(_drain, s) for s in streams]
        # the victim runs its stream and its 3 of the 6: all four mid-generation when it dies
        wait_for(lambda: metric(dead, "specserve:num_requests_running") == 4, 60, "4 requests on the victim", procs)
        os.kill(victim.p.pid, signal.SIGKILL)
        results = [f.result() for f in batch]
        reasons = sorted(f.result() for f in ends)
    assert [(r.choices[0].finish_reason, r.usage.completion_tokens) for r in results] == [("length", 64)] * 6
    assert reasons == ["cut", "length"]
    router.wait_health({survivor: True, dead: False}, 30, procs)
    assert {chat(c, f"Count to {i}.", 8).choices[0].finish_reason for i in range(6)} <= {"stop", "length"}
    # all on the survivor: its stream, the whole batch (the victim's 3 re-sent to it), the 6 after
    assert finished(survivor) - base == 1 + 6 + 6

    # restarted on its port, the replica is healthy again once loaded and back in the rotation
    procs.append(replica(dead, "replica1-restarted.log"))
    router.wait_health(dict.fromkeys(urls, True), 300, procs)
    base = finished(survivor)
    assert len({chat(c, "Hi!", 8).choices[0].message.content for _ in range(2)} | set(texts)) == 1
    assert (finished(survivor) - base, finished(dead)) == (1, 1)
