"""Config resolution that needs the target: AUTO → the drafter shipped for it (or plain decoding),
and the verify-window policy's per-algorithm default made concrete."""
from __future__ import annotations

import dataclasses

from ..config import EngineConfig
from ..drafters.artifact import shipped_drafter
from ..drafters.base import AUTO_ALGORITHM, AUTO_ARTIFACT, default_window
from ..models.config import ModelConfig


def resolve_config(config: EngineConfig, target: ModelConfig) -> EngineConfig:
    algo = config.speculative_algorithm
    if algo is None:
        return config
    window = config.speculative_window or default_window(algo)
    if algo == "AUTO":
        algo = AUTO_ALGORITHM if shipped_drafter(target, AUTO_ARTIFACT) is not None else None
        if algo is None:  # nothing ships for this target: plain decoding
            return dataclasses.replace(config, speculative_algorithm=None)
    return dataclasses.replace(config, speculative_algorithm=algo, speculative_window=window)
