"""Training losses of the learned drafters, one sequence at a time (dense attention, autograd).

Labels are the target's greedy tokens (`Sequence.targets`: its argmax at every position, or the text
itself when the target wrote it), so cross-entropy on them distils the target's argmax; only
assistant tokens inside the draft vocabulary carry loss. A draft position whose earlier inputs leave
the target's greedy path (the text disagrees with the target there) is never reached in serving at
T = 0; it is weighted `offpath` (0: dropped) and left out of the accuracy statistics. Each loss also returns top-1 accuracy per draft position and an offline estimate of
the greedy acceptance length τ (leading run of correct positions + 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..drafters.dflash import DFlashNet
from ..drafters.eagle3 import ChainNet
from ..drafters.nets import dense_attention
from .data import Sequence


def _stats(correct: torch.Tensor, valid: torch.Tensor) -> dict[str, object]:
    """correct/valid [N, K] (row = one draft chain or block). τ estimate from rows valid throughout."""
    acc = [(c[v].float().mean().item() if v.any() else float("nan")) for c, v in zip(correct.T, valid.T)]
    full = valid.all(dim=1)
    run = torch.cumprod(correct[full].long(), dim=1).sum(dim=1).float()
    return {"acc": acc, "tau": 1.0 + (run.mean().item() if len(run) else float("nan"))}


def _agree(seq: Sequence) -> torch.Tensor:
    """[S] bool: the text token at p is the target's greedy token there (position 0: True)."""
    agree = seq.ids == seq.targets
    agree[0] = True
    return agree


def chain_loss(net: ChainNet, seq: Sequence, t2d: torch.Tensor, steps: int, decay: float = 0.8,
               offpath: float = 0.0) -> tuple[torch.Tensor, dict]:
    """EAGLE-3 training-time test. Row t (token x_t, feature of t − 1) predicts x_{t+1} at step 0;
    step k feeds row t the step k − 1 output and token x_{t+k} at position t + k and predicts
    x_{t+k+1}. Attention at step k: step-0 keys of rows ≤ t, plus each later step's key of row t
    — what the serving chain sees when row t is the anchor. L = Σ_k decay^k · CE_k."""
    ids, S, labels, agree = seq.ids, len(seq.ids), seq.targets, _agree(seq)
    path = torch.ones(S, dtype=torch.bool)  # step k: the inputs of steps 1..k were all on the greedy path
    feats = torch.cat([torch.zeros_like(seq.feats[:1]), seq.feats[:-1]])  # row t gets the feature of t − 1
    h = net.fuse(feats)
    t = torch.arange(S)
    causal = t[None, :] <= t[:, None]
    eye = torch.eye(S, dtype=torch.bool)
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    total = h.new_zeros(())
    correct, valid = [], []
    max_pos = net.cfg.max_position_embeddings - 1
    for k in range(steps):
        src = (t + k).clamp(max=S - 1)
        tgt_pos = t + k + 1
        ok = tgt_pos < S
        tgt = torch.where(ok, t2d[labels[tgt_pos.clamp(max=S - 1)]], -1)
        ok &= (tgt >= 0) & seq.loss_mask[tgt_pos.clamp(max=S - 1)]
        if k:
            path &= agree[src]
        mask = torch.cat([causal] + [eye] * k, dim=1)
        a, x = net.inputs(ids[src], h)
        q, kk, vv = net.layer.project(a, *net.rope(src.clamp(max=max_pos)))
        ks.append(kk)
        vs.append(vv)
        o = net.layer.finish(x, dense_attention(q, torch.cat(ks), torch.cat(vs), mask))
        logits = net.logits(o)
        w = (path.float() + offpath * (~path).float())[ok]
        if ok.any() and w.sum() > 0:
            ce = F.cross_entropy(logits[ok], tgt[ok], reduction="none")
            total = total + decay**k * (ce * w).sum() / w.sum()
        correct.append(logits.argmax(-1) == tgt)
        valid.append(ok & path)
        h = o
    return total, _stats(torch.stack(correct, 1), torch.stack(valid, 1))


def block_loss(net: DFlashNet, seq: Sequence, t2d: torch.Tensor, num_anchors: int, gamma: float,
               gen: torch.Generator, offpath: float = 0.0, anchors: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict]:
    """DFlash/DSpark: random anchors s (response positions); block [x_s, MASK × (B − 1)] at positions
    s.., seeing context features of positions < s and its own block (bidirectional). Offset k is
    weighted exp(−(k − 1)/γ). DSpark's transition term is fed the text token at k − 1 (on the greedy
    path: the accepted draft, the only prefix that matters for acceptance); its confidence head learns P(offset k correct) by BCE."""
    ids, S, B = seq.ids, len(seq.ids), net.cfg.block_size
    cand = torch.nonzero(seq.loss_mask[1:]).squeeze(1)  # anchors whose next token is a response token
    if len(cand) == 0:
        return net.fc.weight.new_zeros(()), {"acc": [float("nan")] * (B - 1), "tau": float("nan")}
    if anchors is None:  # else: given (tests)
        anchors = cand[torch.randperm(len(cand), generator=gen)[:num_anchors]].sort().values
    N = len(anchors)
    offs = torch.arange(B)
    pos = anchors[:, None] + offs[None, :]  # [N, B]
    ctx = net.context(seq.feats)
    ctx_kv = net.context_kv(ctx, torch.arange(S))
    blk = torch.arange(N).repeat_interleave(B)
    mask = torch.cat([torch.arange(S)[None, :] < anchors.repeat_interleave(B)[:, None],  # context before the anchor
                      blk[:, None] == blk[None, :]], dim=1)  # own block, both directions
    attends = [lambda q, k, v, ck=ck, cv=cv: dense_attention(q, torch.cat([ck, k]), torch.cat([cv, v]), mask)
               for ck, cv in ctx_kv]
    flat_pos = pos.reshape(-1).clamp(max=net.cfg.max_position_embeddings - 1)
    o = net.block_forward(net.block_input(ids[anchors]), flat_pos, attends).view(N, B, -1)[:, 1:]
    tp = pos[:, 1:]
    ok = tp < S
    tpc = tp.clamp(max=S - 1)
    tgt = torch.where(ok, t2d[seq.targets[tpc]], -1)
    ok &= (tgt >= 0) & seq.loss_mask[tpc]
    a = _agree(seq)[tpc]  # offset k is reached only if offsets 1..k−1 were the target's tokens
    path = torch.cat([torch.ones_like(a[:, :1]), torch.cumprod(a[:, :-1].long(), dim=1).bool()], dim=1)
    logits = net.base_logits(o)
    trans = net.transition(ids[tpc - 1])
    if trans is not None:
        logits = logits + trans
    w = torch.exp(-(offs[1:].float() - 1) / gamma)[None, :] * ok * (path.float() + offpath * (~path).float())
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.clamp(min=0).reshape(-1), reduction="none")
    loss = (ce * w.reshape(-1)).sum() / w.sum().clamp(min=1e-9)
    correct = logits.argmax(-1) == tgt
    conf = net.confidence(o, logits)
    ok &= path
    if conf is not None and ok.any():
        loss = loss + F.binary_cross_entropy(conf[ok].clamp(1e-6, 1 - 1e-6), correct[ok].to(conf.dtype))
    return loss, _stats(correct, ok)

