"""Recurrent-state pool beside the paged KV pool (hybrid targets): one slot per running request
holding, per recurrent layer, its conv window [K-1, C] and its delta-rule state [Hv, dk, dv].

A slot is zeroed when it is handed out, so a request never sees a previous owner's state (nor its
NaNs). The pool is sized up front from the memory budget (one slot per request that may run) and
written only by `write`, which the commit stage calls with the row it accepted.
"""
from __future__ import annotations

import torch

from ..models.config import ModelConfig
from ..models.forward_batch import RowStates, StateBatch


class OutOfStateSlots(RuntimeError):
    pass


class StatePool:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype) -> None:
        n, k1 = len(cfg.recurrent_layers), cfg.linear_conv_kernel - 1
        self.num_slots, self.dtype = num_slots, dtype
        self.conv = [torch.zeros(num_slots, k1, cfg.conv_dim, dtype=dtype) for _ in range(n)]
        self.rec = [torch.zeros(num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                cfg.linear_value_head_dim, dtype=dtype) for _ in range(n)]
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        return len(cfg.recurrent_layers) * cfg.state_elems_per_layer * torch.finfo(dtype).bits // 8

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """A zeroed slot. Raises OutOfStateSlots when every slot is taken."""
        if not self._free:
            raise OutOfStateSlots(f"all {self.num_slots} recurrent-state slots are in use")
        slot = self._free.pop()
        for t in self.conv + self.rec:
            t[slot].zero_()
        return slot

    def free(self, slot: int | None) -> None:
        if slot is not None and slot >= 0:
            assert slot not in self._free, f"state slot {slot} freed twice"
            self._free.append(slot)

    def batch(self, slots: list[int], keep_rows: bool = False, parents: list[list[int]] | None = None) -> StateBatch:
        """The StateBatch of one forward reading `slots`. parents (trees): per request the parent of each
        draft (speculative/tree.py: −1 = the root, row 0), so row i + 1 follows row parents[i] + 1."""
        packed = None
        if parents is not None:
            packed = torch.tensor([x for p in parents for x in [-1] + [q + 1 for q in p]], dtype=torch.long)
        return StateBatch(self.conv, self.rec, list(slots), packed, keep_rows)

    @torch.no_grad()
    def write(self, slot: int, states: RowStates, row: int) -> None:
        """Make `slot` hold the state after kept row `row` of a forward (the accepted prefix's last row)."""
        for pool, rows in zip(self.conv, states.conv):
            pool[slot].copy_(rows[row])
        for pool, rows in zip(self.rec, states.rec):
            pool[slot].copy_(rows[row])

    def read(self, slot: int) -> RowStates:
        """A copy of a slot ([1, ...] per layer): tests' commit oracle, drafter snapshots."""
        return RowStates([c[slot : slot + 1].clone() for c in self.conv], [r[slot : slot + 1].clone() for r in self.rec])
