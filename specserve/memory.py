"""What the OS says about memory: total RAM, what is available now, this process's peak RSS; and zeroed
buffers the OS backs only as they are written."""
from __future__ import annotations

import math
import mmap
import os
import resource
from pathlib import Path

import torch


CGROUP_ROOT, PROC_CGROUP = Path("/sys/fs/cgroup"), Path("/proc/self/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge page-aligned number


def cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) in bytes of the tightest memory cgroup this process is in, itself or an ancestor (v2:
    memory.max / memory.current; v1: memory.limit_in_bytes / memory.usage_in_bytes); None without a limit. A
    container's limit is what the OOM killer enforces, whatever the host's RAM."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, int] | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, files = CGROUP_ROOT, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = CGROUP_ROOT / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        here = base / path.lstrip("/")
        for d in (here, *here.parents):
            try:
                limit, usage = ((d / f).read_text().strip() for f in files)
            except OSError:
                limit = "max"
            if limit != "max" and int(limit) < _UNLIMITED:
                if best is None or int(limit) - int(usage) < best[0] - best[1]:
                    best = (int(limit), int(usage))
            if d == base:
                break
    return best


def total_memory_bytes() -> int:
    """RAM, or the memory cgroup's limit when that is lower (a fraction of it sizes --kv-cache-memory)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cg = cgroup_memory()
    return ram if cg is None else min(ram, cg[0])


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (page cache that can be dropped counts as free), capped by what the memory
    cgroup has left (its limit minus its usage); None off Linux."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    cg = cgroup_memory()
    if cg is not None:
        left = max(0, cg[0] - cg[1])
        free = left if free is None else min(free, left)
    return free


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
