"""Teacher-forced acceptance: serving τ at temperature 0 without decoding.

At T = 0 the engine's output is the target's greedy continuation g (lossless), and what a draft
round accepts depends only on the drafts from its anchor and on g. So one target prefill over
prompt + g gives the features the drafter would have seen at every anchor, the drafter drafts
from *every* anchor in one batched forward (block drafters: a block per anchor; chain drafters:
the chain unrolled from every row, as in training-time test), and the serving loop is replayed
on those drafts: window K (fixed policy) capped by max_tokens, a accepted + the bonus token,
emission cut at the end of g (EOS). Same counters as the engine's meta_info, so τ is the one
`LLM.generate` reports, exactly when the features match the engine's (fp64 targets; fp32 differs
only by prefill-vs-verify rounding).
"""
from __future__ import annotations

import torch

from ..drafters.dflash import DFlashNet
from ..drafters.eagle3 import ChainNet
from ..drafters.nets import DraftNet, dense_attention


@torch.no_grad()
def block_drafts(net: DFlashNet, ids: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[N, B − 1] greedy drafts (target ids) of a block drafter from each anchor position."""
    B, S, N = net.cfg.block_size, len(ids), len(anchors)
    dt = net.cos_table.dtype
    ctx_kv = net.context_kv(net.context(feats.to(dt)), torch.arange(S))
    blk = torch.arange(N).repeat_interleave(B)
    mask = torch.cat([torch.arange(S)[None, :] < anchors.repeat_interleave(B)[:, None], blk[:, None] == blk[None, :]], 1)
    attends = [lambda q, k, v, ck=ck, cv=cv: dense_attention(q, torch.cat([ck, k]), torch.cat([cv, v]), mask)
               for ck, cv in ctx_kv]
    pos = (anchors[:, None] + torch.arange(B)[None, :]).reshape(-1)
    o = net.block_forward(net.block_input(ids[anchors]), pos, attends).view(N, B, -1)[:, 1:]
    out, prev = [], ids[anchors]
    for k in range(B - 1):  # offset by offset: DSpark's transition term reads the previous draft
        logits = net.base_logits(o[:, k])
        t = net.transition(prev)
        if t is not None:
            logits = logits + t
        prev = net.draft_ids[logits.argmax(-1)]
        out.append(prev)
    return torch.stack(out, 1)


@torch.no_grad()
def chain_drafts(net: ChainNet, ids: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor, k_max: int) -> torch.Tensor:
    """[N, k_max] greedy drafts of a chain drafter from each anchor: rows ≤ anchor carry the target's
    features (row t: token x_t, feature of t − 1); step k feeds the anchor's chain its own hidden."""
    S, dt = len(ids), net.cos_table.dtype
    f = feats.to(dt)
    h_all = net.fuse(torch.cat([torch.zeros_like(f[:1]), f[:-1]]))
    t = torch.arange(S)
    a, x = net.inputs(ids, h_all)
    q, k0, v0 = net.layer.project(a, *net.rope(t))
    o_all = net.layer.finish(x, dense_attention(q, k0, v0, t[None, :] <= t[:, None]))
    ctx = torch.arange(S)[None, :] <= anchors[:, None]  # [N, S] step-0 keys a chain may read
    h, ks, vs, out = o_all[anchors], [], [], []
    for k in range(k_max):
        tok = net.draft_ids[net.logits(h).argmax(-1)]
        out.append(tok)
        if k == k_max - 1:
            break
        a, x = net.inputs(tok, h)
        q, kk, vv = net.layer.project(a, *net.rope(anchors + k + 1))
        ks.append(kk)
        vs.append(vv)
        own = torch.eye(len(anchors), dtype=torch.bool).repeat(1, len(ks))  # the chain's own earlier steps
        h = net.layer.finish(x, dense_attention(q, torch.cat([k0] + ks), torch.cat([v0] + vs), torch.cat([ctx, own], 1)))
    return torch.stack(out, 1)


def replay(drafts: torch.Tensor, greedy: list[int], max_tokens: int, k: int) -> dict:
    """The engine's T = 0 loop over precomputed drafts. drafts[j] are the drafts from the anchor
    greedy[j] (output index j); returns the meta_info counters of one request."""
    n, out_len = len(greedy), 1  # the first token comes from the prefill, undrafted
    verify = accepted = drafted = 0
    per_pos = [0] * k
    while out_len < n:
        w = max(0, min(k, max_tokens - out_len - 1))
        if w == 0:
            out_len += 1
            continue
        d = drafts[out_len - 1, :w].tolist()
        a = 0
        while a < w and out_len + a < n and d[a] == greedy[out_len + a]:
            a += 1
        emitted = min(a + 1, n - out_len)
        n_acc = min(a, emitted)
        verify, accepted, drafted = verify + 1, accepted + n_acc, drafted + w
        for i in range(n_acc):
            per_pos[i] += 1
        out_len += emitted
    return {"spec_verify_ct": verify, "spec_accepted_tokens": accepted, "spec_draft_tokens": drafted,
            "spec_accepted_per_pos": per_pos}


def teacher_forced_meta(net: DraftNet, labeler, prompt_ids: list[int], greedy: list[int], max_tokens: int,  # noqa: ANN001
                        k: int | None = None) -> dict:
    """One request's acceptance counters: `labeler` (shards.Labeler) gives the target's features."""
    ids = torch.tensor(prompt_ids + greedy)
    feats, _ = labeler(ids.tolist())
    anchors = torch.arange(len(prompt_ids), len(ids) - 1)
    if len(anchors) == 0:
        return replay(torch.zeros(0, 1, dtype=torch.long), greedy, max_tokens, 1)
    if net.cfg.is_block:
        k = net.cfg.block_size - 1 if k is None else k
        drafts = block_drafts(net, ids, feats, anchors)  # type: ignore[arg-type]
    else:
        k = 4 if k is None else k
        drafts = chain_drafts(net, ids, feats, anchors, k)  # type: ignore[arg-type]
    return replay(drafts, greedy, max_tokens, k)
