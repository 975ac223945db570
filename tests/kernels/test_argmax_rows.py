"""argmax_rows (runtime/sampling.py, kernels/csrc/argmax.cpp): the greedy token of each row is torch.argmax's
choice on every input (ties: the first maximum; a NaN counts as the maximum; ±inf; rows whose length is not a
multiple of the SIMD width), in every dtype, with the extension's op and with the pure-torch fallback."""
from __future__ import annotations

import pytest
import torch

from specserve import kernels
from specserve.runtime import sampling
from specserve.models import fused


def _cases(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for rows, n in ((1, 49152), (5, 49152), (3, 17), (2, 1), (4, 33)):
        x = torch.randn(rows, n, generator=g)
        out.append(x)
        out.append(torch.randint(0, 3, (rows, n), generator=g).float())  # many ties
        y = x.clone()
        y[:, -1] = float("inf")
        y[0, n // 2] = float("inf")  # two +inf: the first wins
        out.append(y)
        y = x.clone()
        y[-1, n // 3] = float("nan")
        y[0, -1] = float("nan")
        out.append(y)
        out.append(torch.full((rows, n), float("-inf")))
        y = torch.full((rows, n), -1.0)
        y[:, -1] = 0.0
        y[0, 0] = -0.0  # ±0 compare equal: the first one wins
        out.append(y)
    return [x.to(dtype) for x in out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_kernel_matches_torch_argmax(dtype: torch.dtype) -> None:
    kernels.load()
    for x in _cases(dtype):
        assert torch.ops.specserve.argmax_rows(x) == x.argmax(dim=-1).tolist()
        assert sampling.argmax_rows(x) == x.argmax(dim=-1).tolist()


def test_fallback_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "available", lambda: False)
    for x in _cases(torch.float32):
        assert sampling.argmax_rows(x) == x.argmax(dim=-1).tolist()


def test_non_contiguous_rows() -> None:
    kernels.load()
    x = torch.randn(49152, 4).t()  # rows strided in memory
    assert torch.ops.specserve.argmax_rows(x) == x.argmax(dim=-1).tolist()


def test_bad_shape_is_an_error() -> None:
    kernels.load()
    with pytest.raises(RuntimeError, match="argmax_rows"):
        torch.ops.specserve.argmax_rows(torch.zeros(3))
