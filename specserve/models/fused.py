"""The lean layer loop: the decoder's non-matmul steps as single ops of specserve's C++ extension.

Per layer the fused path runs 4 linears and 5 ops: rms_norm (first layer) / add_rms_norm (residual add
fused with the next norm), rope_kv_write (RoPE of q and k, K/V into the pool), paged_attention (ragged:
no padded query rows or context entries) and silu_mul. Measured against torch.compile on the same glue
(docs/benchmarks.md, "The fused ops against torch.compile"): faster per call at 1 and 8 rows, with no
compile time. When every projection is block-quantized (w4a8/w8a8, the default for a
quantized GGUF) and nothing runs between the ops, the whole loop is one C++ op (`decoder_layers`,
kernels/csrc/decoder.cpp) calling the same ops in the same order: bit-identical, without the interpreter. The pure-torch layer in llama.py stays as the reference the tests
compare against and as the fallback when the extension cannot be built.
"""
from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch

from .forward_batch import ForwardBatch

_state = {"enabled": True, "available": None}


def available() -> bool:
    """Whether the extension loads (built once, cached); a build failure falls back to pure torch."""
    if _state["available"] is None:
        try:
            from .. import kernels

            kernels.load()
            _state["available"] = True
        except Exception as e:  # noqa: BLE001 - any build/load failure means: use the reference path
            warnings.warn(f"specserve kernels unavailable, using the pure-torch layer loop: {e}", stacklevel=2)
            _state["available"] = False
    return bool(_state["available"])


def enabled() -> bool:
    return _state["enabled"] and available()


@contextmanager
def reference_layers() -> Iterator[None]:
    """Run the pure-torch reference layer loop inside the block (tests, benchmarks)."""
    old = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = old


def attention(q: torch.Tensor, fb: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
              window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Ragged paged attention of packed q [T, H, hd] (K/V already in the pool) → [T, H * hd]. `window`: the
    layer's sliding window, on top of the batch's; `scale`: q·k multiplier (default hd ** -0.5)."""
    return torch.ops.specserve.paged_attention(
        q, k_cache, v_cache, fb.q_start, fb.positions, fb.ctx_slots, fb.ctx_start, fb.ctx_first, fb.mask,
        fb.mask_start, fb.causal and fb.mask is None, combined_window(fb.window, window),
        1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)


def combined_window(a: int | None, b: int | None) -> int:
    """The narrower of two sliding windows, as the kernels take it (0 = none)."""
    ws = [w for w in (a, b) if w]
    return min(ws) if ws else 0


def counters(reset: bool = False) -> tuple[int, int]:
    """(query rows × heads, q·k products) computed by paged_attention since the last reset."""
    rows, dots = torch.ops.specserve.attention_counters(reset)
    return rows, dots
