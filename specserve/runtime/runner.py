"""Model runner: turns (page table, start position, new tokens) per request into one packed forward.

Used for the target and for model drafters alike; each owns its model and its own KV pool.
"""
from __future__ import annotations

import torch

from ..cache.kv_pool import KVPool
from ..cache.state_pool import StatePool
from ..models.forward_batch import StateBatch, build_forward_batch
from ..models.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVPool, states: StatePool | None = None) -> None:
        self.model, self.kv = model, kv
        self.window = model.cfg.kv_window  # every layer slides: a request's context is its last window
        self.states = states  # hybrid models: the recurrent-state slots beside the KV pool

    @torch.no_grad()
    def forward(
        self,
        page_tables: list[list[int]],
        starts: list[int],
        tokens: list[list[int]],
        logits_offsets: list[list[int]],
        capture_layers: tuple[int, ...] = (),
        positions: list[list[int]] | None = None,
        masks: list[torch.Tensor] | None = None,
        states: StateBatch | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Write KV for tokens[b] at positions starts[b].. and return, per request, the logits
        [len(logits_offsets[b]), V] at those offsets into tokens[b] (logits are computed only there).
        Trees: `positions` (RoPE) and `masks` ([n_b, starts[b] + n_b]) replace the causal defaults;
        the K/V still land in slots starts[b]...
        `states` (hybrid models): where each request's recurrent state starts; the new states land in it
        (read them with states.split); without it every request starts from zero state.
        A model whose every layer slides (kv_window) reads only each request's last window: the pages behind
        it may be gone (KVPool.free_below).
        NOTE: the caller has ensured page_tables cover starts[b] + len(tokens[b]) positions."""
        slot_lists, ctx_lists, firsts, logits_index = [], [], [], []
        window = self.window
        base = 0
        for pt, s, toks, offs in zip(page_tables, starts, tokens, logits_offsets):
            first = max(0, s - window + 1) if window else 0  # the first position the first query sees
            ctx = self.kv.slots(pt, first, s + len(toks))
            ctx_lists.append(ctx)
            slot_lists.append(ctx[s - first:])
            firsts.append(first)
            logits_index.extend(base + o for o in offs)
            base += len(toks)
        if masks is not None and any(firsts):  # a tree's mask columns start at position 0
            masks = [m[:, f:] for m, f in zip(masks, firsts)]
        fb = build_forward_batch(tokens, starts, slot_lists, ctx_lists, logits_index, positions=positions, masks=masks,
                                 ctx_first=firsts)
        fb.states = states
        hidden, captured = self.model(fb, self.kv.k, self.kv.v, capture_layers)
        logits = self.model.compute_logits(hidden) if len(logits_index) else hidden.new_zeros(0, 0)
        return list(logits.split([len(o) for o in logits_offsets])), captured


    @torch.no_grad()
    def hidden_states(self, page_table: list[int], tokens: list[int]) -> torch.Tensor:
        """The final-normed hidden state [len(tokens), H] of every position of one sequence written from position
        0 (embeddings; its KV lands in page_table)."""
        ctx = self.kv.slots(page_table, 0, len(tokens))
        fb = build_forward_batch([tokens], [0], [ctx], [ctx], None, ctx_first=[0])
        hidden, _ = self.model(fb, self.kv.k, self.kv.v)
        return hidden


def split_features(captured: list[torch.Tensor], aux: tuple[int, ...], lengths: list[int]) -> list[torch.Tensor]:
    """Captured hidden states (one packed [T, H] per layer, in layer order) → per request
    [n_b, len(aux), H] in `aux` order (the drafter's feature layout)."""
    order = sorted(aux)
    stacked = torch.stack([captured[order.index(a)] for a in aux], dim=1)
    return list(stacked.split(lengths))
