"""Rank 0's side of tensor parallelism: start the workers, hold rank 0's shard, and turn every target
forward and KV move into one command broadcast to all ranks before running its own share.

    TPDriver(config)      spawn ranks 1…, meet them (gloo), build rank 0's shard; a watchdog polls them
    driver.kv_pool(pages) every rank allocates the same pages (sized from rank 0's shard, the largest)
    driver.runner(kv)     a ModelRunner whose forward is broadcast first, then run locally
    driver.close()        stop the workers in order (also at exit); kill any that do not stop

A worker that dies makes the next (or the current) collective fail: that surfaces as FatalEngineError
naming the rank, which fails the requests in flight instead of being retried per request.
"""
from __future__ import annotations

import atexit
import logging
import socket
import subprocess
import threading
import time
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..cache.kv_pool import KVPool
from ..config import EngineConfig
from ..core import FatalEngineError
from ..runtime.runner import ModelRunner
from .worker import build_shard, init_group, spawn

log = logging.getLogger("specserve.parallel")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPDriver:
    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise ValueError("--tp-size: one tensor-parallel engine per process at a time; close the other "
                             "first (LLM.close())")
        if config.dist_init_addr is None:
            config = replace(config, dist_init_addr=f"127.0.0.1:{free_port()}")
        self.config = config
        self.failed: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self._closed = False
        per_node = config.tp_size // config.nnodes
        self.procs: dict[int, subprocess.Popen] = {r: spawn(config, r) for r in range(1, per_node)}
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="specserve-tp-watchdog", daemon=True).start()
        log.info("tensor parallel: %d ranks (%d on this node) meeting at %s", config.tp_size, per_node,
                 config.dist_init_addr)
        try:
            init_group(config, 0)
            self.model = build_shard(config, 0)
        except BaseException:
            self.close()
            raise

    # ---- commands ----
    def send(self, cmd: str, **args: Any) -> None:
        if self.failed:
            raise FatalEngineError(self.failed)
        try:
            dist.broadcast_object_list([(cmd, args)], src=0)
        except RuntimeError as e:
            raise self.fatal(e) from e

    def fatal(self, e: BaseException) -> FatalEngineError:
        """A collective failed: name the rank that died if one did (give it a moment to be reaped)."""
        deadline = time.monotonic() + 2.0
        while not self.failed and time.monotonic() < deadline:
            self._poll()
            time.sleep(0.05)
        if not self.failed:
            self.failed = f"tensor-parallel collective failed: {type(e).__name__}: {e}"
        return FatalEngineError(self.failed)

    def kv_pool(self, pages: int, dtype: torch.dtype) -> KVPool:
        self.send("init", pages=pages, dtype=dtype)
        return _TPKVPool(self, self.model.cfg, pages, self.config.page_size, dtype)

    def runner(self, kv: KVPool) -> ModelRunner:
        return _TPRunner(self, kv)

    # ---- liveness and shutdown ----
    def _poll(self) -> None:
        for rank, p in self.procs.items():
            code = p.poll()
            if code is not None and not self._closed and not self.failed:
                self.failed = f"tensor-parallel rank {rank} exited with code {code}"
                log.error("%s", self.failed)
                for cb in self.on_failure:
                    cb(self.failed)

    def _watch(self) -> None:
        while not self._closed and not self.failed:
            self._poll()
            time.sleep(0.2)

    def close(self, timeout: float = 10.0) -> None:
        """Tell the workers to stop, wait for them, kill stragglers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.failed and dist.is_initialized():
            try:
                dist.broadcast_object_list([("stop", {})], src=0)
            except RuntimeError:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class _TPKVPool(KVPool):
    def __init__(self, driver: TPDriver, *args: Any) -> None:
        super().__init__(*args)
        self.driver = driver

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.driver.send("move", src=src, dst=dst)
        super().move(src, dst)


class _TPRunner(ModelRunner):
    def __init__(self, driver: TPDriver, kv: KVPool) -> None:
        super().__init__(driver.model, kv)
        self.driver = driver

    def forward(self, page_tables: list[list[int]], starts: list[int], tokens: list[list[int]],
                logits_offsets: list[list[int]], capture_layers: tuple[int, ...] = (), positions: Any = None,
                masks: Any = None, states: Any = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        args = dict(page_tables=page_tables, starts=starts, tokens=tokens, logits_offsets=logits_offsets,
                    capture_layers=capture_layers, positions=positions, masks=masks)
        self.driver.send("forward", **args)
        try:
            return super().forward(**args)
        except RuntimeError as e:  # a collective inside the forward: a rank died mid-step
            if "gloo" in str(e) or "Connection" in str(e) or self.driver.failed:
                raise self.driver.fatal(e) from e
            raise
