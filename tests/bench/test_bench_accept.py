"""`specserve bench accept` end to end on a tiny target (CLI → engine → JSON): one row per workload and
temperature plus the macro mean, counters that agree with each other, τ ≥ 1 (bonus included)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.cli import main
from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

K = 4


def test_bench_accept_writes_consistent_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tiny_config("llama")
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, 0), tmp_path / "t")
    # bench accept chats: a minimal template (the word-level tokenizer has none)
    Path(target, "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    name = "alpha"
    Path(tmp_path, f"{name}.jsonl").write_text("".join(
        json.dumps({"text": " ".join(f"w{(7 * i + 3 * j) % 97}" for j in range(6))}) + "\n" for i in range(3)))
    out = tmp_path / f"{name}.json"
    main(["bench", "accept", target, "--prompts", str(tmp_path / f"{name}.jsonl"), "--prompt-field", "text",
          "--num-prompts", "3", "--max-new-tokens", "16", "--temperature", "0", "0.7", "--output", str(out),
          "--dtype", "float64", "--speculative-algorithm", "SYNTHETIC", "--speculative-synthetic-accept-rate", "0.8",
          "--speculative-num-draft-tokens", str(K)])
    doc = json.loads(out.read_text())
    assert doc["command"] == "accept" and doc["drafter"] and doc["model"] == target
    assert set(doc["results"]) == {"T=0.0", "T=0.7"}
    for temp, row in doc["results"].items():
        assert set(row) == {name, "macro_mean"}, row
        r = row[name]
        assert r["verify_forwards"] > 0 and 0 < r["accepted_tokens"] <= r["draft_tokens"] <= K * r["verify_forwards"]
        assert r["accept_length"] == pytest.approx(1 + r["accepted_tokens"] / r["verify_forwards"])
        assert 1 < r["accept_length"] <= K + 1
        assert r["draft_acceptance_rate"] == pytest.approx(r["accepted_tokens"] / r["draft_tokens"])
        pos = r["per_position"]
        assert 0 < len(pos) <= K and all(1 >= a >= b >= 0 for a, b in zip(pos, pos[1:] + [0]))  # chain: P falls
        assert sum(pos) * r["verify_forwards"] == pytest.approx(r["accepted_tokens"])  # each accept counted once
        assert row["macro_mean"]["accept_length"] == pytest.approx(r["accept_length"])  # one workload
    printed = capsys.readouterr().out
    assert "acceptance length τ" in printed and "macro_mean" in printed
