"""Write a random-weight GGUF with Qwen2.5-7B-Instruct's geometry (or, with --experts, a Qwen3-MoE one) and Q4_K_M's
tensor types.

For measuring load memory, decode speed and draft/target step cost at 7B scale where no real 7B file can be
had. The weights are random (so the text is meaningless) but sized so activations stay finite and the logits
are spread out. The tokenizer comes from a real GGUF, so prompts and chat templates behave as they would on
the real model.

    python scripts/make_synthetic_gguf.py --out ~/.cache/specserve/models/synthetic-qwen2.5-7b-q4_k_m.gguf
    python scripts/make_synthetic_gguf.py --experts 64 --out ~/.cache/specserve/models/synthetic-qwen3moe-7b-a1b-q4_k_m.gguf

`--experts E` writes `qwen3moe`: OLMoE-1B-7B's expert geometry (16 layers, hidden 2048, 64 experts of 1024, 8 used
per token: 7B weights, ~1.3B read per token) with Qwen3's attention (per-head q/k norms, no biases), the router in
F32 as llama.cpp's quantizer leaves it, and the stacked `ffn_*_exps` in Q4_K (ffn_down_exps Q6_K in Q4_K_M's
layers with more bits), ~4 GB. Its unset sizes default to that geometry.

K-quant blocks are built directly as bytes (layouts as in gguf/quants.py) and streamed tensor by tensor in
row chunks, so the writer's memory stays at a few chunks whatever the file size (~4.7 GB by default).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, TokenType

QK = 256  # K-quant super-block
DEFAULT_TOKENIZER = Path("~/.cache/specserve/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
CHUNK_BYTES = 32 << 20
Q4_K, Q6_K, F32 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.F32
# Std of a uniform code: 0..15 (Q4_K nibbles), 0..63 minus 32 (Q6_K).
_Q4_STD, _Q6_STD = np.sqrt((16**2 - 1) / 12), np.sqrt((64**2 - 1) / 12)


def more_bits_layers(n: int) -> set[int]:
    """Layers whose attn_v/ffn_down Q4_K_M stores as Q6_K.

    llama.cpp's rule is: the first n/8 and last n/8 of its counter, and every third in between. The counter
    runs over tensors in the order the converter met them, and HF safetensors sort layer names as strings
    (0, 1, 10, 11, ..., 19, 2, 20, ...); so the real Qwen2.5 files have Q6_K at {0, 1, 5-10, 13, 16, 19, 21,
    24, 27} of 28 (checked against the 1.5B and 0.5B files), and we mirror exactly that.
    """
    order = sorted(range(n), key=str)
    return {layer for i, layer in enumerate(order) if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2}


@dataclass
class Spec:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: (rows = out features, cols = in features)
    std: float  # weight std; for F32 norms the spread around 1.0
    live_rows: int = -1  # rows past this are zero (vocab padding, as untrained rows of a real head)

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape[:-1])) * self.row_bytes


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block → Q4_K's 12 bytes: bytes 0-3 / 4-7 hold sc/mn 0-3 in their low
    6 bits and the top 2 bits of sc/mn 4-7 above them; bytes 8-11 hold the low nibbles of sc 4-7 | mn 4-7 << 4."""
    out = np.empty(sc.shape[:-1] + (12,), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _random(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return np.frombuffer(rng.bytes(shape[0] * shape[1]), np.uint8).reshape(shape)


def q4_k_blocks(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """nb Q4_K blocks (w = d·sc·q − dmin·mn): uniform nibbles, 6-bit scales in 32..63, mins = scales and
    dmin = 7.5·d, so every group of 32 is centred on zero; d sets the overall std."""
    b = np.empty((nb, 144), np.uint8)
    sc = rng.integers(32, 64, (nb, 8), dtype=np.uint8)
    d = std / (_Q4_STD * np.sqrt(np.mean(sc.astype(np.float64) ** 2, axis=1)))
    b[:, 0:2] = d.astype(np.float16)[:, None].view(np.uint8)
    b[:, 2:4] = (7.5 * d).astype(np.float16)[:, None].view(np.uint8)
    b[:, 4:16] = _pack_scales(sc, sc)
    b[:, 16:] = _random(rng, (nb, 128))
    return b


def q6_k_blocks(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """nb Q6_K blocks (ql[128], qh[64], int8 scales[16], f16 d; w = d·s·(q − 32)): uniform 6-bit codes and
    scales of random sign, so the −0.5 mean of q − 32 cancels across groups."""
    b = np.empty((nb, 210), np.uint8)
    b[:, :192] = _random(rng, (nb, 192))
    s = rng.integers(16, 128, (nb, 16)) * rng.choice(np.array([-1, 1]), (nb, 16))
    b[:, 192:208] = s.astype(np.int8).view(np.uint8)
    d = std / (_Q6_STD * np.sqrt(np.mean(s.astype(np.float64) ** 2, axis=1)))
    b[:, 208:210] = d.astype(np.float16)[:, None].view(np.uint8)
    return b


class LazyTensor:
    """What GGUFWriter.write_tensor_data needs (nbytes, tofile), producing the bytes chunk by chunk."""

    def __init__(self, spec: Spec, rng: np.random.Generator) -> None:
        self.spec, self.rng, self.nbytes = spec, rng, spec.nbytes

    def tofile(self, fp: IO[bytes]) -> None:
        s = self.spec
        if s.qtype == F32:  # norms (≈ 1), biases (≈ 0), a router: small
            base = 1.0 if s.name.endswith("norm.weight") else 0.0
            (base + s.std * self.rng.standard_normal(s.shape)).astype(np.float32).tofile(fp)
            return
        rows = int(np.prod(s.shape[:-1]))  # stacked experts: every expert's rows, one after another
        live = rows if s.live_rows < 0 else s.live_rows
        step = max(1, CHUNK_BYTES // s.row_bytes)
        make = q4_k_blocks if s.qtype == Q4_K else q6_k_blocks
        per_row = s.shape[-1] // QK
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            b = make(self.rng, n * per_row, s.std)
            if r0 + n > live:  # zero scales ⇒ zero weights for padding rows
                b.reshape(n, per_row, -1)[max(0, live - r0):, :, :] = 0
            b.tofile(fp)


def tensor_specs(a: argparse.Namespace, n_tokens: int) -> list[Spec]:
    h, hd, inter = a.hidden, a.hidden // a.heads, a.intermediate
    q, kv = a.heads * hd, a.kv_heads * hd
    big = more_bits_layers(a.layers)
    # The embedding's scale hardly matters: attn_norm rescales it before any use.
    out = [Spec("token_embd.weight", Q4_K, (a.vocab_rows, h), 0.02, n_tokens)]
    for i in range(a.layers):
        p, heavy = f"blk.{i}.", Q6_K if i in big else Q4_K
        if a.experts:
            out += moe_layer_specs(a, p, heavy)
            continue
        # 1/sqrt(fan_in) keeps every projection's output near unit scale at any width.
        out += [
            Spec(p + "attn_norm.weight", F32, (h,), 0.02),
            Spec(p + "attn_q.weight", Q4_K, (q, h), h ** -0.5), Spec(p + "attn_q.bias", F32, (q,), 0.02),
            Spec(p + "attn_k.weight", Q4_K, (kv, h), h ** -0.5), Spec(p + "attn_k.bias", F32, (kv,), 0.02),
            Spec(p + "attn_v.weight", heavy, (kv, h), h ** -0.5), Spec(p + "attn_v.bias", F32, (kv,), 0.02),
            Spec(p + "attn_output.weight", Q4_K, (h, q), q ** -0.5),
            Spec(p + "ffn_norm.weight", F32, (h,), 0.02),
            Spec(p + "ffn_gate.weight", Q4_K, (inter, h), h ** -0.5),
            Spec(p + "ffn_up.weight", Q4_K, (inter, h), h ** -0.5),
            Spec(p + "ffn_down.weight", heavy, (h, inter), inter ** -0.5),
        ]
    out += [Spec("output_norm.weight", F32, (h,), 0.02),
            Spec("output.weight", Q6_K, (a.vocab_rows, h), h ** -0.5, n_tokens)]
    return out


def moe_layer_specs(a: argparse.Namespace, p: str, heavy: GGMLQuantizationType) -> list[Spec]:
    """One qwen3moe layer: attention without biases, per-head q/k norms, an F32 router, stacked experts."""
    h, hd, e, inter = a.hidden, a.hidden // a.heads, a.experts, a.expert_intermediate
    q, kv = a.heads * hd, a.kv_heads * hd
    return [
        Spec(p + "attn_norm.weight", F32, (h,), 0.02),
        Spec(p + "attn_q.weight", Q4_K, (q, h), h ** -0.5), Spec(p + "attn_k.weight", Q4_K, (kv, h), h ** -0.5),
        Spec(p + "attn_v.weight", heavy, (kv, h), h ** -0.5), Spec(p + "attn_output.weight", Q4_K, (h, q), q ** -0.5),
        Spec(p + "attn_q_norm.weight", F32, (hd,), 0.02), Spec(p + "attn_k_norm.weight", F32, (hd,), 0.02),
        Spec(p + "ffn_norm.weight", F32, (h,), 0.02),
        Spec(p + "ffn_gate_inp.weight", F32, (e, h), h ** -0.5),  # the router: random logits, so routes spread
        Spec(p + "ffn_gate_exps.weight", Q4_K, (e, inter, h), h ** -0.5),
        Spec(p + "ffn_up_exps.weight", Q4_K, (e, inter, h), h ** -0.5),
        Spec(p + "ffn_down_exps.weight", heavy, (e, h, inter), inter ** -0.5),
    ]


def copy_tokenizer(src: Path, w: GGUFWriter, rows: int | None) -> int:
    """Copy every tokenizer.* field of `src`; return its token count. With `rows` beyond that count, the token
    list is padded to `rows` with "[PAD<id>]" tokens of type UNUSED, as llama.cpp's converter pads Qwen2.5-7B's
    151,936 tokens to its 152,064 embedding rows (llama.cpp refuses an embedding whose rows differ from the
    token count)."""
    r = GGUFReader(str(src))
    n = len(r.fields["tokenizer.ggml.tokens"].contents()) if "tokenizer.ggml.tokens" in r.fields else 0
    if not n:
        raise ValueError(f"{src}: no tokenizer.ggml.tokens")
    if rows is not None and rows < n:
        raise SystemExit(f"--vocab-rows {rows} < the tokenizer's {n} tokens")
    pad = (rows or n) - n
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        val = f.contents()
        if pad and key == "tokenizer.ggml.tokens":
            val = val + [f"[PAD{i}]" for i in range(n, n + pad)]
        elif pad and key == "tokenizer.ggml.token_type":
            val = val + [int(TokenType.UNUSED)] * pad
        elif pad and key == "tokenizer.ggml.scores":
            val = val + [0.0] * pad
        w.add_key_value(key, val, f.types[0], sub)
    return n


def write(a: argparse.Namespace) -> list[Spec]:
    if a.hidden % a.heads or a.heads % a.kv_heads:
        raise SystemExit("--hidden must divide by --heads, and --heads by --kv-heads")
    if a.hidden % QK or a.intermediate % QK or a.expert_intermediate % QK:
        raise SystemExit(f"K-quants need --hidden, --intermediate and --expert-intermediate to be multiples of {QK}")
    if a.experts and not 0 < a.experts_used <= a.experts:
        raise SystemExit("--experts-used must be in 1..--experts")
    out = Path(a.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(out), "qwen3moe" if a.experts else "qwen2")
    w.add_name(a.name)
    w.add_block_count(a.layers)
    w.add_context_length(a.context_length)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.intermediate)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    if a.experts:
        w.add_expert_count(a.experts)
        w.add_expert_used_count(a.experts_used)
        w.add_expert_feed_forward_length(a.expert_intermediate)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.rms_eps)
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_quantization_version(2)
    n_tokens = copy_tokenizer(Path(a.tokenizer_from).expanduser(), w, a.vocab_rows or None)
    a.vocab_rows = a.vocab_rows or n_tokens
    specs = tensor_specs(a, n_tokens)
    for s in specs:
        if s.qtype == F32:
            w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes)
        else:  # byte shape; the writer turns it back into the element shape for the quant type
            w.add_tensor_info(s.name, (*s.shape[:-1], s.row_bytes), np.dtype(np.uint8), s.nbytes, raw_dtype=s.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, s in enumerate(specs):
        # Seeded per tensor, so any one tensor is reproducible on its own.
        lazy = LazyTensor(s, np.random.default_rng([a.seed, i]))
        w.write_tensor_data(lazy, tensor_endianess=GGUFEndian.LITTLE)  # type: ignore[arg-type]
    w.close()
    return specs


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="GGUF path to write")
    p.add_argument("--tokenizer-from", default=str(DEFAULT_TOKENIZER), help="GGUF whose tokenizer.* fields to copy")
    p.add_argument("--hidden", type=int, default=None, help="default 3584 (MoE: 2048)")
    p.add_argument("--layers", type=int, default=None, help="default 28 (MoE: 16)")
    p.add_argument("--heads", type=int, default=None, help="default 28 (MoE: 16)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=18944, help="a dense MLP's width (ignored with --experts)")
    p.add_argument("--experts", type=int, default=0, help="write a qwen3moe file with this many experts per layer")
    p.add_argument("--experts-used", type=int, default=8, help="experts a token routes to")
    p.add_argument("--expert-intermediate", type=int, default=1024, help="each expert's MLP width")
    p.add_argument("--vocab-rows", type=int, default=152064, 
                   help="embedding/head rows (≥ the token count; 0 = the token count)")
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--rms-eps", type=float, default=1e-6)
    p.add_argument("--name", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    moe = bool(a.experts)
    for k, dense, sparse in (("hidden", 3584, 2048), ("layers", 28, 16), ("heads", 28, 16)):
        if getattr(a, k) is None:
            setattr(a, k, sparse if moe else dense)
    a.name = a.name or ("Synthetic Qwen3-MoE 7B-A1B (random weights)" if moe
                        else "Synthetic Qwen2.5 7B Instruct (random weights)")
    return a


def main(argv: Sequence[str] | None = None) -> list[Spec]:
    a = parse(argv)
    t0 = time.perf_counter()
    specs = write(a)
    size = Path(a.out).expanduser().stat().st_size
    print(f"wrote {a.out}: {len(specs)} tensors, {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    return specs


if __name__ == "__main__":
    main()
