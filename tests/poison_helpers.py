"""Forward-level fault injection for the NaN/Inf isolation tests (tests/engine/test_forward_poison.py): poison
one request's hidden state inside a target forward (a forward hook on a target layer, which runs the
reference layer loop; or its embedding rows, which keeps the fused loop on) or its cached K/V rows in
the pool, then drive an engine through a join plan and check that only that request fails.

Public surfaces only: `engine.model.layers[i]` as nn.Modules, `model.forward` / `model.embed_tokens`,
`engine.kv.k/v`, `kv.page_size`, a request's `page_table` / `committed_len`. NOTE: `victim_rows` is the
one place that reads the layout of a packed forward (the batch object a layer is called with); fix it
there if that layout changes.
"""
from __future__ import annotations

import torch

from specserve.core import Request, SamplingParams


def victim_rows(args: tuple, kwargs: dict, page_table: list[int], page_size: int) -> torch.Tensor:
    """Packed rows of this forward that belong to the request owning `page_table`: the rows whose K/V
    land in its pages (pages are owned by one request at a time, so this is exact)."""
    fb = next(a for a in (*args, *kwargs.values()) if hasattr(a, "slot_mapping"))
    pages = torch.tensor([p for p in page_table if p >= 0], dtype=torch.long)
    return torch.isin(fb.slot_mapping // page_size, pages).nonzero().squeeze(1)


class HiddenPoison:
    """While armed, a target layer's output rows of one request become `value` (NaN or ±Inf)."""

    def __init__(self, engine, layer: int, value: float) -> None:  # noqa: ANN001
        self.engine, self.value = engine, value
        self.victim: Request | None = None
        self.armed = False
        self.hits: list[int] = []  # rows poisoned, per forward
        engine.model.layers[layer].register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, out):  # noqa: ANN001, ANN202
        if not self.armed or self.victim is None or not self.victim.page_table:
            return out
        rows = victim_rows(args, kwargs, self.victim.page_table, self.engine.kv.page_size)
        if len(rows):
            out = out.clone()
            out[rows] = self.value
            self.hits.append(len(rows))
        return out

    def __call__(self, engine, victim: Request) -> None:  # noqa: ANN001
        self.victim, self.armed = victim, True


class EmbedPoison:
    """While armed, one request's embedding rows (the residual stream entering layer 0) become `value`.
    Wraps the model's forward and embed_tokens as instance attributes, not hooks: LlamaModel.forward
    keeps the fused layer loop (Python, or the C++ decoder_layers op), which a forward hook switches off."""

    def __init__(self, engine, value: float) -> None:  # noqa: ANN001
        self.engine, self.value = engine, value
        self.victim: Request | None = None
        self.armed = False
        self.hits: list[int] = []
        model = engine.model
        forward, embed = model.forward, model.embed_tokens
        current: list = []  # the ForwardBatch of the forward in progress

        def fwd(fb, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            current.append(fb)
            try:
                return forward(fb, *args, **kwargs)
            finally:
                current.pop()

        def emb(ids: torch.Tensor) -> torch.Tensor:
            x = embed(ids)
            if self.armed and self.victim is not None and self.victim.page_table and current:
                rows = victim_rows((current[-1],), {}, self.victim.page_table, engine.kv.page_size)
                if len(rows):
                    x[rows] = self.value
                    self.hits.append(len(rows))
            return x

        model.forward, model.embed_tokens = fwd, emb

    def __call__(self, engine, victim: Request) -> None:  # noqa: ANN001
        self.victim, self.armed = victim, True


def poison_kv(value: float):  # noqa: ANN201
    """A poison step: every layer's K and V at the victim's committed positions become `value`."""
    def poison(engine, victim: Request) -> None:  # noqa: ANN001
        assert victim.committed_len > 0
        ps = engine.kv.page_size
        slots = torch.tensor([victim.page_table[p // ps] * ps + p % ps for p in range(victim.committed_len)])
        for cache in engine.kv.k + engine.kv.v:
            cache[slots] = value
    return poison


def drive_poisoned(llm, plan: list[tuple[int, list[int], SamplingParams]], victim: int, poison_step: int,  # noqa: ANN001
                   poison=None, max_steps: int = 2000) -> tuple[list[Request], list[list[int]]]:  # noqa: ANN001
    """Run `plan` ((join step, prompt, params) per request); before step `poison_step` call
    poison(engine, victim request) (a HiddenPoison / EmbedPoison disarms after the first step that hit
    the victim). Returns the requests and, per request, the pages it held at any time (to prove a late
    joiner reused the victim's pages)."""
    eng = llm.engine
    reqs: list = [None] * len(plan)
    pages: list[set[int]] = [set() for _ in plan]
    step = 0
    while step == 0 or eng.has_unfinished() or any(r is None for r in reqs):
        for i, (join, prompt, sp) in enumerate(plan):
            if join == step:
                reqs[i] = eng.add_request(prompt, sp, request_id=f"r{i}")
        if poison is not None and step == poison_step:
            assert not reqs[victim].finished, "the victim finished before it could be poisoned"
            poison(eng, reqs[victim])
        eng.step()
        if isinstance(poison, (HiddenPoison, EmbedPoison)) and poison.hits:
            poison.armed = False  # one poisoned step (armed until the victim is in a forward at all)
        for i, r in enumerate(reqs):
            if r is not None:
                pages[i] |= set(r.page_table)
        step += 1
        assert step < max_steps, "engine made no progress"
    return reqs, [sorted(p) for p in pages]
