"""What the OS says about memory: total RAM, what is available now, this process's peak RSS; and zeroed
buffers the OS backs only as they are written."""
from __future__ import annotations

import math
import mmap
import os
import resource
from pathlib import Path

import torch


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (page cache that can be dropped counts as free), None off Linux."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(need: int, what: str) -> None:
    """Refuse before loading when `need` bytes exceed what the OS reports available."""
    free = available_memory_bytes()
    if free is not None and need > free:
        raise MemoryError(f"{what} needs about {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB of memory is "
                          "available; free memory, lower --kv-cache-memory, or use a smaller model")


def peak_rss_bytes() -> int:
    """This process's high-water resident set: /proc's VmHWM (ru_maxrss survives exec on Linux, so a process
    started by a larger one would report its parent's peak), else ru_maxrss (KiB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on an anonymous mapping: the OS hands out zero pages and backs a page with memory only
    when it is first written, so a KV pool costs RSS for the slots requests have used, not its whole budget
    (`torch.zeros` writes every byte up front). Page-aligned. NOTE: the tensor holds the mapping alive."""
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=dtype).view(shape)
