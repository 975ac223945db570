"""A byte-level tokenizer for the tiny 97-token test models, so grammars can run on them: token i < 96
is one printable ASCII character (or newline), token 96 is EOS. Built with `tokenizers`, so the
grammar backends read it as they read a real model's tokenizer."""
from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from specserve.tokenizer.tokenizer import Tokenizer

EOS = 96
CHARS = [chr(c) for c in range(0x20, 0x7F)] + ["\n"]  # 95 printable + newline = 96 tokens


def _byte_char(b: int) -> str:
    """GPT-2's byte → unicode spelling of byte-level vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def tiny_tokenizer(chars: list[str] | None = None, eos: bool = True) -> Tokenizer:
    """One token per character of `chars` (default: CHARS), then "<eos>" (when `eos`)."""
    chars = CHARS if chars is None else chars
    vocab = {_byte_char(ord(c)): i for i, c in enumerate(chars)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if not eos:
        return Tokenizer(tok, bos_token_id=None, eos_token_ids=())
    tok.add_special_tokens(["<eos>"])
    return Tokenizer(tok, bos_token_id=None, eos_token_ids=(len(chars),))
