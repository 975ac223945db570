"""The KV memory budget the target pool, any draft pool and recurrent-state pools share."""
from __future__ import annotations

import logging
from dataclasses import dataclass
import torch
from .kv_pool import KVPool
from .state_pool import StatePool
from ..models.config import ModelConfig

log = logging.getLogger("specserve")


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return cfg.kv_bytes_per_token * torch.finfo(dtype).bits // 8


@dataclass
class KVBudget:
    """The KV memory the target pool and any draft pool share. A drafter reserves its pool first;
    the target pool gets what is left (`remaining`)."""

    remaining: int  # bytes
    target: ModelConfig
    target_dtype: torch.dtype
    page_size: int

    def reserve(self, draft: ModelConfig, dtype: torch.dtype) -> int:
        """Split the budget so both pools hold the same number of tokens, each sized from its own
        geometry and dtype; returns the draft pool's pages (at least 1)."""
        t, d = kv_bytes_per_token(self.target, self.target_dtype), kv_bytes_per_token(draft, dtype)
        draft_bytes = self.remaining * d // (t + d)
        self.remaining -= draft_bytes
        return max(1, KVPool.pages_for_budget(draft, draft_bytes, self.page_size, dtype))

    def draft_pool(self, draft: ModelConfig, dtype: torch.dtype) -> KVPool:
        return KVPool(draft, self.reserve(draft, dtype), self.page_size, dtype)

    def state_pool(self, cfg: ModelConfig, dtype: torch.dtype, slots: int) -> StatePool:
        """A recurrent-state pool for a hybrid model, taken off the budget before any KV pool (its size does
        not depend on context length): `slots` slots (one per request that may run), fewer if they would
        take more than half of what is left; at least one, or a ValueError naming the flag."""
        from ..models.qwen3_5 import state_dtype

        sdt = state_dtype(dtype)
        per = StatePool.bytes_per_slot(cfg, sdt)
        n = min(slots, self.remaining // 2 // per)
        if n < 1:
            raise ValueError(f"--kv-cache-memory: {self.remaining} bytes left cannot hold one recurrent-state slot "
                             f"of {per} bytes plus KV pages")
        if n < slots:
            log.warning("recurrent state: %d slots of %d bytes fit half the KV budget; at most %d requests run "
                        "at once (--max-running-requests %d)", n, per, n, slots)
        self.remaining -= n * per
        return StatePool(cfg, n, sdt)
