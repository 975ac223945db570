"""DSpark: the DFlash block drafter plus a low-rank Markov head and a per-token confidence.

Markov head: logits at block offset k = head(norm(o_k)) + U · V · norm(embed(x_{k−1})), with
V: H → r and U: r → V_d (rank r), where x_{k−1} is the token drafted at offset k − 1 (the anchor
for k = 1). Drafting is therefore semi-autoregressive at the cost of one r-wide matvec per offset;
the heavy part (the layers and the LM head) stays one parallel pass. U starts at zero, so an
untrained Markov head is exactly DFlash.
Confidence: sigmoid(w · [norm(o_k); max prob; top-1 − top-2 margin] + b) ≈ P(offset k is accepted
| offsets before it were), trained on detached inputs so it never disturbs the draft itself.
"""
from __future__ import annotations

import torch
from torch import nn

from .dflash import DFlashNet
from .nets import DrafterConfig


class DSparkNet(DFlashNet):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        H, r = cfg.target_hidden_size, cfg.markov_rank
        self.markov_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.markov_in = nn.Linear(H, r, bias=False)
        self.markov_out = nn.Linear(r, cfg.draft_vocab_size, bias=False)
        nn.init.zeros_(self.markov_out.weight)
        self.conf = nn.Linear(H + 2, 1)

    def transition(self, prev: torch.Tensor) -> torch.Tensor:
        """[...] previous-offset token ids (target vocabulary) → [..., V_d] transition logits."""
        return self.markov_out(self.markov_in(self.markov_norm(self.embed(prev))))

    @staticmethod
    def logit_stats(logits: torch.Tensor) -> torch.Tensor:
        top = torch.softmax(logits.detach(), dim=-1).topk(2, dim=-1).values
        return torch.stack([top[..., 0], top[..., 0] - top[..., 1]], dim=-1)

    def confidence(self, o: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.norm(o).detach(), self.logit_stats(logits)], dim=-1)
        return torch.sigmoid(self.conf(x)).squeeze(-1)
