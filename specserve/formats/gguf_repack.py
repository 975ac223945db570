"""GGUF tensors packed for the integer GEMM straight from the file's bytes (`torch.ops.specserve.gguf_repack`).

`RawBlocks` is one tensor's block bytes (a view of the memory map) with its type, HF shape and row order; the
op turns it into the (wp, wd, wm) `BlockQuantWeight` holds, in one parallel pass and without the 2 bytes per
weight of `BlockCodes`. `codes()` stays the reference (gguf_blocks), which the op equals bit for bit
(tests/formats/test_gguf_repack.py), and the fallback for fused weights whose parts do not concatenate as packed.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .gguf_blocks import NATIVE, BlockCodes, gguf_blocks
from .quant_ref import KQ, NR

_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
_HAS_M = ("Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K")

Segment = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", int, int]  # (wp, wd, wm, n, fmt)


@dataclass
class RawBlocks:
    """One GGUF block tensor: `data` uint8 [N, row bytes] (the file's rows), HF `shape` (N, K), and `order`:
    int64 [N], output row r = file row order[r] (None: the file's order)."""
    data: np.ndarray
    qtype: str
    shape: tuple[int, int]
    order: torch.Tensor | None = None
    name: str = "?"

    def __post_init__(self) -> None:
        if self.qtype not in NATIVE:
            raise ValueError(f"GGUF tensor {self.name!r}: {self.qtype} has no packed form")

    @property
    def bits(self) -> int:
        return _BITS[self.qtype]

    @property
    def kquant(self) -> bool:
        return self.qtype.endswith("_K")

    @property
    def fmt(self) -> int:
        return KQ | self.bits if self.kquant else self.bits

    def rows(self, f) -> "RawBlocks":  # noqa: ANN001
        """Rows picked or reordered by `f` (on dim 0), as BlockCodes.rows: the picked rows' bytes are copied
        out of the map (a reduced head: a fraction of it), so the op sees a tensor of just those rows."""
        src = f(self.order if self.order is not None else torch.arange(self.shape[0]))
        return RawBlocks(np.ascontiguousarray(self.data[src.numpy()]), self.qtype, (len(src), self.shape[1]),
                         None, self.name)

    def codes(self) -> BlockCodes:
        """The reference form: gguf_blocks, rows in `order`."""
        c = gguf_blocks(self.data, self.qtype, self.shape, self.name)
        return c if self.order is None else c.rows(lambda t: t[self.order].contiguous())

    def pack(self) -> Segment:
        """(wp, wd, wm, n, fmt): what quant.pack_codes(self.codes()) gives, from the op."""
        from .. import kernels

        kernels.load()
        with warnings.catch_warnings():  # NOTE: the op only reads the (read-only) map
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.asarray(self.data, dtype=np.uint8))
        out = torch.ops.specserve.gguf_repack(data.reshape(-1), self.qtype, *self.shape, self.order)
        return out[0], out[1], out[2] if len(out) == 3 else None, self.shape[0], self.fmt


def concat_packed(run: list[RawBlocks]) -> Segment | None:
    """One segment for parts `quant.cat_rows` would join, by concatenating their packed tiles: when every part
    has the same format and offsets and every part but the last fills whole tiles (N % 16 == 0). None when
    that does not hold, or when their scales' dtypes differ (fp16 is chosen per weight): the caller joins
    the BlockCodes instead."""
    fmt, has_m = run[0].fmt, run[0].qtype in _HAS_M
    if any(p.fmt != fmt or (p.qtype in _HAS_M) != has_m for p in run) or any(p.shape[0] % NR for p in run[:-1]):
        return None
    segs = [p.pack() for p in run]
    if len({s[1].dtype for s in segs}) > 1:
        return None
    cat = lambda i: segs[0][i] if len(segs) == 1 else torch.cat([s[i] for s in segs])  # noqa: E731
    return cat(0), cat(1), cat(2) if has_m else None, sum(s[3] for s in segs), fmt
