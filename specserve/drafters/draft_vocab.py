"""A reduced draft vocabulary: the N target tokens a draft model's LM head keeps (`--speculative-draft-vocab`).

A 0.5B draft's head over Qwen2.5's 151,936 tokens is ~37% of the bytes it streams per draft token; the N most
frequent tokens of real conversations cover almost every token it would draft. Lossless: drafts are only
proposals; a draft model with a reduced head proposes from those N tokens (its q is 0 elsewhere), and the
target's verification keeps the output distribution exact whatever q is.

A vocabulary is a directory (built by `specserve build-draft-vocab`, train/draft_vocab.py): `draft_vocab.npz`
(sorted ids), `config.json` (size, tokenizer fingerprint, held-out coverage) and `README.md` (the model card).
`auto` finds one shipped for the target's tokenizer (drafters/shipped/*-draft-vocab-*).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

FILE = "draft_vocab.npz"


def tokenizer_fingerprint(tok: object) -> str:
    """Which token ids mean which strings: a digest of the vocabulary, so a vocabulary is only ever applied to
    the tokenizer it was counted with."""
    fp = getattr(tok, "_vocab_fingerprint", None)
    if fp is None:  # NOTE: computed once per tokenizer (~0.3 s for Qwen2.5's 151k pieces; a start asks twice)
        vocab = tok.backend.get_vocab(with_added_tokens=True)  # type: ignore[attr-defined]
        text = "".join(f"{i}\t{piece}\n" for piece, i in sorted(vocab.items(), key=lambda kv: kv[1]))
        fp = tok._vocab_fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]  # type: ignore[attr-defined]
    return fp


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


def shipped_draft_vocab(tok: object) -> Path | None:
    """The shipped vocabulary counted with this tokenizer, if any."""
    fp = None
    for d in sorted((Path(__file__).parent / "shipped").glob("*-draft-vocab-*")):
        fp = fp or tokenizer_fingerprint(tok)
        if json.loads((d / "config.json").read_text())["tokenizer"] == fp:
            return d
    return None


def resolve_draft_vocab(spec: str | None, tok: object, vocab_size: int) -> np.ndarray | None:
    """--speculative-draft-vocab: auto (the shipped one for this tokenizer, else none) | none | a directory."""
    if spec in (None, "none"):
        return None
    path = shipped_draft_vocab(tok) if spec == "auto" else Path(spec)
    if path is None:
        return None
    if not (path / "config.json").is_file():
        raise ValueError(f"--speculative-draft-vocab {spec}: not a draft vocabulary directory (no config.json)")
    return load_draft_vocab(path, tok, vocab_size)
