"""A tensor-parallel forward worker (ranks ≥ 1): its shard of the target and of the KV pool, driven by
rank 0's commands. It decides nothing: every scheduling, drafting and acceptance decision is made
once, on rank 0, and arrives here as the arguments of a forward or a KV move (so ranks cannot diverge).

    python -m specserve.parallel.worker --rank R --config JSON     (started by rank 0 or `serve --node-rank`)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..cache.kv_pool import KVPool
from ..config import EngineConfig
from ..runtime.runner import ModelRunner
from ..models import model_class, resolve_dtype
from ..loading.checkpoint import load_checkpoint
from ..formats.quant import quantize_model
from .comm import TensorParallel
from .shard import Layout, shard_checkpoint

log = logging.getLogger("specserve.parallel")
# the fields a worker needs: the target's file and numerics, and where to meet the others
WORKER_FIELDS = ("model", "dtype", "quantization", "page_size", "num_threads", "tp_size", "dist_init_addr", "nnodes")
TIMEOUT = timedelta(seconds=float(os.environ.get("SPECSERVE_DIST_TIMEOUT", "1800")))


def init_group(config: EngineConfig, rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{config.dist_init_addr}", rank=rank,
                            world_size=config.tp_size, timeout=TIMEOUT)


def build_shard(config: EngineConfig, rank: int) -> torch.nn.Module:
    """Load the checkpoint, keep this rank's slices (a GGUF's quantized blocks sliced, not re-quantized),
    and build the shard model with its collectives attached."""
    dtype = resolve_dtype(config.dtype, config.quantization)
    blocks: dict | None = {} if config.quantization else None
    cfg, sd, _ = load_checkpoint(config.model, dtype, blocks)
    layout = Layout.make(cfg, rank, config.tp_size)
    sd, blocks = shard_checkpoint(cfg, layout, sd, blocks)
    model = model_class(cfg.architecture)(layout.config(cfg), dtype)
    model.load_weights(sd)
    del sd
    if config.quantization:
        quantize_model(model, config.quantization, blocks)
    tp = TensorParallel(layout)
    model.tp = tp
    for layer in model.layers:
        layer.tp = tp
    return model


def receive() -> tuple[str, dict]:
    box: list = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def serve_rank(config: EngineConfig, rank: int) -> None:
    """Join the group, build the shard, then run rank 0's commands until it says stop."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    init_group(config, rank)
    model = build_shard(config, rank)
    cmd, args = receive()
    assert cmd == "init", cmd
    kv = KVPool(model.cfg, args["pages"], config.page_size, args["dtype"])
    runner = ModelRunner(model, kv)
    while True:
        cmd, args = receive()
        if cmd == "forward":
            runner.forward(**args)
        elif cmd == "move":
            kv.move(args["src"], args["dst"])
        elif cmd == "stop":
            break
        else:
            raise RuntimeError(f"tensor-parallel rank {rank}: unknown command {cmd!r}")
    dist.destroy_process_group()


def spawn(config: EngineConfig, rank: int) -> subprocess.Popen:
    """Start rank `rank` as a child process running this module."""
    fields = {f: getattr(config, f) for f in WORKER_FIELDS}
    return subprocess.Popen([sys.executable, "-m", "specserve.parallel.worker", "--rank", str(rank),
                             "--config", json.dumps(fields)])


def run_node(config: EngineConfig) -> int:
    """`specserve serve --node-rank N` (N > 0): run this node's ranks until rank 0 stops them; SIGINT or
    SIGTERM stops them here. Returns the worst exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    per = config.tp_size // config.nnodes
    procs = [spawn(config, r) for r in range(config.node_rank * per, (config.node_rank + 1) * per)]
    log.info("node %d: tensor-parallel ranks %d..%d joining %s", config.node_rank, config.node_rank * per,
             (config.node_rank + 1) * per - 1, config.dist_init_addr)

    def stop(*_: object) -> None:
        for p in procs:
            p.terminate()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return max(abs(p.wait()) for p in procs)


def _die_with_parent() -> None:
    """Linux: SIGTERM when the parent dies (even by SIGKILL), so no worker outlives its engine."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specserve.parallel.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--config", required=True, help="JSON of the EngineConfig fields a worker needs")
    a = p.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops its workers in order
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {a.rank} %(levelname)s: %(message)s")
    try:
        serve_rank(EngineConfig(**json.loads(a.config)), a.rank)
    except Exception as e:  # noqa: BLE001 - rank 0 gone or a bad command: say so, exit non-zero
        log.error("tensor-parallel rank %d stopped: %s: %s", a.rank, type(e).__name__, e)
        sys.exit(1)


if __name__ == "__main__":
    main()
