"""Tensors describing one packed forward over many requests (prefill chunks or verify windows).

Tokens of all requests are packed along one axis (T tokens) through the linear layers, and stay
packed through attention: request b owns query rows q_start[b]:q_start[b+1] and context entries
ctx_start[b]:ctx_start[b+1] of `ctx_slots` (its page table expanded to KV pool slots), so no request
is padded to the longest window or the longest context. The padded [B, q_max] × [B, L] rectangle
of the pure-torch reference attention is derived on demand (`padded`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class Padded:
    """The reference attention's rectangle: queries scattered to [B, q_max], contexts to [B, L]."""
    q_index: torch.Tensor  # [B, q_max] int64, packed index of the token at (request, offset); pad → 0
    q_valid: torch.Tensor  # [B, q_max] bool
    ctx_slots: torch.Tensor  # [B, L] int64; pad repeats the request's own newest slot
    attn_mask: torch.Tensor | None  # [B, 1, q_max, L] bool, True = may attend; None = attend to all
    uniform_q: int | None  # every request has this many new tokens: packed == [B, q] view
    ctx_start: int | None  # one request whose context is slots [ctx_start, ctx_start + L): slice, no gather
    q_pos: torch.Tensor  # [B, q_max] int64, each query's position (a layer's own sliding window compares these)
    kv_pos: torch.Tensor  # [B, L] int64, each context entry's position


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, packed tokens of all requests
    positions: torch.Tensor  # [T] int64, RoPE position of each token (causal masks compare these)
    slot_mapping: torch.Tensor  # [T] int64, KV pool slot each token's K/V is written to
    q_start: torch.Tensor  # [B + 1] int64, request b's rows are q_start[b]:q_start[b + 1]
    ctx_slots: torch.Tensor  # [ΣL_b] int64, KV slot of each context entry, requests back to back
    ctx_start: torch.Tensor  # [B + 1] int64, request b's context is ctx_slots[ctx_start[b]:ctx_start[b + 1]]
    ctx_first: torch.Tensor  # [B] int64, absolute position of request b's first context entry
    causal: bool  # False: every query sees its whole context (block drafters)
    window: int | None  # a query at position p sees only context positions > p − window
    mask: torch.Tensor | None  # trees: packed [n_b, L_b] bool masks (True = may attend), replace causal
    mask_start: torch.Tensor | None  # [B] int64, offset of request b's mask in `mask`
    logits_index: torch.Tensor | None  # [N] packed indices that need logits; None = all tokens
    states: "StateBatch | None" = None  # hybrid targets: recurrent state in and out (None: start from zeros)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def padded(self) -> Padded:
        """The padded layout (reference attention only; the fused op never builds it)."""
        q_lens, ctx_lens = self.q_start.diff(), self.ctx_start.diff()
        B, q_max, L = len(q_lens), int(q_lens.max()), int(ctx_lens.max())
        offs = torch.arange(q_max)
        q_valid = offs[None, :] < q_lens[:, None]
        q_index = torch.where(q_valid, self.q_start[:-1, None] + offs[None, :], torch.zeros((), dtype=torch.long))
        # NOTE: padding repeats the request's own newest slot (written by this very forward): a masked
        # entry still enters SDPA as 0·V, so padding with another request's slot would let one bad
        # (NaN) request, or a slot beyond a draft window, leak into its neighbours.
        j = torch.minimum(torch.arange(L)[None, :], ctx_lens[:, None] - 1)
        ctx = self.ctx_slots[self.ctx_start[:-1, None] + j]
        kv_pos = self.ctx_first[:, None] + torch.arange(L)[None, :]
        q_pos = torch.zeros(B, q_max, dtype=torch.long)
        q_pos[q_valid] = self.positions
        in_ctx = torch.arange(L)[None, :] < ctx_lens[:, None]
        if self.mask is not None:
            mask = torch.zeros(B, q_max, L, dtype=torch.bool)
            for b in range(B):
                n, c, s = int(q_lens[b]), int(ctx_lens[b]), int(self.mask_start[b])
                mask[b, :n, :c] = self.mask[s: s + n * c].view(n, c)
        elif self.causal:
            mask = kv_pos[:, None, :] <= q_pos[:, :, None]
        else:
            mask = in_ctx[:, None, :].expand(B, q_max, L).clone()
        if self.window is not None:
            mask &= kv_pos[:, None, :] > q_pos[:, :, None] - self.window
        mask &= q_valid[:, :, None] & in_ctx[:, None, :]
        mask[:, :, 0] |= ~q_valid  # padded rows attend to slot 0 only: finite, discarded
        uniform = q_max if int(q_lens.min()) == q_max else None
        # decode with equal contexts: every query sees every slot, so SDPA needs no mask at all
        no_mask = ((uniform == 1 or not self.causal) and int(ctx_lens.min()) == L and self.mask is None
                   and self.window is None)
        start = int(ctx[0, 0]) if B == 1 and torch.equal(ctx[0], torch.arange(int(ctx[0, 0]), int(ctx[0, 0]) + L)) else None
        return Padded(q_index, q_valid, ctx, None if no_mask else mask[:, None], uniform, start, q_pos, kv_pos)


def _offsets(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.long)


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
    share a depth). masks[b] (trees): an explicit [len(tokens[b]), ≤ len(ctx[b])] bool mask that
    replaces the causal one (missing columns: not visible). window: a query at position p sees only
    context positions > p − window.
    NOTE: every query row attends at least to itself, so no softmax row is empty (no NaN).
    """
    B = len(token_lists)
    q_lens = [len(t) for t in token_lists]
    ctx_lens = [len(c) for c in ctx_slot_lists]
    if positions is None:
        positions = [list(range(s, s + n)) for s, n in zip(start_positions, q_lens)]
    packed_mask = mask_start = None
    if masks is not None:
        full = []
        for m, n, c in zip(masks, q_lens, ctx_lens):
            mb = torch.zeros(n, c, dtype=torch.bool)
            mb[: m.shape[0], : m.shape[1]] = m
            full.append(mb.reshape(-1))
        packed_mask, mask_start = torch.cat(full), _offsets([n * c for n, c in zip(q_lens, ctx_lens)])[:-1]
    return ForwardBatch(
        input_ids=torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long),
        positions=torch.tensor([p for ps in positions for p in ps], dtype=torch.long),
        slot_mapping=torch.tensor([s for ss in slot_lists for s in ss], dtype=torch.long),
        q_start=_offsets(q_lens),
        ctx_slots=torch.tensor([s for cs in ctx_slot_lists for s in cs], dtype=torch.long),
        ctx_start=_offsets(ctx_lens),
        ctx_first=torch.tensor(ctx_first if ctx_first is not None else [0] * B, dtype=torch.long),
        causal=causal,
        window=window,
        mask=packed_mask,
        mask_start=mask_start,
        logits_index=None if logits_index is None else torch.tensor(logits_index, dtype=torch.long),
    )


@dataclass
class StateBatch:
    """Recurrent-layer state of one forward (hybrid targets): where each request's state starts and
    which verify row's state the caller may keep.

    Inputs: `conv`/`rec` are the persistent pool tensors per recurrent layer (read, never written
    here); `slots[b]` is request b's slot (−1: start from zeros); `parents` (packed [T], local row
    index, −1 = the request's committed state) makes tree rows follow their own root path; None =
    chain. `keep_rows`: keep the state after every row (verify: the commit picks the accepted row);
    False: only after each request's last row (prefill chunks, which are committed whole).
    Outputs, per recurrent layer, filled by the model: `conv_out`/`rec_out` [T or B, ...].
    NOTE: a forward never writes a pool slot; the commit stage copies the chosen row into it."""
    conv: list[torch.Tensor]  # per recurrent layer [slots, K - 1, C]
    rec: list[torch.Tensor]  # per recurrent layer [slots, Hv, dk, dv]
    slots: list[int]
    parents: torch.Tensor | None = None
    keep_rows: bool = False
    conv_out: list[torch.Tensor] = field(default_factory=list)
    rec_out: list[torch.Tensor] = field(default_factory=list)

    def split(self, lengths: list[int]) -> list["RowStates"]:
        """Per request: its rows' states (keep_rows) or its last row's, every recurrent layer."""
        per = lengths if self.keep_rows else [1] * len(lengths)
        conv = [c.split(per) for c in self.conv_out]
        rec = [r.split(per) for r in self.rec_out]
        return [RowStates([c[b] for c in conv], [r[b] for r in rec]) for b in range(len(lengths))]


@dataclass
class RowStates:
    """One request's recurrent state after each kept row, per recurrent layer ([n, ...] each)."""
    conv: list[torch.Tensor]
    rec: list[torch.Tensor]
