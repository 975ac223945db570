"""`specserve build-draft-vocab`: count the target tokens of real conversations, keep the N most frequent.

Data: ShareGPT conversations with the benchmark prompts removed (train/corpus.py), rendered through the
chat template (assistant and user turns alike); the tokenizer's end-of-turn and BOS tokens are always kept.
The result is read by drafters/draft_vocab.py (format there).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ..drafters.draft_vocab import FILE, tokenizer_fingerprint


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a model with the tokenizer to count with (GGUF file, HF dir or alias)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", type=int, default=32768, help="tokens kept (default 32768)")
    p.add_argument("--conversations", type=int, default=20000, help="training conversations counted")


def run(a: argparse.Namespace) -> None:
    from ..formats.gguf_file import GGUFFile
    from ..loading.checkpoint import resolve_model_path
    from ..tokenizer.tokenizer import Tokenizer
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
