"""`bench step --rows` (bench/step_bandwidth.py): per row count the GB/s a forward streams and its share of the
measured read bandwidth; `--check` against a recorded result on the same CPU model; llama-server's row counts
on the same GGUF where `scripts/setup.sh llamacpp-server` has built it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.bench import step_bandwidth


def _recorded(tmp_path: Path, cpu: str, share: float) -> str:
    p = tmp_path / f"rec-{cpu}-{share}.json"
    p.write_text(json.dumps({"machine": {"cpu_model": cpu}, "results": {"specserve": {"1": {"share": share}}}}))
    return str(p)


def test_annotate_gives_gbs_share_and_the_ratio_to_one_row() -> None:
    times = {"1": {"ms": 10.0}, "4": {"ms": 12.0}}
    step_bandwidth.annotate(times, weight_bytes=200_000_000, bandwidth=40.0)
    assert times["1"]["gbs"] == pytest.approx(20.0) and times["1"]["share"] == pytest.approx(0.5)
    assert times["4"]["over_t1"] == pytest.approx(1.2) and times["1"]["over_t1"] == 1.0


def test_check_holds_within_ten_percent_on_the_same_cpu(tmp_path: Path) -> None:
    now = {"machine": {"cpu_model": "AMD EPYC"}, "specserve": {"1": {"share": 0.60}}}
    assert step_bandwidth.check(now, _recorded(tmp_path, "AMD EPYC", 0.65)) is None  # 7.7% below: within
    why = step_bandwidth.check(now, _recorded(tmp_path, "AMD EPYC", 0.70))
    assert why is not None and "60.0% is more than 10% below the recorded 70.0%" in why
    why = step_bandwidth.check(now, _recorded(tmp_path, "Intel Xeon", 0.10))
    assert why is not None and "recorded on 'Intel Xeon'" in why and "no comparable figure" in why


def test_bench_step_rows_on_the_default_model(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    cmd = [sys.executable, "-m", "specserve.cli", "bench", "step", "--rows", "2", "1", "--context", "16",
           "--repeats", "2", "--num-threads", "1", "--output", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    r = doc["results"]
    assert r["weight_bytes"] > 10_000_000 and set(r["specserve"]) == {"1", "2"}
    assert all(x["gbs"] > 0 and 0 < x["share"] for x in r["specserve"].values())
    assert r["specserve"]["1"]["over_t1"] == 1.0 and doc["results"]["machine"]["read_bandwidth_gbs"] > 0
    # the guard: a recorded share far above this run's fails it, naming the figures
    high = _recorded(tmp_path, r["machine"]["cpu_model"], 100.0)
    p = subprocess.run(cmd + ["--check", high], capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and "below the recorded 10000.0%" in p.stderr
    p = subprocess.run([sys.executable, "-m", "specserve.cli", "bench", "step", "--check", high],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and "--llama-server and --check belong to the bandwidth table: give --rows" in p.stderr
    p = subprocess.run(cmd + ["--rounds", "0"], capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and "--rounds: at least 1" in p.stderr


@pytest.mark.slow
@pytest.mark.skipif(not (Path(sys.executable).parent / "llama-server").exists(),
                    reason="needs `scripts/setup.sh llamacpp-server`")
def test_llama_server_row_counts_on_the_same_gguf(tmp_path: Path) -> None:
    """SmolLM2's GGUF, the default model's file, read by both engines."""
    out = tmp_path / "step.json"
    p = subprocess.run([sys.executable, "-m", "specserve.cli", "bench", "step", "--rows", "1", "4",
                        "--context", "64", "--repeats", "2", "--llama-server", "--output", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())["results"]
    assert set(r["llama_server"]) == {"1", "4"} and all(x["share"] > 0 for x in r["llama_server"].values())
    assert r["llama_server_weight_bytes"] > 0 and r["llama_server"]["4"]["over_t1"] > 0
