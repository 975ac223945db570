"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Gemma, Phi-3), tokenized
token for token as llama.cpp does (src/llama-vocab.cpp: `tokenizer_st_partition`, `llm_tokenizer_spm_session`).

    1. Partition: every control / user-defined / unknown token is cut out of the text whole, longest text first
       (each one splits all text fragments left so far), as llama.cpp's `parse_special=true`.
    2. Each text fragment gets the dummy prefix " " when `add_space_prefix` and it starts the text or follows a
       cut-out token; spaces become U+2581.
    3. Merge: start from single characters; repeatedly merge the adjacent pair whose concatenation is the
       highest-scoring token (ties: the leftmost pair), until no adjacent pair is a token.
    4. A character that is no token is spelled as its UTF-8 bytes' `<0xNN>` tokens (byte fallback).

Not `tokenizers`: its Unigram is another algorithm (best total score, not greedy merges by score). A BPE with merges
derived from the scores (as transformers' GGUF converter does; `hf_tokenizer`) gave llama.cpp's ids on Gemma 3 for
7,621 lines of prompts and 20,000 random strings, but differs by construction: it orders different merges into one
token by rank where llama.cpp takes the leftmost, and matches special tokens leftmost-longest where llama.cpp takes
the longest text first. It is what consumers that need a `tokenizers.Tokenizer` get (grammar backends, vocabulary
fingerprints); encode here is llama.cpp's algorithm itself, ~2 µs a character.
"""
from __future__ import annotations

import heapq
from typing import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"
_C_SPACE = " \t\n\v\f\r"  # C isspace(): what llama.cpp's lstrip/rstrip of a special token's neighbours removes

# Tokens llama.cpp marks as control by their text whatever the file says (llama_vocab::impl::load: its
# end-of-generation list): cut out of prompts whole, hidden by decode. (llama.cpp also ends generation at each;
# tokenizer.py ends at EOT_TEXTS only.)
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
# The end-of-turn texts among them (llama.cpp's special_eot_id search when the file has no eot id).
EOT_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
                       "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"))
# Fill-in-the-middle tokens, marked control by their text when the file does not give that FIM token's id
# (`tokenizer.ggml.{key}_token_id`, or the older prefix/suffix/middle keys).
FIM_TEXTS = {
    ("fim_pre", "prefix"): ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                            "<|code_prefix|>", "<|prefix|>"),
    ("fim_suf", "suffix"): ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                            "<|code_suffix|>", "<|suffix|>"),
    ("fim_mid", "middle"): ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                            "<|code_middle|>", "<|middle|>"),
    ("fim_pad",): ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("fim_rep",): ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("fim_sep",): ("<|file_sep|>",),
}
# Key length of the special-token prefilter (`_specials_in`): a special token is only searched for in a text that
# contains its first _KEY characters.
_KEY = 3


class SpmModel:
    """A SentencePiece vocabulary as a GGUF stores it, with llama.cpp's encode and decode.

    `types`: the GGUF token types after llama.cpp's by-text overrides (`llama_cpp_types`); `rstrip_specials`:
    special tokens drop the whitespace after them (llama.cpp does so for a model named Phi-3).
    """

    def __init__(self, pieces: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                 add_space_prefix: bool, bos_id: int | None, eos_id: int | None, unk_id: int | None,
                 add_bos: bool, add_eos: bool, rstrip_specials: bool = False) -> None:
        if not len(pieces) == len(scores) == len(types):
            raise ValueError(f"GGUF tokenizer: {len(pieces)} tokens, {len(scores)} scores, {len(types)} types")
        # NOTE: llama.cpp renames empty tokens, and a text that occurs twice maps to its last id.
        self.pieces = [p or f"[EMPTY_{i}]" for i, p in enumerate(pieces)]
        self.scores = [float(s) for s in scores]
        self.types = list(types)
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.add_space_prefix, self.add_bos, self.add_eos = add_space_prefix, add_bos, add_eos
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        # llama.cpp's cache_special_tokens: longest text (in UTF-8 bytes) first; equal lengths by id (llama.cpp's
        # std::sort leaves their order unspecified; it only matters for two overlapping tokens of one length).
        special = [i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED, UNKNOWN)]
        special.sort(key=lambda i: (-len(self.pieces[i].encode("utf-8")), i))
        self._special_rank = {i: r for r, i in enumerate(special)}
        self.rstrip: frozenset[int] = frozenset()
        if rstrip_specials:
            keep = {self.ids.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
            self.rstrip = frozenset({*special, *([self.ids["</s>"]] if "</s>" in self.ids else [])} - keep)
        self._special_index: dict[str, list[int]] = {}
        for i in special:
            self._special_index.setdefault(self.pieces[i][:_KEY], []).append(i)
        self._byte_ids = [self._byte_token(b) for b in range(256)]

    def _byte_token(self, b: int) -> int | None:
        """llama.cpp's byte_to_token: `<0xNN>`, else the byte itself as a one-character token."""
        i = self.ids.get(f"<0x{b:02X}>")
        if i is None and 0 < b < 0x80:
            i = self.ids.get(chr(b))
        return i

    # ---- encode ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True) -> list[int]:
        out: list[int] = [self.bos_id] if add_special and self.add_bos and self.bos_id is not None else []
        prev_special = True  # the dummy prefix goes on the first fragment and on each one after a special token
        for frag in self.partition(text) if text else ():
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            out += self.merge(frag.replace(" ", _SPACE))
            prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def partition(self, text: str) -> list[str | int]:
        """Text fragments and special-token ids, as llama.cpp's tokenizer_st_partition with parse_special."""
        frags: list[str | int] = [text]
        for tid in self._specials_in(text):
            piece, rstrip = self.pieces[tid], tid in self.rstrip
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or piece not in f:
                    out.append(f)
                    continue
                pos = 0
                while (m := f.find(piece, pos)) >= 0:
                    if m > pos:
                        out.append(f[pos:m])
                    out.append(tid)
                    pos = m + len(piece)
                    if rstrip:
                        while pos < len(f) and f[pos] in _C_SPACE:
                            pos += 1
                if pos < len(f):
                    out.append(f[pos:])
            frags = out
        return frags

    def _specials_in(self, text: str) -> list[int]:
        """The special tokens occurring in `text`, in llama.cpp's order (6k+ of them in Gemma: most never occur)."""
        keys = {text[i:i + k] for k in range(1, _KEY + 1) for i in range(len(text) - k + 1)}
        found = [t for key in keys & self._special_index.keys() for t in self._special_index[key]
                 if self.pieces[t] in text]
        return sorted(found, key=self._special_rank.__getitem__)

    def merge(self, text: str) -> list[int]:
        """llama.cpp's llm_tokenizer_spm_session::tokenize of one fragment (spaces already U+2581)."""
        n = len(text)
        if n == 0:
            return []
        ids, scores = self.ids, self.scores
        # Symbols: a doubly linked list over the characters; a merge grows the left one and empties the right.
        start, size = list(range(n)), [1] * n
        prev, nxt = list(range(-1, n - 1)), list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, joint size): best score, then leftmost

        def add_bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            tid = ids.get(text[start[left]:start[left] + size[left] + size[right]])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, size[left] + size[right]))

        for i in range(1, n):
            add_bigram(i - 1, i)
        while heap:
            _, left, right, joint = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != joint:
                continue  # stale: one side was merged since
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add_bigram(prev[left], left)
            add_bigram(left, nxt[left])
        out: list[int] = []
        i = 0
        while i != -1:
            piece = text[start[i]:start[i] + size[i]]
            tid = ids.get(piece)
            # NOTE: a merged symbol is always a token (a bigram is queued only if its text is one), so only a
            # single character falls back to bytes; llama.cpp's rev_merge re-split never applies.
            if tid is not None:
                out.append(tid)
            else:
                out += [self._byte_or_unk(b) for b in piece.encode("utf-8")]
            i = nxt[i]
        return out

    def _byte_or_unk(self, b: int) -> int:
        tid = self._byte_ids[b]
        if tid is None:
            if self.unk_id is None:  # llama.cpp throws here too
                raise ValueError(f"GGUF SentencePiece vocabulary has no byte token <0x{b:02X}> and no unknown token")
            return self.unk_id
        return tid

    # ---- decode ---------------------------------------------------------------------------------
    def is_special(self, tid: int) -> bool:
        """Hidden by decode(skip_special=True): control and unknown tokens (llama.cpp's token_to_piece without
        `special`); user-defined ones are text."""
        return self.types[tid] in (CONTROL, UNKNOWN)

    def token_bytes(self, tid: int) -> bytes:
        """What llama.cpp's token_to_piece(special=true) gives: a byte token's byte, U+2581 as a space in normal
        tokens, control and user-defined tokens as written (`bytes` of OpenAI logprobs)."""
        t, piece = self.types[tid], self.pieces[tid]
        if t == BYTE:
            return bytes([int(piece[3:5], 16)])
        if t in (CONTROL, USER_DEFINED, UNKNOWN):
            return piece.encode("utf-8")
        if t != NORMAL:  # unused / undefined: llama.cpp decodes them as nothing
            return b""
        return piece.replace(_SPACE, " ").encode("utf-8")

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """As transformers' sentencepiece decoder (U+2581 → space, byte runs → UTF-8, each byte of an invalid run
        → U+FFFD, then one leading space dropped when the vocabulary adds a dummy prefix)."""
        parts: list[str] = []
        run = bytearray()
        for tid in ids:
            tid = int(tid)
            if skip_special and self.is_special(tid):
                continue
            if self.types[tid] == BYTE:
                run.append(int(self.pieces[tid][3:5], 16))
                continue
            if run:
                parts.append(_utf8_run(run))
                run = bytearray()
            parts.append(self.token_bytes(tid).decode("utf-8", errors="replace"))
        if run:
            parts.append(_utf8_run(run))
        text = "".join(parts)
        return text[1:] if self.add_space_prefix and text.startswith(" ") else text

    # ---- a tokenizers.Tokenizer of this vocabulary ------------------------------------------------
    def hf_tokenizer(self) -> Tokenizer:
        """A `tokenizers.Tokenizer` with this vocabulary: BPE with merges derived from the scores, byte fallback,
        the dummy prefix on each fragment between added tokens, transformers' sentencepiece decoder. Its encode is
        close to, not exactly, llama.cpp's (module docstring); seconds to build for a 256k vocabulary."""
        vocab = {p: i for i, p in enumerate(self.pieces)}
        merges: list[tuple[float, int, int, str, str]] = []
        for i, piece in enumerate(self.pieces):
            if self.types[i] != NORMAL:
                continue
            for k in range(1, len(piece)):
                a, b = piece[:k], piece[k:]
                if a in vocab and b in vocab:
                    merges.append((-self.scores[i], vocab[a], vocab[b], a, b))
        merges.sort()
        unk = self.pieces[self.unk_id] if self.unk_id is not None else None
        tok = Tokenizer(BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=unk, fuse_unk=True,
                            byte_fallback=True, dropout=None))
        # NOTE: a normalizer, not Metaspace: that one leaves " hi" at ▁hi where llama.cpp prefixes it to ▁▁hi.
        tok.normalizer = normalizers.Sequence([*([normalizers.Prepend(_SPACE)] if self.add_space_prefix else []),
                                               normalizers.Replace(" ", _SPACE)])
        steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if self.add_space_prefix else []))
        tok.add_special_tokens([AddedToken(self.pieces[i], normalized=False, special=True)
                                for i, t in enumerate(self.types) if t in (CONTROL, UNKNOWN)])
        tok.add_tokens([AddedToken(self.pieces[i], normalized=False, special=False)
                        for i, t in enumerate(self.types) if t == USER_DEFINED])
        single, special = ["$A"], []
        if self.add_bos and self.bos_id is not None:
            single, special = [self.pieces[self.bos_id], *single], [(self.pieces[self.bos_id], self.bos_id)]
        if self.add_eos and self.eos_id is not None:
            single, special = [*single, self.pieces[self.eos_id]], [*special, (self.pieces[self.eos_id], self.eos_id)]
        if special:
            tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=special)
        return tok


def _utf8_run(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)  # tokenizers' ByteFallback decoder


def llama_cpp_types(pieces: Sequence[str], types: Sequence[int], named_fim: Iterable[str] = ()) -> list[int]:
    """GGUF token types as llama.cpp uses them: the end-of-generation texts, and the texts of each FIM token whose id
    the file does not give (`named_fim`: the `tokenizer.ggml.*_token_id` key stems it has), become control tokens
    (cut out of prompts whole, hidden by decode) whatever the file says. NOTE: llama.cpp ORs the control flag into a
    user-defined token (so it is hidden too), changes only the last id of a duplicated text, and marks only the
    first FIM text of a kind it meets (in hash order; CodeLlama has just one, ▁<PRE>): all of them here. Without
    a type array every token is normal."""
    named = set(named_fim)
    texts = set(EOG_TEXTS).union(*(t for keys, t in FIM_TEXTS.items() if not named & set(keys)))
    out = [*types, *[NORMAL] * (len(pieces) - len(types))]  # no token_type array: all normal, as in llama.cpp
    last = {p: i for i, p in enumerate(pieces) if p in texts}
    for i in last.values():
        if out[i] != UNKNOWN:
            out[i] = CONTROL
    return out
