"""What a drafter may know about the engine it drafts for (instead of the engine itself).

DrafterContext: the target (its ModelConfig, and its frozen weights for drafters that share the
embedding or LM head), the tokenizer check, the resolved config, the KV budget to take the draft
pool from, and the verify-window policy's `floor`.
Feature contract: a drafter declares `aux_layers` (target layer ids); the engine then hands it the
target's hidden states of those layers, [n, len(aux_layers), H] per request, in that order, for
prefill chunks and for the committed rows of each verify window (never for rejected drafts).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..cache.budget import KVBudget
from ..config import EngineConfig
from ..loading.checkpoint import Checkpoint
from ..models import LlamaModel, resolve_dtype
from ..models.config import ModelConfig


log = logging.getLogger("specserve")

#: trailing token ids a draft model's vocabulary may differ from the target's by (llama.cpp allows as many)
MAX_VOCAB_PAD = 128


def draft_dtype(config: EngineConfig, default: torch.dtype, quantized: bool = True) -> torch.dtype:
    """--speculative-draft-dtype, or `default` when it is not given (`auto` follows --quantization
    only for draft models that are quantized like the target)."""
    if config.speculative_draft_dtype is None:
        return default
    return resolve_dtype(config.speculative_draft_dtype, config.quantization if quantized else None)


@dataclass(frozen=True)
class SpecSettings:
    """The speculative settings, resolved once (speculative/resolve.py:spec_settings is their one source)."""

    num_draft_tokens: int  # K: drafts per request per step (trees: nodes besides the root)
    num_steps: int  # EAGLE3/MTP: chain or tree depth (0: a chain of K)
    topk: int  # EAGLE3/MTP: children per expanded node (1: chains)
    block_size: int | None  # block drafters: rows per drafted block, the anchor included (None: not one)
    window: str  # the verify-window policy


@dataclass
class DrafterContext:
    config: EngineConfig  # resolved: AUTO and the window policy are concrete
    target: LlamaModel
    tokenizer: object | None
    kv_budget: KVBudget
    settings: SpecSettings
    #: cumulative draft confidence below which a drafter may stop drafting a request (the window
    #: policy would not verify those positions anyway); 0 = draft the whole window
    floor: float = 0.0
    #: the draft model's checkpoint (--speculative-draft-model-path), opened once by the engine's memory check
    draft_checkpoint: Checkpoint | None = None

    @property
    def target_cfg(self) -> ModelConfig:
        return self.target.cfg

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def greedy_draft(self) -> bool:
        return bool(self.config.value("speculative_greedy_draft"))

    def draft_dtype(self, default: torch.dtype, quantized: bool = True) -> torch.dtype:
        return draft_dtype(self.config, default, quantized)

    def shared_vocab(self, draft_tok, draft_cfg: ModelConfig) -> int:  # noqa: ANN001
        """How many leading token ids target and draft model share: a draft model must have the target's
        tokenizer, up to MAX_VOCAB_PAD trailing ids (padding rows: Qwen2.5 pads its 151,665 tokens to 152,064
        rows at 7B and up, to 151,936 below) whose strings agree where both have them. Refuses naming the first
        difference."""
        t_tok, t_cfg = self.tokenizer, self.target.cfg
        if abs(draft_cfg.vocab_size - t_cfg.vocab_size) > MAX_VOCAB_PAD:
            raise ValueError(f"draft model vocabulary differs: target logits have {t_cfg.vocab_size} entries, "
                             f"draft {draft_cfg.vocab_size}; STANDALONE needs the same tokenizer (at most "
                             f"{MAX_VOCAB_PAD} trailing ids may differ)")
        shared = min(draft_cfg.vocab_size, t_cfg.vocab_size)
        if t_tok is not None and draft_tok is not None:
            n = min(t_tok.vocab_size, draft_tok.vocab_size)
            for i in range(n):
                if t_tok.id_to_piece(i) != draft_tok.id_to_piece(i):
                    raise ValueError(f"draft tokenizer differs from the target's at id {i}: "
                                     f"{t_tok.id_to_piece(i)!r} vs {draft_tok.id_to_piece(i)!r}")
            if abs(t_tok.vocab_size - draft_tok.vocab_size) > MAX_VOCAB_PAD:
                raise ValueError(f"draft tokenizer has {draft_tok.vocab_size} tokens, target {t_tok.vocab_size} "
                                 f"(at most {MAX_VOCAB_PAD} trailing ids may differ)")
            if t_tok.vocab_size != draft_tok.vocab_size:  # a token only one of them has is never drafted
                shared = min(shared, n)
        return shared
