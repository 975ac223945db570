"""`train-drafter --init-from`: fine-tuning starts from the artifact (weights and draft vocabulary) and
records where it came from in the new artifact's training record and model card; it keeps its own checkpoint
and log beside a from-scratch run's in the same work dir, never resuming that run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specserve.cli import build_parser
from specserve.drafters.artifact import load_drafter
from specserve.train.trainer import run as train
from tests.drafter_setup import _target


def test_init_from_starts_at_the_artifact(trained: dict, tmp_path: Path) -> None:
    src = trained["artifacts"]["dspark"]
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(trained["work"] / "responses.jsonl", work)  # the data
    shutil.copy(trained["work"] / "dspark-checkpoint.pt", work)  # a from-scratch run's checkpoint (step 40 of 40)
    out = tmp_path / "ft"
    train(build_parser().parse_args([
        "train-drafter", "--data", "regen", "--target", trained["target"], "--algorithm", "dspark", "--out", str(out),
        "--work-dir", str(work), "--num-prompts", "48", "--steps", "1", "--lr", "1e-9", "--batch-tokens", "256",
        "--eval-prompts", "4", "--eval-tokens", "24", "--init-from", str(src)]))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["training"]["init_from"]["artifact"] == str(src)
    assert cfg["training"]["init_from"]["its_training"]["steps"] == 40
    assert "--init-from" in cfg["training"]["command"] and "False" not in cfg["training"]["command"]
    assert "fine-tuned from" in (out / "README.md").read_text()
    log = [json.loads(x) for x in (work / "dspark-ft-train-log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1] and (work / "dspark-ft-checkpoint.pt").exists()
    a, b = load_drafter(src, _target()), load_drafter(out, _target())
    assert torch.equal(a.draft_ids, b.draft_ids)  # the artifact's draft vocabulary, not a new one
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x.float(), y.float(), atol=1e-2), k  # one step at lr 1e-9: (nearly) the same weights
