"""Acceptance evaluation of a drafter artifact and its model card (README.md)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..bench.metrics import acceptance
from ..core import SamplingParams
from ..drafters.nets import DrafterConfig


def evaluate(artifact: Path, target: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Serve `prompts` (token ids) with the drafter at temperature 0; pooled τ (bonus included)."""
    from ..engine.llm import LLM

    cfg = DrafterConfig.from_dict(json.loads((artifact / "config.json").read_text()))
    llm = LLM(target, speculative_algorithm=cfg.algorithm.upper(), speculative_draft_model_path=str(artifact))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    res = acceptance(o.outputs[0].meta_info for o in outs)
    return {"num_prompts": len(prompts), "max_tokens": max_tokens, "accept_length": round(res["accept_length"], 3),
            "per_position": [round(x, 3) for x in res["per_position"]]}




def train_command(a: argparse.Namespace) -> str:
    skip = {"func", "command", "out"}
    parts = [f"specserve train-drafter --out {a.out}"]
    for k, v in vars(a).items():
        if k in skip or v is None or v is False or callable(v):
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:  # store_true flags
            parts.append(flag)
            continue
        parts.append(f"{flag} {' '.join(map(str, v))}" if isinstance(v, (list, tuple)) else f"{flag} {v}")
    return " ".join(parts)


