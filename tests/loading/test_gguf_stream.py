"""The streaming GGUF load (loading/gguf_stream.py) builds exactly the model the dense load + quantize_model
builds, keeps the embedding in the file's blocks, and refuses bad files and too little memory up front."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve.loading.pipeline import build_model
from specserve import memory
from specserve.models.embedding import GGUFEmbedding
from specserve.loading.checkpoint import load_checkpoint
from specserve.formats.quant import quantize_model
from specserve.models.registry import model_class

from .test_loader import _tiny_tensors, _write_gguf


def _dense_then_quantized(path: Path, mode: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    blocks: dict = {}
    cfg, sd, _ = load_checkpoint(str(path), dtype, blocks)
    model = model_class(cfg.architecture)(cfg, dtype)
    model.load_weights(sd)
    quantize_model(model, mode, blocks)
    return model


def _same_packed(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
        return
    for f in ("wp", "wd", "wm", "packed", "scale_zero"):
        x, y = getattr(a, f, None), getattr(b, f, None)
        assert (x is None and y is None) or torch.equal(x, y), f


def _assert_same_model(streamed: torch.nn.Module, dense: torch.nn.Module) -> None:
    assert streamed.cfg == dense.cfg
    assert torch.equal(streamed.norm, dense.norm)
    for ls, ld in zip(streamed.layers, dense.layers):
        for a in ("qkv_w", "o_w", "gate_up_w", "down_w"):
            _same_packed(getattr(ls, a), getattr(ld, a))
        for a in ("input_norm", "post_norm", "qkv_b"):
            x, y = getattr(ls, a), getattr(ld, a)
            assert (x is None and y is None) or torch.equal(x, y), a
    _same_packed(streamed.lm_head, dense.lm_head)
    ids = torch.tensor([[0, 5, 259], [3, 3, 1]])
    assert torch.equal(streamed.embed_tokens(ids), dense.embed_tokens(ids))
    assert torch.equal(streamed.embedding_table(), dense.embed)
    # the table stays in the file's blocks unless a tied head had to stay a float matrix
    assert isinstance(streamed.embed, GGUFEmbedding) == (streamed.lm_head is not streamed.embed)


@pytest.mark.parametrize("arch,qtype,mode", [("llama", "Q8_0", "w4a8"), ("llama", "Q4_1", "w4a8"),
                                             ("qwen2", "Q4_0", "w4a8"), ("qwen2", "Q5_0", "w4a8"),
                                             ("qwen2", "Q8_0", "w8a8"), ("llama", "Q4_0", "int4")])
def test_streamed_equals_dense_then_quantized(tmp_path: Path, arch: str, qtype: str, mode: str) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, arch, _tiny_tensors(260, bias=arch == "qwen2"), qtype=qtype)
    dtype = torch.bfloat16 if mode == "int4" else torch.float32
    streamed, _ = build_model(str(path), dtype, mode)
    _assert_same_model(streamed, _dense_then_quantized(path, mode, dtype))


def test_smollm2_streamed_equals_dense(caplog: pytest.LogCaptureFixture) -> None:
    from specserve.loading.checkpoint import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    with caplog.at_level(logging.INFO, logger="specserve.loading.gguf_stream"):
        streamed, _ = build_model(str(path), torch.float32, "w4a8")
    assert "peak RSS" in caplog.text
    _assert_same_model(streamed, _dense_then_quantized(path, "w4a8"))
    # the tied head is the file's embedding blocks; the table itself is never held dense
    assert isinstance(streamed.embed, GGUFEmbedding) and streamed.cfg.tie_word_embeddings


def test_truncated_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", _tiny_tensors(260, bias=False), qtype="Q8_0")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated"):
        build_model(str(cut), torch.float32, "w4a8")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(50))
    with pytest.raises(ValueError, match="junk.gguf: not a readable GGUF file"):
        build_model(str(junk), torch.float32, "w4a8")


def test_unknown_block_type_names_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "mx.gguf"
    _write_gguf(path, "llama", _tiny_tensors(260, bias=False), qtype="MXFP4")
    with pytest.raises(ValueError, match=r"tensor 'token_embd\.weight' has GGUF block type MXFP4, which specserve cannot read"):
        build_model(str(path), torch.float32, "w4a8")


def test_memory_check_names_both_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", _tiny_tensors(260, bias=False), qtype="Q8_0")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 2**20)
    with pytest.raises(MemoryError, match=r"needs about 1\.00 GiB but only 0\.00 GiB of memory is available"):
        build_model(str(path), torch.float32, "w4a8", {"KV cache": 2**30})
    with pytest.raises(MemoryError, match=r"m\.gguf \(float32\) with 1\.00 GiB of KV cache needs about 1\.00 GiB"):
        build_model(str(path), torch.float32, None, {"KV cache": 2**30})  # the dense path is checked too


@pytest.mark.parametrize("qtype,mode", [("Q5_0", "w4a8"), ("Q5_1", "w4a8"), ("Q4_0", "w4a8"), ("Q8_0", "w8a8"),
                                        ("F16", None)])
def test_native_blocks_are_served_in_the_integer_kernels_by_default(tmp_path: Path, qtype: str, mode: str | None) -> None:
    """With --dtype auto, a GGUF whose projections are in a block type the kernels keep exactly is served quantized
    (no fp32 copy of the model); float files stay float."""
    from specserve.loading.checkpoint import open_checkpoint
    from specserve.loading.pipeline import default_quantization

    path = tmp_path / "m.gguf"
    tensors = _tiny_tensors(260, bias=False)
    if qtype == "F16":
        tensors = {k: v.astype(np.float16) for k, v in tensors.items()}
    _write_gguf(path, "llama", tensors, qtype=None if qtype == "F16" else qtype)
    assert default_quantization(open_checkpoint(str(path)), "auto", None) == mode


def test_gguf_embedding_rejects_bad_ids(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", _tiny_tensors(260, bias=False), qtype="Q8_0")
    model, _ = build_model(str(path), torch.float32, "w4a8")
    with pytest.raises(IndexError, match="out of range"):
        model.embed_tokens(torch.tensor([260]))
    assert np.isfinite(model.embed_tokens(torch.tensor([259])).numpy()).all()


@pytest.mark.parametrize("qtype", [None, "Q8_0", "Q4_1", "BF16"])
def test_gguf_file_reads_what_gguf_reader_reads(tmp_path: Path, qtype: str | None) -> None:
    from gguf import GGUFReader

    from specserve.formats.gguf_file import GGUFFile
    from specserve.loading.checkpoint import resolve_model_path

    paths = [resolve_model_path("smollm2-135m")] if qtype is None else [tmp_path / "m.gguf"]
    if qtype is not None:
        _write_gguf(paths[0], "qwen2", _tiny_tensors(260, bias=True), qtype=qtype)
    for path in paths:
        ours, ref = GGUFFile(path), GGUFReader(str(path))
        for key, field in ref.fields.items():
            if not key.startswith("GGUF."):  # the reader's own header pseudo-fields
                assert ours.fields[key].contents() == field.contents(), key
        assert len(ours.tensors) == len(ref.tensors)
        for a, b in zip(ours.tensors, ref.tensors):
            assert (a.name, a.tensor_type, a.n_bytes, a.data_offset) == (b.name, b.tensor_type, b.n_bytes, b.data_offset)
            assert np.array_equal(a.shape, b.shape) and a.data.dtype == b.data.dtype
            assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_streamed_reduced_head_is_the_picked_rows(tmp_path: Path, qtype: str) -> None:
    """A draft model's reduced head, packed from the file's bytes, holds exactly the picked rows' blocks."""
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", _tiny_tensors(260, bias=False), qtype=qtype)
    ids = torch.arange(0, 260, 3)
    model, _ = build_model(str(path), torch.float32, "w4a8", head_rows=ids)
    full, _ = build_model(str(path), torch.float32, "w4a8")
    h = torch.randn(2, model.cfg.hidden_size)
    got, want = model.compute_logits(h), full.compute_logits(h)
    assert torch.equal(model.head_ids, ids) and model.lm_head.shape == (len(ids), model.cfg.hidden_size)
    assert torch.equal(got[:, ids], want[:, ids])  # row-independent GEMM: the same bits per kept row
    rest = torch.ones(260, dtype=torch.bool)
    rest[ids] = False
    assert torch.isinf(got[:, rest]).all()


def test_streamed_load_releases_every_copied_matrix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each projection and the head drop their mapped pages once packed (the load's peak stays near the file,
    not twice it); a released tensor still reads the same bytes (refaulted from the page cache)."""
    from specserve.formats.gguf_file import GGUFFile

    path = tmp_path / "m.gguf"
    _write_gguf(path, "qwen2", _tiny_tensors(260, bias=True), qtype="Q8_0")
    released: list[str] = []
    real = GGUFFile.release
    monkeypatch.setattr(GGUFFile, "release", lambda self, t: (released.append(t.name), real(self, t)))
    build_model(str(path), torch.float32, "w4a8")
    f = GGUFFile(path)
    mats = {t.name for t in f.tensors if len(t.shape) == 2 and t.name != "token_embd.weight"}
    assert mats and mats <= set(released)
    before = [np.array(t.data) for t in f.tensors]
    for t in f.tensors:
        f.release(t)
    assert all(np.array_equal(a, t.data) for a, t in zip(before, f.tensors))
