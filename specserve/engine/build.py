"""Build an engine: the config checked and made concrete, then its parts in the order the memory budget is
spent: target → recurrent-state pool (hybrid targets) → drafter (its KV pool reserved first) → the target's KV
pool from what is left, and its runner (tensor-parallel: rank 0's) → the window policy, which measures both →
with --prefix-cache-dir, the prefix cache's disk tier (its store opened, each pool fingerprinted)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..cache.budget import KVBudget
from ..cache.fingerprint import FORMAT_VERSION, target_fingerprint
from ..cache.kv_pool import KVPool, parse_memory
from ..cache.page_store import PageStore
from ..config import EngineConfig
from ..cost.policy import make_policy, policies
from ..drafters.artifact import is_drafter_artifact
from ..drafters.base import capabilities, create_drafter
from ..drafters.context import DrafterContext
from ..loading.checkpoint import open_checkpoint
from ..drafters.standalone import draft_load_mode
from ..loading.pipeline import build_model, default_quantization, resident_bytes
from ..models import LlamaModel, resolve_dtype, resolve_kv_dtype
from ..parallel import start_tensor_parallel
from ..runtime.runner import ModelRunner
from ..speculative.resolve import check_config, resolve_config, resolve_settings
from .engine import Engine, EngineParts


def build_engine(config: EngineConfig, model: LlamaModel | None = None, tokenizer: Any = None) -> Engine:
    """An engine for `config`; `model` (with its tokenizer): an already-built target instead of a checkpoint load."""
    config = check_config(config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    # NOTE: made concrete first: the drafter, the cost curve's cache key and meta read config.quantization
    draft_ckpt = source = None
    disk_budget = None if config.prefix_cache_dir is None else \
        parse_memory(config.value("prefix_cache_disk_budget"), "--prefix-cache-disk-budget", fraction=False)
    if model is None:
        ckpt = open_checkpoint(config.model)
        source = ckpt.path
        config = replace(config, quantization=default_quantization(ckpt, config.dtype, config.quantization))
        dtype = resolve_dtype(config.dtype, config.quantization)
        # NOTE: one memory check before anything loads: target + draft model + KV pools (target's and draft's)
        reserve = {}
        algo, path = config.speculative_algorithm, config.speculative_draft_model_path
        if algo and path and capabilities(algo).draft_model and not is_drafter_artifact(path):  # a draft model
            draft_ckpt = open_checkpoint(path)
            reserve["draft model"] = resident_bytes(draft_ckpt, *draft_load_mode(config, dtype))
        reserve["KV cache"] = parse_memory(config.kv_cache_memory)
        model, tokenizer = build_model(ckpt, dtype, config.quantization, reserve)
    elif config.quantization == "none":
        config = replace(config, quantization=None)
    mcfg = model.cfg
    if config.prefix_cache_dir is not None and mcfg.is_hybrid:
        raise ValueError(f"--prefix-cache-dir: {mcfg.name or 'this model'} is a hybrid (recurrent) model, which "
                         "does not cache prefixes (its state at a page boundary is not kept)")
    config = resolve_config(config, mcfg)  # AUTO and the default window made concrete
    max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, model.dtype)
    budget = KVBudget(parse_memory(config.kv_cache_memory), mcfg, kv_dtype, config.page_size)
    # hybrid targets: one recurrent-state slot per request that may run, reserved before any KV
    states = budget.state_pool(mcfg, model.dtype, config.max_running_requests) if mcfg.is_hybrid else None
    window = config.speculative_window if config.speculative_algorithm else "fixed"
    settings = resolve_settings(config, mcfg) if config.speculative_algorithm else None
    drafter = None
    if settings:  # NOTE: the drafter reserves its pool before the target's is sized
        floor = policies()[window].floor_for(config)
        drafter = create_drafter(config.speculative_algorithm,
                                 DrafterContext(config, model, tokenizer, budget, settings, floor, draft_ckpt))
    tp = start_tensor_parallel(config, mcfg) if config.tp_size > 1 else None
    # NOTE: under TP each rank's pool holds its KV heads only; rank 0's shard is the largest
    pages = KVPool.pages_for_budget(tp.model.cfg if tp else mcfg, budget.remaining, config.page_size, kv_dtype)
    if pages < 1:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory!r} is too small for one KV page of this model")
    if tp:
        kv = tp.kv_pool(pages, kv_dtype)
        runner = tp.runner(kv)
    else:
        kv = KVPool(mcfg, pages, config.page_size, kv_dtype)
        runner = ModelRunner(model, kv, states)
    policy = make_policy(window, config, runner if drafter else None, drafter)
    engine = Engine(EngineParts(config, model, tokenizer, max_model_len, kv, states, runner, drafter, settings,
                                policy, tp))
    if disk_budget is not None and engine.prefix is not None:
        try:
            store = PageStore(config.prefix_cache_dir, disk_budget, FORMAT_VERSION)
        except OSError as e:
            engine.close()
            raise ValueError(f"--prefix-cache-dir {config.prefix_cache_dir}: {e.strerror or e}") from None
        engine.prefix.use_disk(store, target_fingerprint(model, config.quantization, kv, source))
    return engine
