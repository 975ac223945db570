"""Tensor parallelism end to end, two processes over gloo on loopback: TP=2 greedy output equals TP=1
token for token (fp64 tiny models with uneven GQA/MLP/vocab splits; SmolLM2 in fp32), plain and with
NGRAM and learned drafters (EAGLE-2 trees move K/V on every rank); a killed worker fails the requests
in flight with an error naming its rank (offline and in the server, which reports unhealthy and
exits), Ctrl-C leaves no process behind, and a second "node" joins through `serve --node-rank 1`."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from specserve.core import FatalEngineError, SamplingParams
from specserve.engine.llm import LLM
from tests.server_utils import ServerThread, free_port, make_tiny_dir, wait_healthy
from tests.spec_helpers import drive
from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

pytestmark = pytest.mark.slow
UNEVEN = dict(num_heads=6, num_kv_heads=3, head_dim=8, intermediate_size=96)  # 2+1 KV groups, 64+32 channels


def _plan(seed: int, n: int = 5) -> list:
    rng = random.Random(seed)
    return [(i % 4, [rng.randrange(97) for _ in range(rng.randint(1, 30))],
             SamplingParams(temperature=0, max_tokens=rng.randint(8, 30))) for i in range(n)]


def _run(path: str, plan: list, **opts) -> tuple[list[list[int]], object]:
    """(outputs, SpecStats) of the plan: requests join mid-run, prefills are chunked."""
    with LLM(path, dtype="float64", page_size=4, max_prefill_tokens=16, **opts) as llm:
        reqs = drive(llm, plan)
        return [r.output_ids for r in reqs], llm.engine.stats


def _outputs(path: str, plan: list, **opts) -> list[list[int]]:
    return _run(path, plan, **opts)[0]


def _no_workers_left() -> bool:
    me = psutil.Process()
    return not [c for c in me.children(recursive=True) if "specserve.parallel.worker" in " ".join(c.cmdline())]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_equals_tp1_tiny_fp64(arch: str, tmp_path: Path) -> None:
    cfg = tiny_config(arch, tie_word_embeddings=arch == "llama", **UNEVEN)
    path = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=2), tmp_path / arch)
    plan = _plan(1)
    plain = _outputs(path, plan)
    assert _outputs(path, plan, tp_size=2) == plain
    if arch == "llama":
        out, stats = _run(path, plan, tp_size=2, speculative_algorithm="NGRAM")
        assert out == plain and stats.num_accepted_tokens > 0
    assert _no_workers_left()


@pytest.mark.parametrize("algo,opts", [("mtp", {}),
                                       ("eagle3", dict(speculative_eagle_topk=2, speculative_num_steps=3,
                                                       speculative_num_draft_tokens=6))])
def test_tp2_learned_drafters(trained: dict, algo: str, opts: dict) -> None:
    """The drafter runs on rank 0 (at TP=1) on rank 0's hidden states, which are the full model's: the same
    drafts, the same acceptance, the same tokens as at TP=1 (EAGLE-2 trees also move K/V on every rank)."""
    plan = _plan(2, 4)
    spec = dict(speculative_algorithm=algo.upper(), speculative_draft_model_path=str(trained["artifacts"][algo]), **opts)
    out1, stats1 = _run(trained["target"], plan, **spec)
    out2, stats2 = _run(trained["target"], plan, tp_size=2, **spec)
    assert out2 == out1 == _outputs(trained["target"], plan)
    assert stats2 == stats1 and stats1.num_accepted_tokens > 0


def test_tp2_equals_tp1_smollm2_fp32() -> None:
    prompts = ["def fibonacci(n):", "The three primary colors are", "Write a haiku about the sea.",
               "import numpy as np\n\ndef softmax(x):"]
    sp = SamplingParams(temperature=0, max_tokens=40)
    common = dict(dtype="float32", num_threads=1)

    def run(**opts) -> list[list[int]]:
        with LLM("smollm2-135m", **common, **opts) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]

    plain = run()
    assert run(tp_size=2) == plain
    assert run(tp_size=2, speculative_algorithm="NGRAM") == plain
    assert run(tp_size=2, speculative_algorithm="DSPARK", speculative_window="fixed") == plain  # the shipped drafter
    assert _no_workers_left()


def test_killed_worker_fails_requests_offline(tmp_path: Path) -> None:
    path = make_tiny_dir(tmp_path / "m")
    llm = LLM(path, dtype="float64", tp_size=2)
    eng = llm.engine
    for i in range(3):
        eng.add_request([1, 2, 3 + i], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.tp.procs[1].kill()
    t = time.monotonic()
    with pytest.raises(FatalEngineError, match="rank 1 exited"):
        for _ in range(200):
            eng.step()
    assert time.monotonic() - t < 10
    with pytest.raises(FatalEngineError, match="rank 1"):  # and stays failed
        eng.step()
    llm.close()
    assert _no_workers_left()


def _serve(model: str, port: int, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", model, "--port", str(port), "--tp-size", "2",
                             "--dtype", "float64", "--speculative-algorithm", "NGRAM", *extra],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _workers(proc: subprocess.Popen) -> list[psutil.Process]:
    return [c for c in psutil.Process(proc.pid).children(recursive=True) if "specserve.parallel.worker" in " ".join(c.cmdline())]


def test_killed_worker_server_fails_requests_reports_unhealthy_and_exits(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    proc = _serve(make_tiny_dir(tmp_path / "m"), port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120)
        (worker,) = _workers(proc)
        body = {"model": "m", "prompt": "w7 w8 w9", "max_tokens": 100000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert any(line.startswith("data: {") for line in lines)  # it is generating
            worker.kill()
            rest = "\n".join(lines)  # the stream ends (no hang) with an error event naming the rank
        assert "rank 1 exited" in rest, rest[-500:]
        assert proc.wait(30) == 1
        assert "rank 1 exited" in log.read_text()
    finally:
        proc.kill()
        proc.wait()
    assert not _workers(proc) if psutil.pid_exists(proc.pid) else True


def test_worker_death_while_idle_reports_unhealthy(tmp_path: Path) -> None:
    """Nothing in flight: the watchdog notices the dead rank, /health turns 503 naming it, new requests get
    503 (in a server of our own, which does not exit, so the unhealthy state can be read)."""
    srv = ServerThread(make_tiny_dir(tmp_path / "m"), tp_size=2).start(timeout=120)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="tiny", prompt="w7 w8", max_tokens=4).choices[0].text
        (worker,) = [c for c in psutil.Process().children(recursive=True)
                     if "specserve.parallel.worker" in " ".join(c.cmdline())]
        worker.kill()
        deadline = time.monotonic() + 10
        while (r := httpx.get(srv.url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "still healthy"
            time.sleep(0.05)
        assert r.status_code == 503 and "rank 1 exited" in r.json()["error"]["message"]
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny", prompt="w7 w8", max_tokens=4)
        assert e.value.status_code == 503 and "rank 1" in e.value.message
    finally:
        srv.stop()
    assert _no_workers_left()


def test_ctrl_c_stops_server_and_workers(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    proc = _serve(make_tiny_dir(tmp_path / "m"), port, log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 120)
        workers = _workers(proc)
        assert len(workers) == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, log.read_text()[-2000:]
    finally:
        proc.kill()
        proc.wait()


def test_second_node_joins_with_node_rank(tmp_path: Path) -> None:
    """`serve --node-rank 1 --nnodes 2` on "another machine" (here: another process) runs rank 1 only."""
    path = make_tiny_dir(tmp_path / "m")
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", path, "--tp-size", "2", "--nnodes", "2",
                              "--node-rank", "1", "--dist-init-addr", addr, "--dtype", "float64"])
    try:
        plan = _plan(3, 3)
        got = _outputs(path, plan, tp_size=2, nnodes=2, dist_init_addr=addr)
        assert node1.wait(30) == 0  # rank 0 stopped it in order
        assert got == _outputs(path, plan)
    finally:
        node1.kill()
        node1.wait()


def test_one_tensor_parallel_engine_per_process(tmp_path: Path) -> None:
    path = make_tiny_dir(tmp_path / "m")
    with LLM(path, dtype="float64", tp_size=2):
        with pytest.raises(ValueError, match="one tensor-parallel engine per process"):
            LLM(path, dtype="float64", tp_size=2)
    with LLM(path, dtype="float64", tp_size=2) as llm:  # once closed, another may start
        assert llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=2))[0].token_ids
    assert _no_workers_left()
