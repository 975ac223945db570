"""Memory the process may use: a memory cgroup's limit (v1 or v2, the tightest along the process's path) caps
what the checks before a load call available, and what a fraction of --kv-cache-memory is a fraction of."""
from __future__ import annotations

from pathlib import Path

import pytest

from specserve import memory


def _fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proc: str, files: dict[str, str]) -> None:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self_cgroup").write_text(proc)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "self_cgroup")


def test_v2_limit_of_an_ancestor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(tmp_path, monkeypatch, "0::/pod/app\n", {
        "pod/app/memory.max": "max", "pod/app/memory.current": "100",
        "pod/memory.max": str(2 << 30), "pod/memory.current": str(1 << 30)})
    assert memory.cgroup_memory() == (2 << 30, 1 << 30)
    assert memory.available_memory_bytes() <= 1 << 30
    assert memory.total_memory_bytes() == 2 << 30
    with pytest.raises(MemoryError, match=r"needs about 1\.50 GiB but only 1\.00 GiB"):
        memory.check_memory(3 << 29, "the model")


def test_v1_limit_and_no_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(tmp_path, monkeypatch, "4:memory:/box\n1:cpu:/\n", {
        "memory/box/memory.limit_in_bytes": str(3 << 30), "memory/box/memory.usage_in_bytes": str(1 << 30),
        "memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "5"})
    assert memory.cgroup_memory() == (3 << 30, 1 << 30)
    _fake(tmp_path / "none", monkeypatch, "0::/\n", {"memory.max": "max", "memory.current": "5"})
    assert memory.cgroup_memory() is None


def test_kv_cache_fraction_is_of_the_cgroup_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specserve.cache.kv_pool import parse_memory

    _fake(tmp_path, monkeypatch, "0::/\n", {"memory.max": str(4 << 30), "memory.current": "0"})
    assert parse_memory(0.25) == 1 << 30
