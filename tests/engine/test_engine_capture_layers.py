"""Target feature capture for drafters: a forward with capture_layers returns the residual stream after
the chosen layers for every packed token; the last captured layer is the input of the final norm.
"""
from __future__ import annotations

import torch

from tests.tiny import tiny_model


def test_capture_layers_returns_hidden_states_of_chosen_layers() -> None:
    """Drafters read target features: the residual stream after chosen layers, for every packed token."""
    import torch.nn.functional as F

    from specserve.cache.kv_pool import KVPool
    from specserve.models.forward_batch import build_forward_batch

    m = tiny_model("llama", layers=3)
    kv = KVPool(m.cfg, 4, 16, m.dtype)
    pt: list[int] = []
    kv.ensure(pt, 6)
    slots = kv.slots(pt, 0, 6)
    fb = build_forward_batch([[1, 2, 3, 4, 5, 6]], [0], [slots], [slots], None)
    final, captured = m(fb, kv.k, kv.v, capture_layers=(0, 2))
    assert len(captured) == 2 and all(c.shape == (6, m.cfg.hidden_size) for c in captured)
    # the last captured layer is the input of the final norm
    assert torch.allclose(F.rms_norm(captured[1], (m.cfg.hidden_size,), m.norm, m.cfg.rms_norm_eps), final)
    assert not torch.allclose(captured[0], captured[1])
