"""Tokenizer wrapper over `tokenizers.Tokenizer`, built from an HF directory or GGUF metadata.

GGUF vocabularies tokenize as llama.cpp does on the same file: a byte-level BPE (`tokenizer.ggml.model = "gpt2"`)
is a `tokenizers` BPE split by llama.cpp's regexes for its `tokenizer.ggml.pre` (_PRE_SPLITS; any other pre name
is refused, as llama.cpp does); a SentencePiece vocabulary (`"llama"`) is `SpmTokenizer` (spm.py). Other
tokenizer models are refused.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.models import BPE

from .spm import CONTROL, EOT_TEXTS, FIM_TEXTS, UNKNOWN, USER_DEFINED, SpmModel, llama_cpp_types

# `tokenizer.ggml.pre` → llama.cpp's split regexes for it (llm_tokenizer_bpe in src/llama-vocab.cpp), applied in
# order, each one splitting the pieces of the one before. NOTE: llama.cpp spells the contractions '[sS] where the
# models' tokenizer.json has (?i:'s): the same on ASCII, and llama.cpp is what these files are run with.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT, also for a file without the key: not the plain GPT-2 split
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    # "gpt2" is no llama.cpp name (it says "gpt-2"); kept: it always meant the GPT-2 split here
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo"), (_GPT2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    (r"\p{N}", _GPT2_SPLIT)),
    **dict.fromkeys((*_LLAMA3_PRES, "dbrx", "smaug-bpe"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
                    (_QWEN2_SPLIT,)),
}
_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-char table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _named_fim(reader: Any) -> list[str]:
    """The FIM token id keys (`tokenizer.ggml.{stem}_token_id`) the file has."""
    return [k for keys in FIM_TEXTS for k in keys if _field(reader, f"tokenizer.ggml.{k}_token_id") is not None]


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a str or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class Tokenizer:
    def __init__(
        self,
        tok: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
    ) -> None:
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self._added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
        # Byte-level vocabularies spell bytes as GPT-2 chars; token_bytes must map them back.
        self._byte_level = tok.decoder is not None and b'"ByteLevel"' in tok.decoder.__getstate__()
        # Whether the post-processor prepends BOS is the ground truth for "add_bos".
        self.add_bos: bool = bos_token_id is not None and tok.encode("a").ids[:1] == [bos_token_id]
        self._template = None

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path} (needed to build the tokenizer)")
        tok = _HFTokenizer.from_file(str(tj))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # list-of-named-templates form: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        bos_str, eos_str = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        bos = tok.token_to_id(bos_str) if bos_str else None
        eos: list[int] = [tok.token_to_id(eos_str)] if eos_str and tok.token_to_id(eos_str) is not None else []
        gen = path / "generation_config.json"
        if gen.is_file():
            g = json.loads(gen.read_text(encoding="utf-8"))
            eos += _as_ids(g.get("eos_token_id"))
            if bos is None and g.get("bos_token_id") is not None:
                bos = int(g["bos_token_id"])
        return cls(tok, bos_token_id=bos, eos_token_ids=eos, chat_template=template)

    @classmethod
    def from_gguf(cls, reader: Any) -> "Tokenizer":
        """Build from a GGUF reader's tokenizer metadata (`gguf_file.GGUFFile` or `gguf.GGUFReader`)."""
        model = _field(reader, "tokenizer.ggml.model")
        if model == "llama":
            return SpmTokenizer.from_gguf(reader)
        if model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model): supported are "
                             + ", ".join(f"{k!r} ({v})" for k, v in _MODELS.items()))
        pre = _field(reader, "tokenizer.ggml.pre") or "default"  # llama.cpp: no key (or "") is "default"
        splits = _PRE_SPLITS.get(pre)
        if splits is None:
            raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) of a byte-level BPE "
                             f"vocabulary: supported are {', '.join(sorted(_PRE_SPLITS))}")
        tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
        types = llama_cpp_types(tokens, _field(reader, "tokenizer.ggml.token_type", []) or [], _named_fim(reader))
        merges_raw = _field(reader, "tokenizer.ggml.merges")
        if not merges_raw:
            raise ValueError("GGUF byte-level tokenizer has no tokenizer.ggml.merges")
        alphabet = set(_bytes_to_unicode().values())
        b2u = _bytes_to_unicode()
        # Tokens not already spelled in the byte alphabet are respelled from their UTF-8 bytes (as HF does).
        vocab = {
            t if set(t) <= alphabet else "".join(b2u[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ")) for m in merges_raw]
        # llama.cpp's llama3 pre types take a word that is a whole token as is, before any merge
        tok = _HFTokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, ignore_merges=pre in _LLAMA3_PRES))
        if splits == (_GPT2_SPLIT,):  # ByteLevel's own regex is this one
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        tok.decoder = decoders.ByteLevel()
        # Control and unknown tokens (<|im_start|> ...) must match whole; a "control" token outside the byte
        # alphabet is a llama.cpp mislabel and is skipped, like HF does.
        tok.add_special_tokens([
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN) and set(t) <= alphabet
        ])
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
        if user:
            tok.add_tokens(user)
        bos = _field(reader, "tokenizer.ggml.bos_token_id")
        bos = int(bos) if bos is not None else None
        # llama.cpp adds BOS for the llama3 pre types unless the file says otherwise
        if bool(_field(reader, "tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRES)) and bos is not None:
            bos_tok = tokens[bos]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos_tok} $A", pair=f"{bos_tok} $A $B", special_tokens=[(bos_tok, bos)]
            )
        # llama.cpp's end-of-generation set: eos plus eot/eom where the file names them.
        eos = [int(v) for k in ("eos", "eot", "eom")
               if (v := _field(reader, f"tokenizer.ggml.{k}_token_id")) is not None]
        return cls(tok, bos_token_id=bos, eos_token_ids=eos,
                   chat_template=_field(reader, "tokenizer.chat_template"))

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. to save a tokenizer.json)."""
        return self._tok

    # ---- encode / decode ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise IndexError(f"token id {token_id} out of range (vocab size {self.vocab_size})")
        return piece

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes a token stands for (OpenAI logprobs `bytes`); may be a partial UTF-8 sequence."""
        token_id = int(token_id)
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.id_to_piece(token_id)
        if self._byte_level:
            u2b = _unicode_to_bytes()
            return b"".join(bytes([u2b[c]]) if c in u2b else c.encode("utf-8") for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # sentencepiece byte-fallback piece
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_to_id(self, piece: str) -> int | None:
        return self._tok.token_to_id(piece)

    # ---- chat -----------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render like HF `apply_chat_template(tokenize=False)`; `extra` become template variables (e.g. tools)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt (completions API) instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        specials = {
            "bos_token": self.id_to_piece(self.bos_token_id) if self.bos_token_id is not None else "",
            "eos_token": self.id_to_piece(self.eos_token_ids[0]) if self.eos_token_ids else "",
        }
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **{**specials, **extra}
        )

    def incremental(self, skip_special_tokens: bool = True,
                    prompt_ids: Sequence[int] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens, prompt_ids)


class SpmTokenizer(Tokenizer):
    """A SentencePiece GGUF vocabulary: encode and decode by `spm.SpmModel`, as llama.cpp on the same file.
    `backend`, a `tokenizers.Tokenizer` of the vocabulary (grammar backends, fingerprints), is built on first use:
    seconds for 256k tokens, and its own encode is only close to llama.cpp's."""

    def __init__(self, model: SpmModel, *, eos_token_ids: Sequence[int], chat_template: str | None = None) -> None:
        # NOTE: no super().__init__(): the base wraps a tokenizers.Tokenizer built up front.
        self.spm = model
        self._hf: _HFTokenizer | None = None
        self.bos_token_id = model.bos_id
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.vocab_size = len(model.pieces)
        self.add_bos = model.add_bos and model.bos_id is not None
        self._template = None

    @classmethod
    def from_gguf(cls, reader: Any) -> "SpmTokenizer":
        pieces: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
        n = len(pieces)

        def token_id(key: str, default: int | None) -> int | None:
            # llama.cpp: an id past the vocabulary keeps the default, and a default past it is no token
            v = _field(reader, f"tokenizer.ggml.{key}")
            v = int(v) if v is not None and 0 <= int(v) < n else default
            return v if v is not None and v < n else None

        name = str(_field(reader, "general.name", "") or "").lower()
        # llama.cpp's defaults for a "llama" vocabulary where the file has no key
        model = SpmModel(
            pieces, _field(reader, "tokenizer.ggml.scores") or [0.0] * n,
            llama_cpp_types(pieces, _field(reader, "tokenizer.ggml.token_type") or [], _named_fim(reader)),
            add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
            bos_id=token_id("bos_token_id", 1), eos_id=token_id("eos_token_id", 2),
            unk_id=token_id("unknown_token_id", 0),
            add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
            add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
            rstrip_specials="phi-3" in name or "phi3" in name)
        # Generation ends at eos, and at eot/eom where the file names them; without an eot id, at the end-of-turn
        # tokens llama.cpp finds by their text (Gemma's <end_of_turn>, Phi-3's <|end|>), as the models' HF
        # generation configs do. NOTE: not all of llama.cpp's end-of-generation texts: Gemma's "</s>" is an HTML tag.
        eot = token_id("eot_token_id", None)
        eots = [eot] if eot is not None else [model.ids[t] for t in sorted(EOT_TEXTS) if t in model.ids]
        eos = [model.eos_id, *eots, token_id("eom_token_id", None)]
        return cls(model, eos_token_ids=[i for i in eos if i is not None],
                   chat_template=_field(reader, "tokenizer.chat_template"))

    @property
    def backend(self) -> _HFTokenizer:
        if self._hf is None:
            self._hf = self.spm.hf_tokenizer()
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.spm.encode(text, add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.spm.decode(list(ids), skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        if not 0 <= int(token_id) < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range (vocab size {self.vocab_size})")
        return self.spm.pieces[int(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        self.id_to_piece(token_id)  # the range check
        return self.spm.token_bytes(int(token_id))

    def token_to_id(self, piece: str) -> int | None:
        return self.spm.ids.get(piece)


def _compile_template(source: str) -> Any:
    """Same environment HF uses: sandboxed, trim/lstrip blocks, loopcontrols, non-escaping tojson."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Feed generated ids one at a time; get text deltas that never split a UTF-8 character.

    Decodes a short sliding window (prefix..end) and emits the text past prefix..read, so tokenizers
    whose decoders depend on context (sentencepiece leading spaces) still produce the right spacing.
    A delta ending in U+FFFD is held back: the next token may complete the character.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)[-6:]  # a little context for leading-space handling
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def feed(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """End of stream: release held-back text, even an incomplete character (as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
