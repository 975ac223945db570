"""Tensors describing one packed forward over many requests (prefill chunks or verify windows).

Tokens of all requests are packed along one axis (T tokens) through the linear layers. Attention
scatters them into a [B, q_max] rectangle, writes their K/V into the paged pool at `slot_mapping`
and reads each request's context back through `ctx_slots` (its page table, expanded to slots).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, packed tokens of all requests
    positions: torch.Tensor  # [T] int64, absolute position of each token in its request
    slot_mapping: torch.Tensor  # [T] int64, KV pool slot each token's K/V is written to
    q_index: torch.Tensor  # [B, q_max] int64, packed index of the token at (request, offset); pad → 0
    q_valid: torch.Tensor  # [B, q_max] bool
    ctx_slots: torch.Tensor  # [B, L] int64, KV slot of context position l of request b; pad → 0
    attn_mask: torch.Tensor | None  # [B, 1, q_max, L] bool, True = may attend; None = attend to all
    logits_index: torch.Tensor | None  # [N] packed indices that need logits; None = all tokens
    uniform_q: int | None = None  # every request has this many new tokens: packed == [B, q] view
    ctx_start: int | None = None  # one request whose context is slots [ctx_start, ctx_start + L): slice, no gather

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_forward_batch(
    token_lists: list[list[int]],
    start_positions: list[int],
    slot_lists: list[list[int]],
    ctx_slot_lists: list[list[int]],
    logits_index: list[int] | None,
    causal: bool = True,
    positions: list[list[int]] | None = None,
    masks: list[torch.Tensor] | None = None,
    ctx_first: list[int] | None = None,
    window: int | None = None,
) -> ForwardBatch:
    """Build a ForwardBatch.

    token_lists[b]: new tokens of request b, at positions start_positions[b] + i.
    slot_lists[b]: KV slots for those tokens. ctx_slot_lists[b]: slots of positions
    ctx_first[b] .. start+len-1 (default from 0: the whole context including the new tokens,
    which are written first).
    causal=False: every new token sees the whole context and all new tokens of its request
    (block drafters' bidirectional block).
    positions[b] (trees): RoPE positions of the new tokens when they are not start + i (siblings
    share a depth). masks[b] (trees): an explicit [len(tokens[b]), len(ctx[b])] bool mask that
    replaces the causal one. window: a query at position p sees only context positions > p − window.
    NOTE: every query row attends at least to itself, so no softmax row is empty (no NaN).
    """
    B = len(token_lists)
    q_lens = [len(t) for t in token_lists]
    q_max = max(q_lens)
    L = max(len(c) for c in ctx_slot_lists)
    ids = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
    if positions is None:
        positions = [list(range(s, s + len(ts))) for s, ts in zip(start_positions, token_lists)]
    pos = torch.tensor([p for ps in positions for p in ps], dtype=torch.long)
    slots = torch.tensor([s for ss in slot_lists for s in ss], dtype=torch.long)
    offs = torch.arange(q_max)
    qlen_t = torch.tensor(q_lens)
    starts_packed = torch.cumsum(qlen_t, 0) - qlen_t
    q_valid = offs[None, :] < qlen_t[:, None]
    q_index = torch.where(q_valid, starts_packed[:, None] + offs[None, :], torch.zeros((), dtype=torch.long))
    ctx = torch.zeros(B, L, dtype=torch.long)
    for b, c in enumerate(ctx_slot_lists):
        ctx[b] = torch.tensor(c, dtype=torch.long)[torch.arange(L).clamp(max=len(c) - 1)]
    # NOTE: padding repeats the request's own newest slot (written by this very forward): a masked
    # entry still enters SDPA as 0·V, so padding with another request's slot would let one bad
    # (NaN) request, or a slot beyond a draft window, leak into its neighbours.
    first = torch.tensor(ctx_first if ctx_first is not None else [0] * B)
    kv_pos = first[:, None] + torch.arange(L)[None, :]  # [B, L] absolute position of each context entry
    q_pos = torch.zeros(B, q_max, dtype=torch.long)  # [B, q_max]
    q_pos[q_valid] = pos
    ctx_lens = torch.tensor([len(c) for c in ctx_slot_lists])
    in_ctx = torch.arange(L)[None, :] < ctx_lens[:, None]  # [B, L]
    if masks is not None:
        mask = torch.zeros(B, q_max, L, dtype=torch.bool)
        for b, m in enumerate(masks):
            mask[b, : m.shape[0], : m.shape[1]] = m
    elif causal:
        mask = kv_pos[:, None, :] <= q_pos[:, :, None]  # causal over absolute positions
    else:
        mask = in_ctx[:, None, :].expand(B, q_max, L).clone()
    if window is not None:
        mask &= kv_pos[:, None, :] > q_pos[:, :, None] - window
    mask &= q_valid[:, :, None] & in_ctx[:, None, :]
    mask[:, :, 0] |= ~q_valid  # padded rows attend to slot 0 only: finite, discarded
    uniform = q_max if min(q_lens) == q_max else None
    # decode with equal contexts: every query sees every slot, so SDPA needs no mask at all
    no_mask = (uniform == 1 or not causal) and int(ctx_lens.min()) == L and masks is None and window is None
    return ForwardBatch(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        q_index=q_index,
        q_valid=q_valid,
        ctx_slots=ctx,
        attn_mask=None if no_mask else mask[:, None],
        logits_index=None if logits_index is None else torch.tensor(logits_index, dtype=torch.long),
        uniform_q=uniform,
        ctx_start=int(ctx[0, 0]) if B == 1 and torch.equal(ctx[0], torch.arange(int(ctx[0, 0]), int(ctx[0, 0]) + L)) else None,
    )
