"""MTP / NextN: eh_proj over [norm(embed(x_{t+1})); norm(h_t)] → one decoder block → shared head.

h_t is the target's final hidden state after its final norm (as vLLM feeds DeepSeek's MTP); the
head is the target's own LM head (frozen, shared). One module is reused for every chain step,
feeding its own output hidden back in as the next h. Runs on the chain runtime of EAGLE-3.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.llama import LlamaModel
from .eagle3 import ChainNet
from .nets import DraftLayer, DrafterConfig, dense_head


class MtpNet(ChainNet):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        H, eps = cfg.target_hidden_size, cfg.rms_norm_eps
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_norm = nn.RMSNorm(H, eps=eps)
        self.layer = DraftLayer(self.mcfg, H)
        self.norm = nn.RMSNorm(H, eps=eps)
        self.head_w: torch.Tensor | None = None
        self.target_norm: torch.Tensor | None = None

    def bind(self, target: LlamaModel) -> None:
        super().bind(target)
        dt = self.cos_table.dtype
        self.head_w = dense_head(target)[self.draft_ids].to(dt)
        self.target_norm = target.norm.detach().to(dt)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        h = feats[:, 0]  # the target's last layer (aux_layer_ids = (N − 1,))
        return F.rms_norm(h, (h.shape[-1],), self.target_norm, self.cfg.rms_norm_eps)

    def inputs(self, tokens: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(self.embed(tokens)), self.hnorm(h)], dim=-1))
        return self.input_norm(x), x

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return self.norm(o) @ self.head_w.T
