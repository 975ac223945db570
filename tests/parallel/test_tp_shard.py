"""Tensor-parallel sharding oracle (no processes): for every layer kind the shards' outputs, summed
(row-parallel) or concatenated (column- and vocab-parallel), equal the full layer in fp64; uneven GQA
and MLP splits; a GGUF's quantized blocks sliced exactly; clear errors for what cannot be split."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.config import EngineConfig
from specserve.speculative.resolve import check_config
from specserve.parallel.comm import TensorParallel
from specserve.parallel.shard import Layout, shard_checkpoint, split
from specserve.models.llama import LlamaModel
from specserve.formats.quant import quantize_blocks
from tests.tiny import tiny_config, tiny_state_dict

# SmolLM2's shape in miniature: 9 query heads over 3 KV heads, an MLP of 3 blocks of 32
GEOMS = [dict(num_heads=9, num_kv_heads=3, head_dim=8, intermediate_size=96),
         dict(num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)]


def _shards(cfg, sd, world: int) -> list[tuple[Layout, LlamaModel]]:  # noqa: ANN001
    out = []
    for r in range(world):
        lay = Layout.make(cfg, r, world)
        ssd, _ = shard_checkpoint(cfg, lay, sd, None)
        m = LlamaModel(lay.config(cfg), torch.float64)
        m.load_weights(ssd)
        out.append((lay, m))
    return out


def _full(cfg, sd) -> LlamaModel:  # noqa: ANN001
    m = LlamaModel(cfg, torch.float64)
    m.load_weights(sd)
    return m


def test_split_and_layout_uneven() -> None:
    assert [split(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [split(96, 2, r, 32) for r in range(2)] == [(0, 64), (64, 96)]
    assert [split(97, 3, r) for r in range(3)] == [(0, 33), (33, 65), (65, 97)]
    cfg = tiny_config(**GEOMS[0])
    lays = [Layout.make(cfg, r, 2) for r in range(2)]
    assert [(x.kv_heads, x.q_heads, x.inter) for x in lays] == [((0, 2), (0, 6), (0, 64)), ((2, 3), (6, 9), (64, 96))]
    assert lays[0].vocab_sizes == (49, 48)
    assert lays[0].config(cfg).num_kv_heads >= lays[1].config(cfg).num_kv_heads  # rank 0 bounds the KV pool


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("geom,world", [(0, 2), (0, 3), (1, 2)])  # more ranks than KV heads: refused (below)
def test_shard_outputs_equal_the_full_layer(arch: str, geom: int, world: int) -> None:
    g = GEOMS[geom]
    cfg = tiny_config(arch, tie_word_embeddings=arch != "qwen2", **g)
    sd = tiny_state_dict(cfg, seed=3)
    full, shards = _full(cfg, sd), _shards(cfg, sd, world)
    gen = torch.Generator().manual_seed(0)
    T, H = 5, cfg.hidden_size
    h = torch.randn(T, H, generator=gen, dtype=torch.float64)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # noqa: E731
    for li in range(cfg.num_layers):
        fl = full.layers[li]
        # column-parallel q/k/v (Qwen2 bias, Qwen3 per-head norms): each rank's heads
        q, k, v = fl._qkv(h)
        for lay, m in shards:
            qs, ks, vs = m.layers[li]._qkv(h)
            close(qs, q[:, slice(*lay.q_heads)])
            close(ks, k[:, slice(*lay.kv_heads)])
            close(vs, v[:, slice(*lay.kv_heads)])
        # row-parallel o_proj: partial sums over each rank's heads add up to the full projection
        o = torch.randn(T, cfg.num_heads * cfg.head_dim, generator=gen, dtype=torch.float64)
        hd = cfg.head_dim
        parts = [F.linear(o[:, lay.q_heads[0] * hd: lay.q_heads[1] * hd], m.layers[li].o_w) for lay, m in shards]
        close(sum(parts), F.linear(o, fl.o_w))
        # MLP: column-parallel gate|up, row-parallel down
        def mlp(layer) -> torch.Tensor:  # noqa: ANN001
            gate, up = F.linear(h, layer.gate_up_w).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, layer.down_w)
        close(sum(mlp(m.layers[li]) for _, m in shards), mlp(fl))
    # vocab-parallel embedding (each rank its ids, zeros elsewhere; the sum is exact) and head
    ids = torch.tensor([0, 5, 48, 49, 50, 96, 33, 65])
    embeds = []
    for lay, m in shards:
        tp = TensorParallel(lay)
        tp.all_reduce = lambda t: t  # the sum over ranks is taken below
        embeds.append(tp.embed(ids, m.embed))
    assert torch.equal(sum(embeds), F.embedding(ids, full.embed))
    close(torch.cat([F.linear(h, m.lm_head) for _, m in shards], dim=1), F.linear(h, full.lm_head))


def test_quantized_blocks_are_sliced_exactly() -> None:
    cfg = tiny_config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128)
    sd = tiny_state_dict(cfg, seed=1)
    names = [n for n in sd if n.endswith("proj.weight") or n.endswith("embed_tokens.weight")]
    blocks = {n: quantize_blocks(sd[n].float(), 4) for n in names}
    for r in range(2):
        lay = Layout.make(cfg, r, 2)
        ssd, sblocks = shard_checkpoint(cfg, lay, sd, blocks)
        for n in names:  # slicing blocks == slicing the dequantized weight, bit for bit
            full_deq = blocks[n].dequantize()
            want = shard_checkpoint(cfg, lay, {n: full_deq}, None)[0][n]
            assert torch.equal(sblocks[n].dequantize(), want), n
            assert sblocks[n].dequantize().shape == ssd[n].shape


def test_unsplittable_models_are_refused() -> None:
    cfg = tiny_config(**GEOMS[1])
    with pytest.raises(ValueError, match="--tp-size 3.*2 KV heads"):
        Layout.make(cfg, 0, 3)
    sd = tiny_state_dict(cfg)
    blocks = {n: quantize_blocks(sd[n].float(), 4) for n in sd if n.endswith("o_proj.weight")}
    with pytest.raises(ValueError, match="inside a quantized block"):  # head_dim 8: heads split mid-block
        shard_checkpoint(cfg, Layout.make(cfg, 0, 2), sd, blocks)
    from tests.hybrid_setup import spec_config

    with pytest.raises(ValueError, match="hybrid"):
        Layout.make(spec_config("LFLF"), 0, 2)


@pytest.mark.parametrize("opts,msg", [
    (dict(tp_size=0), "--tp-size must be >= 1"),
    (dict(tp_size=3, nnodes=2), "--tp-size 3 must be a multiple of --nnodes 2"),
    (dict(tp_size=2, nnodes=2), "--dist-init-addr host:port is required"),
    (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank must be in"),
    (dict(tp_size=2, dist_init_addr="nohost"), "--dist-init-addr must be host:port"),
])
def test_flags(opts: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        check_config(EngineConfig(**opts))


def test_in_memory_model_refused_before_any_process() -> None:
    from specserve.engine.llm import LLM
    from tests.tiny import tiny_model

    with pytest.raises(ValueError, match="--tp-size 2: workers load the target from a file"):
        LLM.from_model(tiny_model(), tp_size=2)
