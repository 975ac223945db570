"""Tiny trained drafters shared by the drafter test modules (the `trained` fixture lives in conftest.py
and is built once per test run, so the four drafters are trained once)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from specserve.cli import build_parser
from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from specserve.models.llama import LlamaModel
from specserve.train.trainer import run as train
from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

ALGOS = ["eagle3", "mtp", "dflash", "dspark"]
CFG = tiny_config(layers=4)


def _sd() -> dict[str, torch.Tensor]:
    """A tiny target whose layers add little to the residual stream: its greedy text is ~90% a
    bigram chain, which a drafter can learn in seconds (a random function of context is not)."""
    sd = tiny_state_dict(CFG, 0, scale=0.5)
    return {k: v * 0.3 if (".mlp." in k or "o_proj" in k) else v for k, v in sd.items()}


def _target() -> LlamaModel:
    m = LlamaModel(CFG, torch.float64)
    m.load_weights(_sd())
    return m


def train_all(tmp: Path) -> dict:
    """Train all four drafters briefly on responses the tiny target wrote itself."""
    tdir = save_tiny_hf_dir(CFG, _sd(), tmp / "target")
    rng = random.Random(0)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(3, 10))] for _ in range(48)]
    outs = LLM(tdir).generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    work = tmp / "work"
    work.mkdir()
    (work / "responses.jsonl").write_text("".join(
        json.dumps({"index": i, "prompt_ids": p, "response_ids": o.outputs[0].token_ids}) + "\n"
        for i, (p, o) in enumerate(zip(prompts, outs))))
    arts = {}
    for algo in ALGOS:
        arts[algo] = tmp / algo
        train(build_parser().parse_args([
            "train-drafter", "--data", "regen", "--target", tdir, "--algorithm", algo, "--out", str(arts[algo]), "--work-dir", str(work),
            "--num-prompts", "48", "--steps", "40", "--batch-tokens", "256", "--lr", "3e-3", "--eval-prompts", "4",
            "--eval-tokens", "24", "--draft-vocab-size", "64" if algo != "mtp" else "97", "--checkpoint-every", "20"]))
    return {"target": tdir, "work": work, "artifacts": arts}


def _spec_llm(trained: dict, algo: str, **kw) -> LLM:  # noqa: ANN003
    """A learned drafter of the `trained` fixture (kw may name another algorithm using it, e.g. HYBRID)."""
    kw = {"kv_cache_memory": "512KiB", "speculative_algorithm": algo.upper(), **kw}
    return LLM.from_model(_target(), speculative_draft_model_path=str(trained["artifacts"][algo]), **kw)


# the engine-level distribution tests of learned drafters (tests/drafters/test_drafters.py) and their negative
# controls (tests/speculative/test_dist_power.py): the first L tokens of N seeded requests against the exact joint
DIST_VOCAB, DIST_LEN, DIST_N = 3, 5, 2500
DIST_PARAMS = SamplingParams(temperature=6.0, max_tokens=DIST_LEN, top_p=0.95)


def random_drafter_llm(tmp: Path, algo: str, rule: str, tokenizer=None, **opts) -> LLM:  # noqa: ANN001, ANN003
    """A 3-token-vocabulary fp64 target with a randomly initialised `algo` drafter (a context-dependent
    q ≠ p), accept rule `rule`, 3 draft tokens under fixed windows (every draft verified: DSPARK's default
    confidence windows would cut a random drafter's drafts short) unless opts say otherwise.
    `tokenizer` (a specserve Tokenizer of 3 tokens) replaces the target's word-level one (grammar tests)."""
    from specserve.drafters.artifact import build_net, save_drafter
    from specserve.drafters.nets import DrafterConfig

    cfg = tiny_config("llama", vocab=DIST_VOCAB, layers=2)
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=11), tmp / "t")
    if tokenizer is not None:
        tokenizer.backend.save(f"{target}/tokenizer.json")
        eos = [tokenizer.id_to_piece(i) for i in tokenizer.eos_token_ids]
        Path(target, "tokenizer_config.json").write_text(json.dumps({"eos_token": eos[0]} if eos else {}))
    dcfg = DrafterConfig.for_target(algo, cfg, block_size=4 if algo in ("dflash", "dspark") else None,
                                    markov_rank=8 if algo == "dspark" else None)
    torch.manual_seed(5)
    net = build_net(dcfg)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_drafter(net, tmp / "d", "", torch.float64)
    return LLM(target, dtype="float64", speculative_draft_model_path=str(tmp / "d"), speculative_accept=rule,
               max_running_requests=256, **{"speculative_algorithm": algo.upper(), "speculative_num_draft_tokens": 3,
                                            "speculative_window": "fixed", **opts})
