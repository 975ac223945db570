"""Architecture registry: maps an architecture name to the model class that runs it."""
from __future__ import annotations

from typing import Any

# HF `architectures[0]` / `model_type` / GGUF `general.architecture` → our key.
_ALIASES = {
    "llama": "llama", "LlamaForCausalLM": "llama", "smollm": "llama", "mistral": "llama",
    "qwen2": "qwen2", "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3", "Qwen3ForCausalLM": "qwen3",
    # hybrid Gated DeltaNet + gated attention (text only; the multimodal checkpoint's language model)
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
}
SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_5")


def normalize_architecture(name: str) -> str:
    """Return our registry key for `name` or raise ValueError naming the supported list."""
    key = _ALIASES.get(name)
    if key is None:
        raise ValueError(
            f"unsupported model architecture {name!r}; supported: {', '.join(SUPPORTED)} "
            f"(HF: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3_5ForCausalLM)"
        )
    return key


def architecture_from_hf(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else cfg.get("model_type", "<missing>")
    return normalize_architecture(name)


def model_class(architecture: str) -> type:
    """The nn.Module class for a registry key: the Llama family shares one decoder with config switches;
    Qwen3.5 (recurrent + attention layers) has its own."""
    if normalize_architecture(architecture) == "qwen3_5":
        from .qwen3_5 import Qwen35Model

        return Qwen35Model
    from .llama import LlamaModel

    return LlamaModel
