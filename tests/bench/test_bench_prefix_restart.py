"""`specserve bench prefix --restart` on a tiny model: it runs end to end, every answer equal to the uncached one
(it raises otherwise), the restarted engine's first request served from disk, and the result file records it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench import run_bench
from specserve.cli import build_parser
from tests.tiny import target_and_draft_dirs


def test_restart_mode_records_ttft_from_disk(tmp_path: Path) -> None:
    dirs = target_and_draft_dirs(tmp_path / "models")
    out = tmp_path / "r.json"
    a = build_parser().parse_args(["bench", "prefix", dirs["target"], "--restart", "--restart-rounds", "1",
                                   "--system-tokens", "64", "--max-new-tokens", "4", "--page-size", "4",
                                   "--dtype", "float64", "--output", str(out)])
    run_bench(a)
    doc = json.loads(out.read_text())
    r = doc["results"]["rounds"][0]
    assert doc["results"]["outputs_equal"] and "machine" in doc
    assert r["cached_tokens_restart"] == (r["prompt_tokens"] - 1) // 4 * 4 and r["pages_loaded"] > 0
    assert r["pages_written"] == r["pages_saved"] > 0 and r["dir_bytes"] > 0
    used = tmp_path / "used"
    (used / "x").mkdir(parents=True)
    a.prefix_cache_dir, a.output = str(used), str(tmp_path / "r2.json")
    with pytest.raises(SystemExit):  # a directory with files in it: the first request would not be cold
        run_bench(a)
