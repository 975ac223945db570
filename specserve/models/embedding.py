"""An embedding table kept in the GGUF file's own blocks: rows are dequantized when gathered.

A 1.5B model's fp32 table is ~0.9 GB and a 7B's ~2.2 GB, against ~0.13 / ~0.4 GB as Q4_K blocks, and a
step gathers only the rows of its new tokens. The blocks stay in the memory-mapped file (pages come in as
tokens touch them); `gguf.quants.dequantize` of a row gives the same fp32 values a dense load would hold,
so the model's output does not change.
"""
from __future__ import annotations

import numpy as np
import torch


class GGUFEmbedding:
    """`[vocab, hidden]` rows stored as one GGUF tensor's raw blocks (`data`: uint8 [vocab, row_bytes])."""

    def __init__(self, data: np.ndarray, qtype: object, hidden: int, dtype: torch.dtype) -> None:
        self.data, self.qtype, self.dtype = data, qtype, dtype
        self.shape = (int(data.shape[0]), hidden)
        self.device = torch.device("cpu")

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"token id out of range [0, {self.shape[0]})")
        rows = np.asarray(dequantize(self.data[flat], self.qtype), dtype=np.float32).reshape(-1, self.shape[1])
        return torch.from_numpy(rows).to(self.dtype).reshape(*ids.shape, self.shape[1])

    def dense(self) -> torch.Tensor:
        """The whole table as a dense tensor (drafters that share the target's embedding or tied head)."""
        return self(torch.arange(self.shape[0]))

    def nbytes(self) -> int:
        return int(self.data.nbytes)
