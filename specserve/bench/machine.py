"""What machine a benchmark ran on. NOTE: this VM changes CPU kind from one start to the next (AMD EPYC with
AVX-512 BF16/VNNI, an AMD EPYC with AVX2 only; a Sapphire Rapids whose AMX faulted), so only ratios measured in one
run compare; every result JSON carries this record, with the kernel path that ran."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

# instruction-set extensions that decide which kernel paths can run
_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
          "amx_tile", "amx_int8", "amx_bf16")


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", "", "x86_64"):
                model = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        pass
    return model, flags


def stream_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Best-of-N read bandwidth of a buffer far larger than the caches, with this process's threads."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def machine_info() -> dict[str, Any]:
    import torch

    model, flags = _cpuinfo()
    usable: dict[str, bool] = {}
    for name in ("avx2", "avx512", "avx512_bf16", "vnni", "amx_tile"):
        probe = getattr(torch.cpu, f"_is_{name}_supported", None)
        try:
            usable[name] = bool(probe()) if probe is not None else False
        except Exception:  # noqa: BLE001 - a probe that faults counts as unusable
            usable[name] = False
    return {
        "cpu_model": model,
        "cpu_flags": sorted(f for f in _FLAGS if f in flags),
        "torch_usable": usable,  # what torch itself detects and may dispatch to (AMX can be listed yet faulting)
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "read_bandwidth_gbs": round(stream_bandwidth_gbs(), 1),  # measured as the run ends
        "qgemm_isa": _qgemm_isa(),
    }


def _qgemm_isa() -> str:
    """The instruction sets specserve's integer kernels use here, best first (their op's own answer)."""
    import torch

    from .. import kernels

    try:
        kernels.load()
        return str(torch.ops.specserve.quant_isa())
    except Exception as e:  # noqa: BLE001 - a machine record never fails a benchmark
        return f"unavailable ({type(e).__name__})"
