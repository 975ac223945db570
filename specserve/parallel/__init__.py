"""Tensor parallelism: rank 0 (the engine) drives SPMD workers that each hold one shard."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..models.config import ModelConfig
    from .driver import TPDriver


def start_tensor_parallel(config: EngineConfig, mcfg: ModelConfig) -> TPDriver:
    """Rank 0 of --tp-size ranks: workers hold the other shards. The unsharded model stays with the engine
    for what drafters share with the target (embedding, head, norm) and for the tokenizer."""
    from ..loading.checkpoint import resolve_model_path
    from .driver import TPDriver
    from .shard import Layout

    Layout.make(mcfg, 0, config.tp_size)  # refuse unsupported models before starting any process
    if config.node_rank != 0:
        raise ValueError(f"--node-rank {config.node_rank}: only node 0 runs the engine (others: specserve serve "
                         "--node-rank N starts their workers)")
    try:
        resolve_model_path(config.model)
    except FileNotFoundError:
        raise ValueError(f"--tp-size {config.tp_size}: workers load the target from a file; {config.model!r} "
                         "is not a checkpoint path or alias") from None
    return TPDriver(config)
