"""`bench serving --launch` against servers it starts: configurations side by side, `--repeat` turns."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.test_tools import QWEN25_TEMPLATE, _tool_dir


@pytest.mark.slow
def test_launched_servers_take_turns_and_report_their_median_run(tmp_path: Path) -> None:
    """plain and NGRAM on a tiny chat model, twice each in turn, a fresh server per concurrency (the same prompts
    again must not hit what an earlier run cached): every run's tok/s kept, the median one reported (the lower
    middle of two), NGRAM's greedy texts equal plain's; a bad --repeat is refused by name."""
    d = _tool_dir(tmp_path / "m", QWEN25_TEMPLATE)
    out = tmp_path / "serving.json"
    base = [sys.executable, "-m", "specserve.cli", "bench", "serving", "--launch", "plain", "NGRAM", "--model-path", d,
            "--workload", "humaneval", "--num-prompts", "2", "--max-new-tokens", "12", "--concurrency", "1", "2",
            "--ignore-eos", "--num-threads", "1", "--output", str(out)]
    p = subprocess.run(base + ["--repeat", "2"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("== plain (repeat") == 4 and p.stdout.count("== NGRAM (repeat") == 4
    r = json.loads(out.read_text())["results"]
    assert list(r["plain"]["runs"]) == ["concurrency 1", "concurrency 2"]
    plain, ngram = r["plain"]["runs"]["concurrency 2"], r["NGRAM"]["runs"]["concurrency 2"]
    assert all(run["ttft_s"]["p50"] > 0 for run in (plain, ngram))
    assert len(plain["output_tok_s_runs"]) == 2 and plain["output_tok_s"] == min(plain["output_tok_s_runs"])
    assert plain["failed"] == 0 and ngram["text_equals_plain"] is True
    assert r["plain"]["ready_s"] > 0 and r["NGRAM"]["peak_rss_gib"] > 0
    p = subprocess.run(base + ["--repeat", "0"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "--repeat: at least 1" in p.stderr
