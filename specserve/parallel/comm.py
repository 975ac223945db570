"""The collectives of a tensor-parallel forward (torch.distributed: gloo on CPU, NCCL on GPU).

NOTE: every rank runs the same forward over the same packed rows, so the residual stream is replicated:
an all-reduce gives all ranks the same bits, and rank 0's hidden states (drafter features) are the
full model's. Only rank 0 receives logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .shard import Layout


class TensorParallel:
    def __init__(self, layout: Layout, group: dist.ProcessGroup | None = None) -> None:
        self.layout, self.group = layout, group
        self.rank, self.world = layout.rank, layout.world

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of the row-parallel partial outputs, in place."""
        dist.all_reduce(t, group=self.group)
        return t

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank fills the rows of its token ids, zeros elsewhere, then a sum
        (exact: every row is one rank's value plus zeros)."""
        v0, v1 = self.layout.vocab
        local = ids - v0
        mine = (local >= 0) & (local < v1 - v0)
        x = F.embedding(local.clamp(0, v1 - v0 - 1), table)
        x.masked_fill_(~mine[:, None], 0)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, my vocab] on every rank → [n, V] on rank 0 (an empty [n, 0] elsewhere)."""
        n, width = logits.shape
        pad = max(self.layout.vocab_sizes) - width
        send = F.pad(logits, (0, pad)) if pad else logits.contiguous()
        parts = [torch.empty_like(send) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(send, parts, dst=0, group=self.group)
        if self.rank != 0:
            return logits.new_empty(n, 0)
        return torch.cat([p[:, :s] for p, s in zip(parts, self.layout.vocab_sizes)], dim=1)
