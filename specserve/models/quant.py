"""Weight-only 4-bit linear layers for CPU decoding (`--quantization int4`).

Decode on CPU is bound by reading weights: fp32 SmolLM2 moves ~540 MB per token. Groups of 32
input weights share a scale and a zero point (asymmetric, as GGUF Q4_1), packed for torch's
`_weight_int4pack_mm_for_cpu`, which dequantizes w = (q − 8)·scale + zero on the fly with bf16
activations. Speculative decoding stays lossless with respect to this quantized model.
"""
from __future__ import annotations

import torch

GROUP = 32


class Int4Weight:
    """A [n, k] weight stored as 4-bit codes + per-group (scale, zero). Call it like F.linear."""

    def __init__(self, w: torch.Tensor) -> None:
        n, k = w.shape
        g = w.float().reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8 * scale  # kernel: (q - 8) * scale + zero == q * scale + lo
        self.shape = (n, k)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scale_zero = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()  # [k/32, n, 2]

    @staticmethod
    def supported(w: torch.Tensor) -> bool:
        return w.dim() == 2 and w.shape[1] % GROUP == 0 and w.shape[0] % 16 == 0

    def dequantize(self) -> torch.Tensor:
        """The effective weight (tests): what the kernel multiplies with."""
        eye = torch.eye(self.shape[1], dtype=torch.bfloat16)
        return self(eye).T.float()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed, GROUP,
                                              self.scale_zero)
        y = y.reshape(*shape[:-1], self.shape[0])
        return y if bias is None else y + bias


def linear(x: torch.Tensor, w: "torch.Tensor | Int4Weight", bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, Int4Weight):
        return w(x, bias)
    return torch.nn.functional.linear(x, w, bias)
