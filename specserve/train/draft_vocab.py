"""`specserve build-draft-vocab`: the N target tokens a draft model's LM head keeps (a reduced draft vocabulary).

A 0.5B draft's head over Qwen2.5's 151,936 tokens is ~37% of the bytes it streams per draft token; the N most
frequent tokens of real conversations cover almost every token it would draft. Lossless: drafts are only
proposals; a draft model with a reduced head proposes from those N tokens (its q is 0 elsewhere), and the
target's verification keeps the output distribution exact whatever q is.

Data: ShareGPT conversations with the benchmark prompts removed (train/corpus.py), rendered through the
chat template (assistant and user turns alike); special tokens the tokenizer ends turns with are always kept.
Writes `<out>/draft_vocab.npz` (sorted ids), `<out>/config.json` (size, tokenizer fingerprint, coverage)
and `<out>/README.md` (the model card).
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

FILE = "draft_vocab.npz"


def tokenizer_fingerprint(tok: object) -> str:
    """Which token ids mean which strings: a digest of the vocabulary, so a vocabulary is only ever applied to
    the tokenizer it was counted with."""
    vocab = tok.backend.get_vocab(with_added_tokens=True)  # type: ignore[attr-defined]
    h = hashlib.sha256()
    for piece, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{piece}\n".encode())
    return h.hexdigest()[:16]


def load_draft_vocab(path: str | Path, tok: object, vocab_size: int) -> np.ndarray:
    """Sorted target ids of a built draft vocabulary; refuses one counted with another tokenizer."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if cfg["tokenizer"] != tokenizer_fingerprint(tok):
        raise ValueError(f"--speculative-draft-vocab {path}: built for another tokenizer ({cfg['tokenizer_name']})")
    ids = np.load(path / FILE)["ids"]
    if ids.size == 0 or int(ids.max()) >= vocab_size or np.any(np.diff(ids) <= 0):
        raise ValueError(f"--speculative-draft-vocab {path}: ids must be sorted, unique and below {vocab_size}")
    return ids


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a model with the tokenizer to count with (GGUF file, HF dir or alias)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", type=int, default=32768, help="tokens kept (default 32768)")
    p.add_argument("--conversations", type=int, default=20000, help="training conversations counted")


def run(a: argparse.Namespace) -> None:
    from ..models.gguf_file import GGUFFile
    from ..models.loader import resolve_model_path
    from ..models.tokenizer import Tokenizer
    from .corpus import corpus

    path = resolve_model_path(a.model)
    tok = Tokenizer.from_gguf(GGUFFile(path)) if path.is_file() else Tokenizer.from_hf_dir(path)
    train, heldout, dropped = corpus()
    texts = [tok.apply_chat_template(c) for c in train[: a.conversations]]
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    for enc in tok.backend.encode_batch(texts, add_special_tokens=False):
        np.add.at(counts, enc.ids, 1)
    keep = set(np.argsort(-counts, kind="stable")[: a.size].tolist())
    keep |= set(tok.eos_token_ids) | {i for i in (tok.bos_token_id,) if i is not None}
    ids = np.array(sorted(keep)[: max(a.size, len(keep))], dtype=np.int64)
    held = np.zeros_like(counts)
    for enc in tok.backend.encode_batch([tok.apply_chat_template(c) for c in heldout], add_special_tokens=False):
        np.add.at(held, enc.ids, 1)
    coverage = float(held[ids].sum() / max(1, held.sum()))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / FILE, ids=ids)
    cfg = {"size": int(ids.size), "tokenizer": tokenizer_fingerprint(tok), "tokenizer_name": path.name,
           "vocab_size": int(tok.vocab_size), "counted_tokens": int(counts.sum()),
           "conversations": min(a.conversations, len(train)), "heldout_coverage": coverage}
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (out / "README.md").write_text(
        f"# Reduced draft vocabulary ({ids.size} tokens)\n\n"
        f"The {a.size} most frequent token ids of {cfg['conversations']} ShareGPT training conversations "
        f"(benchmark prompts removed; {cfg['counted_tokens']:,} tokens through the chat template of "
        f"`{path.name}`), plus the tokenizer's end-of-turn and BOS tokens ({ids.size} in all). A draft model served with "
        f"`--speculative-draft-vocab` keeps only these rows of its LM head.\n\n"
        f"Coverage of {len(heldout)} held-out conversations' tokens: {coverage:.4f}.\n\n"
        f"Reproduce: `specserve build-draft-vocab {a.model} --out {a.out} --size {a.size} "
        f"--conversations {a.conversations}`\n")
    print(f"wrote {out}: {ids.size} ids, held-out coverage {coverage:.4f}")
