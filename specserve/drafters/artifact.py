"""Drafter artifacts: a directory with config.json + model.safetensors + README.md (model card).

`load_drafter` rebuilds the net, checks it was trained for this target (explaining any mismatch)
and binds the target's frozen tensors. Drafters shipped with specserve live in
`specserve/drafters/shipped/<target>-<algorithm>/`; they are used when
--speculative-draft-model-path is omitted.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from ..models.config import ModelConfig
from ..models.llama import LlamaModel
from .base import AUTO_ARTIFACT, Capabilities, Drafter, register_drafter
from .context import DrafterContext
from .dflash import BlockDrafter, DFlashNet
from .dspark import DSparkNet
from .eagle3 import ChainDrafter, Eagle3Net
from .mtp import MtpNet
from .nets import DraftNet, DrafterConfig

if TYPE_CHECKING:
    from ..config import EngineConfig

log = logging.getLogger("specserve")
NETS: dict[str, type[DraftNet]] = {"eagle3": Eagle3Net, "mtp": MtpNet, "dflash": DFlashNet, "dspark": DSparkNet}
SHIPPED = Path(__file__).parent / "shipped"


def build_net(cfg: DrafterConfig) -> DraftNet:
    if cfg.algorithm in ("eagle3", "mtp") and cfg.num_layers != 1:
        raise ValueError(f"{cfg.algorithm} drafters have exactly one decoder layer (config says {cfg.num_layers})")
    return NETS[cfg.algorithm](cfg)


def save_drafter(net: DraftNet, out: Path, card: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the artifact; floating weights are stored in `dtype` (bf16 keeps shipped drafters small)."""
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in net.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "specserve-drafter"})
    (out / "config.json").write_text(net.cfg.to_json() + "\n")
    (out / "README.md").write_text(card)


def is_drafter_artifact(path: str | Path) -> bool:
    """A drafter artifact (`specserve train-drafter`'s output), not a model: its config names an algorithm."""
    cfg = Path(path) / "config.json"
    return cfg.is_file() and "algorithm" in json.loads(cfg.read_text())


def read_config(path: str | Path) -> DrafterConfig:
    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise ValueError(f"--speculative-draft-model-path: {p} is not a drafter artifact "
                         "(needs config.json and model.safetensors; make one with `specserve train-drafter`)")
    raw = json.loads((p / "config.json").read_text())
    if "algorithm" not in raw:  # a model's config.json (a public EAGLE-3 checkpoint among them), not ours
        arch = (raw.get("architectures") or [raw.get("model_type", "unknown")])[0]
        what = "a public EAGLE-3 checkpoint" if "eagle" in str(arch).lower() else "a model, not a drafter artifact"
        raise ValueError(f"--speculative-draft-model-path: {p} is {what} ({arch}), which specserve does not load "
                         "as a learned drafter: make one for the target with `specserve train-drafter --target MODEL "
                         "--algorithm eagle3` (a draft model of the target's vocabulary goes with STANDALONE)")
    return DrafterConfig.from_dict(raw)


def check_target(cfg: DrafterConfig, t: ModelConfig, path: str | Path) -> None:
    """Refuse a drafter trained for a different geometry or vocabulary, saying what differs."""
    diffs = [f"{what}: drafter was trained for {a}, target has {b}" for what, a, b in (
        ("vocabulary size", cfg.target_vocab_size, t.vocab_size),
        ("hidden size", cfg.target_hidden_size, t.hidden_size),
        ("number of layers", cfg.target_num_layers, t.num_layers)) if a != b]
    if diffs:
        raise ValueError(f"drafter {path} (trained for {cfg.target!r}) does not fit target {t.name!r}: "
                         + "; ".join(diffs) + ". Train one for this target: specserve train-drafter "
                         f"--target <model> --algorithm {cfg.algorithm}")
    if cfg.target and t.name and _norm(cfg.target) != _norm(t.name):
        log.warning("drafter %s was trained for %r, serving %r (same geometry): acceptance may be low",
                    path, cfg.target, t.name)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def load_drafter(path: str | Path, target: LlamaModel, dtype: torch.dtype = torch.float32,
                 block_size: int | None = None) -> DraftNet:
    """`block_size`: serve a block drafter at this block size (NOTE: spec_settings checked it against the
    trained one)."""
    cfg = read_config(path)
    check_target(cfg, target.cfg, path)
    if block_size is not None and cfg.is_block:
        cfg = dataclasses.replace(cfg, block_size=block_size)
    net = build_net(cfg)
    net.load_state_dict(load_file(str(Path(path) / "model.safetensors")), strict=True)
    net = net.to(dtype)
    net.bind(target)
    return net


def shipped_drafter(target: ModelConfig, algorithm: str) -> Path | None:
    """The drafter shipped for this target and algorithm, if any (matched by target name)."""
    if not SHIPPED.is_dir():
        return None
    for d in sorted(SHIPPED.iterdir()):
        if (d / "model.safetensors").is_file():  # drafter artifacts only (not tables or draft vocabularies)
            cfg = read_config(d)
            if cfg.algorithm == algorithm and _norm(cfg.target) == _norm(target.name):
                return d
    return None


def learned_artifact(c: "EngineConfig", target: ModelConfig, algorithm: str) -> Path | None:
    """The artifact `algorithm` loads (HYBRID: its learned drafter): --speculative-draft-model-path, else the
    one shipped for the target."""
    if c.speculative_draft_model_path:
        return Path(c.speculative_draft_model_path)
    return shipped_drafter(target, AUTO_ARTIFACT if algorithm.upper() == "HYBRID" else algorithm.lower())


def learned_factory(algorithm: str):  # noqa: ANN202
    def make(ctx: DrafterContext) -> Drafter:
        c, t = ctx.config, ctx.target
        path = learned_artifact(c, t.cfg, algorithm)
        if path is None:
            raise ValueError(f"--speculative-draft-model-path: no {algorithm.upper()} drafter given and none ships for "
                             f"{t.cfg.name!r}; train one: specserve train-drafter --target {c.model} --algorithm {algorithm}")
        dtype = ctx.draft_dtype(torch.float64 if t.dtype == torch.float64 else torch.float32, quantized=False)
        net = load_drafter(path, t, dtype, ctx.settings.block_size)
        if net.cfg.algorithm != algorithm:
            raise ValueError(f"--speculative-draft-model-path: {path} is a {net.cfg.algorithm.upper()} drafter, "
                             f"not {algorithm.upper()}; pass --speculative-algorithm {net.cfg.algorithm.upper()}")
        runtime = BlockDrafter if net.cfg.is_block else ChainDrafter
        drafter = runtime(ctx, net, algorithm.upper())
        drafter.path = Path(path)
        return drafter

    return make


_CHAIN = Capabilities(tree=True, features=True, samples=True, draft_model=True)
_BLOCK = Capabilities(block=True, features=True, samples=True, draft_model=True)
register_drafter("EAGLE3", _CHAIN, aliases=("EAGLE",), help="EAGLE-3 chains or EAGLE-2 trees over target features")(learned_factory("eagle3"))
register_drafter("MTP", _CHAIN, aliases=("NEXTN",), help="a multi-token-prediction layer, drafted as a chain")(learned_factory("mtp"))
register_drafter("DFLASH", _BLOCK, help="a block of drafts in one forward")(learned_factory("dflash"))
register_drafter("DSPARK", dataclasses.replace(_BLOCK, default_window="confidence"),
                 help="DFlash with a Markov transition term and a confidence head")(learned_factory("dspark"))
