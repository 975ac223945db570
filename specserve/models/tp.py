"""The collectives a tensor-parallel shard's layers call. NOTE: a protocol, so the model files need
nothing from parallel/: parallel/comm.py implements it over torch.distributed and attaches it to a shard."""
from __future__ import annotations

from typing import Protocol

import torch


class TensorParallel(Protocol):
    rank: int
    world: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of the row-parallel partial outputs, in place."""
        ...

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding lookup: every rank gets the full rows."""
        ...

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, my vocab] on every rank → [n, V] on rank 0 (an empty [n, 0] elsewhere)."""
        ...
