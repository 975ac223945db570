"""RoPE frequencies (default and llama3 scaling) against HF transformers' own computation."""
from __future__ import annotations

import pytest
import torch

from specserve.models.attention import rope_inv_freq

from tests.tiny import tiny_config


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_inv_freq_matches_hf(scaling: dict | None) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_config("llama", head_dim=64, num_heads=2, hidden_size=128, rope_theta=500000.0, rope_scaling=scaling,
                      max_position_embeddings=131072)
    hf = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64, rope_theta=500000.0,
                                  rope_scaling=scaling, max_position_embeddings=131072)
    ours = rope_inv_freq(cfg).float()
    if scaling is None:
        theirs = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert torch.allclose(ours, theirs.float(), rtol=1e-5, atol=0)
    if scaling is not None:
        assert not torch.allclose(ours, rope_inv_freq(tiny_config("llama", head_dim=64, rope_theta=500000.0)).float())


def test_unknown_rope_scaling_refused() -> None:
    with pytest.raises(ValueError, match="rope_scaling"):
        rope_inv_freq(tiny_config("llama", rope_scaling={"rope_type": "weird"}))



class _Field:
    def __init__(self, v: object) -> None:
        self.v = v

    def contents(self) -> object:
        return self.v


class _Reader:  # the part of gguf.GGUFReader that the config read uses
    def __init__(self, fields: dict[str, object]) -> None:
        self.fields = {k: _Field(v) for k, v in fields.items()}


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_gguf_rope_scaling_is_read_only_where_the_model_computes_it(kind: str) -> None:
    """A GGUF's rope scaling type is refused when its config is read, by name, unless rope_inv_freq computes
    it: a rope_scaling the loader returns always builds."""
    from specserve.loading.gguf import _rope_scaling

    reader = _Reader({"qwen2.rope.scaling.type": kind, "qwen2.rope.scaling.factor": 4.0})
    if kind == "yarn":
        with pytest.raises(ValueError, match="unsupported GGUF rope scaling type 'yarn'"):
            _rope_scaling(reader, "qwen2", None, 8, 10000.0)
        return
    rs = _rope_scaling(reader, "qwen2", None, 8, 10000.0)
    assert rs == {"rope_type": "linear", "factor": 4.0}
    assert torch.equal(rope_inv_freq(tiny_config("llama", rope_scaling=rs)), rope_inv_freq(tiny_config("llama")) / 4.0)


def test_rope_tables_grow_to_the_positions_a_forward_reaches() -> None:
    """The tables start at ROPE_POSITIONS and double as positions reach past them: the logits equal a model's
    whose tables were built whole."""
    from specserve.models.llama import ROPE_POSITIONS, LlamaModel
    from tests.tiny import ref_logits, tiny_config, tiny_state_dict

    cfg = tiny_config("llama", max_position_embeddings=3 * ROPE_POSITIONS)
    lazy, whole = LlamaModel(cfg, torch.float64), LlamaModel(cfg, torch.float64)
    for m in (lazy, whole):
        m.load_weights(tiny_state_dict(cfg))
    whole._grow_rope(cfg.max_position_embeddings)
    assert lazy.cos_table.shape[0] == ROPE_POSITIONS
    ids = [(5 * i) % cfg.vocab_size for i in range(ROPE_POSITIONS + 100)]
    torch.testing.assert_close(ref_logits(lazy, ids)[-50:], ref_logits(whole, ids)[-50:], rtol=0, atol=0)
    assert lazy.cos_table.shape[0] == 2 * ROPE_POSITIONS
