"""Architecture registry: maps an architecture name to the model class that runs it."""
from __future__ import annotations

from typing import Any

# HF `architectures[0]` / `model_type` / GGUF `general.architecture` → our key.
_ALIASES = {
    "llama": "llama", "LlamaForCausalLM": "llama", "smollm": "llama", "mistral": "llama",
    "qwen2": "qwen2", "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3", "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED = ("llama", "qwen2", "qwen3")


def normalize_architecture(name: str) -> str:
    """Return our registry key for `name` or raise ValueError naming the supported list."""
    key = _ALIASES.get(name)
    if key is None:
        raise ValueError(
            f"unsupported model architecture {name!r}; supported: {', '.join(SUPPORTED)} "
            f"(HF: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
        )
    return key


def architecture_from_hf(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else cfg.get("model_type", "<missing>")
    return normalize_architecture(name)


def model_class(architecture: str) -> type:
    """The nn.Module class for a registry key. All three share one decoder with config switches."""
    from .llama import LlamaModel

    normalize_architecture(architecture)
    return LlamaModel
