"""Architecture registry: an architecture's name → its family module (the model class, its config reader and
its GGUF tensor names).

A family module under specserve/models/ defines:
  MODEL                          the nn.Module class that runs it
  config_from_hf(cfg, arch, name) → ModelConfig, from a parsed `config.json`
  GGUF_NAMES (optional)          GGUF per-layer leaf → HF leaf, where the family departs from llama's
  config_from_gguf(cfg, get) (optional)  the family's own GGUF metadata added to the common geometry
Adding a family is its module plus its entries here.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

# registry key → family module
FAMILIES = {
    "llama": "llama", "qwen2": "llama", "qwen3": "llama", "mistral": "mistral", "phi3": "phi3",
    "gemma2": "gemma", "gemma3": "gemma", "qwen3_5": "qwen3_5",
    # mixture of experts (models/moe.py)
    "qwen2_moe": "qwen_moe", "qwen3_moe": "qwen_moe", "mixtral": "mixtral", "olmoe": "olmoe",
}
# HF `architectures[0]` / `model_type` / GGUF `general.architecture` → registry key
_ALIASES = {
    "llama": "llama", "LlamaForCausalLM": "llama", "smollm": "llama",
    "qwen2": "qwen2", "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3", "Qwen3ForCausalLM": "qwen3",
    "mistral": "mistral", "MistralForCausalLM": "mistral",
    "phi3": "phi3", "Phi3ForCausalLM": "phi3",
    "gemma2": "gemma2", "Gemma2ForCausalLM": "gemma2",
    "gemma3": "gemma3", "gemma3_text": "gemma3", "Gemma3ForCausalLM": "gemma3",
    # hybrid Gated DeltaNet + gated attention (text only; the multimodal checkpoint's language model)
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "qwen2_moe": "qwen2_moe", "qwen2moe": "qwen2_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
    "qwen3_moe": "qwen3_moe", "qwen3moe": "qwen3_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "mixtral": "mixtral", "MixtralForCausalLM": "mixtral",  # its GGUF says llama (loading/gguf.py)
    "olmoe": "olmoe", "OlmoeForCausalLM": "olmoe",
}
SUPPORTED = tuple(FAMILIES)


def normalize_architecture(name: str) -> str:
    """Return our registry key for `name` or raise ValueError naming the supported list."""
    key = _ALIASES.get(name)
    if key is None:
        hf = sorted(a for a in _ALIASES if a[0].isupper())
        hint = (" (an EAGLE-3 drafter checkpoint: specserve's learned drafters come from `specserve train-drafter`)"
                if "eagle" in name.lower() else "")
        raise ValueError(f"unsupported model architecture {name!r}{hint}; supported: {', '.join(SUPPORTED)} "
                         f"(HF: {', '.join(hf)})")
    return key


def architecture_from_hf(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else cfg.get("model_type", "<missing>")
    return normalize_architecture(name)


def family(architecture: str) -> ModuleType:
    """The family module of an architecture (imported on first use: models import this registry's users)."""
    return importlib.import_module(f"{__package__}.{FAMILIES[normalize_architecture(architecture)]}")


def model_class(architecture: str) -> type:
    """The nn.Module class for a registry key."""
    return family(architecture).MODEL
