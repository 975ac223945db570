"""Config resolution that needs the target: AUTO → the drafter shipped for it (or plain decoding),
and the verify-window policy's per-algorithm default made concrete."""
from __future__ import annotations

import dataclasses

from ..config import EngineConfig
from ..drafters.artifact import shipped_drafter
from ..drafters.base import AUTO_ARTIFACT, capabilities, default_window
from ..drafters.ngram_table import shipped_table
from ..models.config import ModelConfig


def auto_algorithm(config: EngineConfig, target: ModelConfig) -> str | None:
    """NGRAM over the table shipped for the target, else HYBRID over its shipped DSpark, else None (plain).
    A flag only one of them takes picks that one; flags of both are refused by name."""
    def given(algo: str, other: str) -> list[str]:
        own = capabilities(algo).flags() - capabilities(other).flags()
        return sorted(f for f in own if getattr(config, f) is not None)

    ngram, hybrid = given("NGRAM", "HYBRID"), given("HYBRID", "NGRAM")
    if ngram and hybrid:
        raise ValueError(f"--speculative-algorithm AUTO: --{ngram[0].replace('_', '-')} (NGRAM) and "
                         f"--{hybrid[0].replace('_', '-')} (HYBRID) choose different drafters; name one")
    if ngram or (not hybrid and shipped_table(target) is not None):
        return "NGRAM"
    return "HYBRID" if hybrid or shipped_drafter(target, AUTO_ARTIFACT) is not None else None


def resolve_config(config: EngineConfig, target: ModelConfig) -> EngineConfig:
    algo = config.speculative_algorithm
    if algo is None:
        return config
    window = config.speculative_window or default_window(algo)
    if algo == "AUTO":
        algo = auto_algorithm(config, target)
        if algo is None:  # nothing ships for this target: plain decoding
            return dataclasses.replace(config, speculative_algorithm=None)
    return dataclasses.replace(config, speculative_algorithm=algo, speculative_window=window)
