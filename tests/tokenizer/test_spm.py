"""SentencePiece GGUF vocabularies (tokenizer/spm.py): llama.cpp's algorithm on a tiny hand-built vocabulary (always
runs) and token-for-token parity with llama.cpp on Gemma 3 (skipped without its file); byte-level BPE: llama.cpp's
split for each pre name, and the refusal of tokenizer models and pre names we do not implement."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.formats.gguf_file import GGUFFile
from specserve.tokenizer.spm import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, SpmModel
from specserve.tokenizer.tokenizer import SpmTokenizer, Tokenizer

GEMMA = Path.home() / ".cache" / "specserve" / "models" / "gemma-3-270m-q4_k_m.gguf"
GOLDEN = Path(__file__).with_name("gemma3_golden.jsonl")

# (piece, score, type); a normal piece scores minus its place in NORMALS: "bc" merges before "ab".
SPECIAL = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL), ("<|ctl|>", 0.0, CONTROL),
           ("xyz", 0.0, USER_DEFINED), ("wx", 0.0, CONTROL)]
NORMALS = ["▁", "a", "b", "c", "h", "e", "l", "o", "w", "x", "y", "z", "bc", "ab", "aa", "he", "ll", "hell", "hello",
           "lo", "▁a", "▁hello", "▁▁", "日"]
BYTES = [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
VOCAB = SPECIAL + BYTES + [(p, -float(i), NORMAL) for i, p in enumerate(NORMALS)]
ID = {p: i for i, (p, _, _) in enumerate(VOCAB)}


def _write(path: Path, vocab: list[tuple[str, float, int]] = VOCAB, *, prefix: bool | None = True,
           add_bos: bool | None = True, add_eos: bool | None = None, model: str = "llama",
           pre: str | None = None, merges: list[str] | None = None, name: str = "tiny spm") -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list([p for p, _, _ in vocab])
    w.add_token_scores([s for _, s, _ in vocab])
    w.add_token_types([t for _, _, t in vocab])
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)  # noqa: E702
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if prefix is not None:
        w.add_add_space_prefix(prefix)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    return path


def _tok(tmp_path: Path, file: str = "t.gguf", **kw) -> SpmTokenizer:
    tok = Tokenizer.from_gguf(GGUFFile(_write(tmp_path / file, **kw)))
    assert isinstance(tok, SpmTokenizer)
    return tok


def _pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.id_to_piece(i) for i in ids]


# ---- the algorithm on a tiny vocabulary ---------------------------------------------------------
def test_merges_follow_scores_then_leftmost(tmp_path: Path) -> None:
    tok = _tok(tmp_path, prefix=False, add_bos=False)
    assert _pieces(tok, tok.encode("abc")) == ["a", "bc"]  # "bc" scores higher than "ab"
    assert _pieces(tok, tok.encode("aaa")) == ["aa", "a"]  # equal candidates: the leftmost pair first
    assert _pieces(tok, tok.encode("hello")) == ["hello"]  # he + ll → hell + o → hello, through the scores
    better_ab = [(p, 5.0 if p == "ab" else s, t) for p, s, t in VOCAB]
    tok2 = _tok(tmp_path, "ab.gguf", vocab=better_ab, prefix=False, add_bos=False)
    assert _pieces(tok2, tok2.encode("abc")) == ["ab", "c"]


def test_byte_fallback_and_decode(tmp_path: Path) -> None:
    tok = _tok(tmp_path, prefix=False, add_bos=False)
    ids = tok.encode("aé日€")  # é and € are no tokens: their UTF-8 bytes; 日 is one
    assert _pieces(tok, ids) == ["a", "<0xC3>", "<0xA9>", "日", "<0xE2>", "<0x82>", "<0xAC>"]
    assert tok.decode(ids) == "aé日€"
    assert b"".join(tok.token_bytes(i) for i in ids) == "aé日€".encode()
    assert tok.token_bytes(ID["<0xC3>"]) == b"\xc3"
    assert tok.decode([ID["<0xC3>"]]) == "\ufffd"  # an incomplete character (the incremental detokenizer waits)


def test_dummy_prefix_on_and_off(tmp_path: Path) -> None:
    on, off = _tok(tmp_path, "on.gguf", prefix=True), _tok(tmp_path, "off.gguf", prefix=False)
    assert _pieces(on, on.encode("hello")) == ["<s>", "▁hello"]
    assert _pieces(off, off.encode("hello")) == ["<s>", "hello"]
    assert _pieces(on, on.encode(" hello")) == ["<s>", "▁", "▁hello"]  # spaces are U+2581 before merging
    for tok in (on, off):
        for text in ("hello", " hello", "  a b  ", "a\nb", ""):
            assert tok.decode(tok.encode(text)) == text, text
    assert on.token_bytes(ID["▁hello"]) == b" hello"  # logprobs bytes keep the space decode strips
    # the key absent: llama.cpp's default for a "llama" vocabulary is a prefix and a BOS
    absent = _tok(tmp_path, "absent.gguf", prefix=None, add_bos=None)
    assert _pieces(absent, absent.encode("hello")) == ["<s>", "▁hello"]


def test_special_tokens_cut_out_whole(tmp_path: Path) -> None:
    tok = _tok(tmp_path, prefix=True)
    # A fragment after a special token gets the dummy prefix again, as in llama.cpp.
    assert _pieces(tok, tok.encode("a<|ctl|>hello</s>")) == ["<s>", "▁a", "<|ctl|>", "▁hello", "</s>"]
    assert _pieces(tok, tok.encode("<|ctl|>")) == ["<s>", "<|ctl|>"]
    # Longest special text first over the whole text, not leftmost first: "xyz" (3) before "wx" (2).
    assert _pieces(tok, tok.encode("wxyz", add_special_tokens=False)) == ["▁", "w", "xyz"]
    assert tok.decode(tok.encode("a<|ctl|>b")) == "a b"  # that prefix shows, as in llama.cpp and transformers
    assert tok.decode(tok.encode("a<|ctl|>b"), skip_special_tokens=False) == "<s> a<|ctl|> b"
    assert tok.decode(tok.encode("a xyz b")) == "a xyz  b"  # user-defined tokens are text (and prefix the next)


def test_llama_cpp_overrides(tmp_path: Path) -> None:
    # an end-of-turn text is a control token whatever the file says, and ends generation
    vocab = VOCAB + [("<end_of_turn>", 0.0, NORMAL)]
    tok = _tok(tmp_path, "eot.gguf", vocab=vocab)
    assert _pieces(tok, tok.encode("a<end_of_turn>")) == ["<s>", "▁a", "<end_of_turn>"]
    assert tok.eos_token_ids == (2, len(VOCAB)) and tok.decode(tok.encode("a<end_of_turn>")) == "a"
    # a model named Phi-3: the whitespace after a special token is dropped
    plain = _tok(tmp_path, "plain.gguf")
    assert _pieces(plain, plain.encode("<|ctl|>  hello")) == ["<s>", "<|ctl|>", "▁▁", "▁hello"]
    phi = _tok(tmp_path, "phi.gguf", name="Phi-3 tiny")
    assert _pieces(phi, phi.encode("<|ctl|>  hello")) == ["<s>", "<|ctl|>", "▁hello"]


def test_bos_eos_flags(tmp_path: Path) -> None:
    tok = _tok(tmp_path, add_bos=False, add_eos=True)
    assert tok.encode("a") == [ID["▁a"], 2] and not tok.add_bos
    assert tok.encode("a", add_special_tokens=False) == [ID["▁a"]]
    assert tok.encode("") == [2]
    assert _tok(tmp_path, "b.gguf").encode("") == [1]
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1


def test_backend_has_the_vocabulary(tmp_path: Path) -> None:
    tok = _tok(tmp_path)
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    assert len(vocab) == len(VOCAB) and all(vocab[p] == i for p, i in ID.items())
    for text in ("hello é", " hello", "a<|ctl|>hello", "abc aaa"):
        assert tok.backend.encode(text).ids == tok.encode(text), text
        assert tok.backend.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    # ... but not everywhere: it matches special tokens leftmost first (wx yz), llama.cpp longest first (w xyz)
    assert tok.backend.encode("wxyz").ids != tok.encode("wxyz")


def _naive_merge(model: SpmModel, text: str) -> list[int]:
    """The definition, quadratic: merge the best-scoring adjacent pair (leftmost on ties) until none is a token."""
    syms = list(text)
    while True:
        cands = [(model.scores[model.ids[a + b]], -i) for i, (a, b) in enumerate(zip(syms, syms[1:]))
                 if a + b in model.ids]
        if not cands:
            break
        i = -max(cands)[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    return [t for s in syms for t in ([model.ids[s]] if s in model.ids
                                      else [model.ids[f"<0x{b:02X}>"] for b in s.encode()])]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abchelowxyz ▁日é", max_size=24))
def test_merge_equals_its_definition(text: str) -> None:
    model = SpmModel([p for p, _, _ in VOCAB], [s for _, s, _ in VOCAB], [t for _, _, t in VOCAB],
                     add_space_prefix=False, bos_id=1, eos_id=2, unk_id=0, add_bos=False, add_eos=False)
    text = text.replace(" ", "▁")
    assert model.merge(text) == _naive_merge(model, text)


# ---- byte-level BPE: llama.cpp's split per pre name, and the refusals ------------------------------
def test_byte_level_splits_per_pre_name(tmp_path: Path) -> None:
    from specserve.tokenizer.tokenizer import _bytes_to_unicode

    vocab = [(t, 0.0, NORMAL) for t in [*sorted(_bytes_to_unicode().values()), "Ġt"]]
    want = {  # llama.cpp's regex lists for each (llm_tokenizer_bpe)
        None: ["x", "Ġ", "Ġ", "123", "4", "Ġ", "Â½", "!?"],  # no key: "default", punctuation runs and 3 digits
        "gpt-2": ["x", "Ġ", "Ġ1234", "ĠÂ½", "!?"],
        "smollm": ["x", "ĠĠ", "1", "2", "3", "4", "Ġ", "Â½", "!?"],  # every \p{N} alone first
        "llama-bpe": ["x", "Ġ", "Ġ", "123", "4", "Ġ", "Â½", "!?"],
        "qwen2": ["x", "Ġ", "Ġ", "1", "2", "3", "4", "Ġ", "Â½", "!?"],
    }
    for pre, pieces in want.items():
        path = _write(tmp_path / f"{pre}.gguf", vocab, model="gpt2", pre=pre, merges=["Ġ t"], prefix=None,
                      add_bos=None)
        tok = Tokenizer.from_gguf(GGUFFile(path))
        assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x  1234 ½!?")] == pieces, pre


def test_unknown_tokenizer_model_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unsupported GGUF tokenizer model 'bert'.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf(GGUFFile(_write(tmp_path / "bert.gguf", model="bert")))


def test_unknown_pre_tokenizer_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "pre.gguf", model="gpt2", pre="tekken-ish", merges=["a b"])
    with pytest.raises(ValueError, match=r"unsupported GGUF pre-tokenizer 'tekken-ish'.*default.*qwen2.*smollm"):
        Tokenizer.from_gguf(GGUFFile(path))


# ---- parity with llama.cpp on Gemma 3 ------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    if not GEMMA.is_file():
        pytest.skip(f"no {GEMMA}: python scripts/fetch_gemma.py")
    return Tokenizer.from_gguf(GGUFFile(str(GEMMA)))


def test_gemma_matches_llama_cpp(gemma: Tokenizer) -> None:
    # NOTE: split("\n"), not splitlines(): the texts hold U+2028 and U+2029, which JSON leaves unescaped
    rows = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").split("\n")[1:] if line]
    texts, golden = [r["text"] for r in rows], [r["ids"] for r in rows]
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    if llama_cpp is None:  # the ids llama.cpp gave (scripts/golden_tokens.py)
        want = golden
    else:
        ref = llama_cpp.Llama(model_path=str(GEMMA), vocab_only=True, verbose=False)
        want = [ref.tokenize(t.encode(), add_bos=True, special=True) for t in texts]
        assert want == golden, "the fixture is stale: python scripts/golden_tokens.py"
    bad = [t for t, ids in zip(texts, want) if gemma.encode(t) != ids]
    assert not bad, f"{len(bad)} of {len(want)} lines differ from llama.cpp, e.g. {bad[:3]!r}"
    for t in (t for t in texts if "▁" not in t):  # a U+2581 in the text decodes as the space it stands for
        ids = gemma.encode(t)
        assert gemma.decode(ids, skip_special_tokens=False).removeprefix("<bos>") == t
        assert b"".join(gemma.token_bytes(i) for i in ids[1:]) == t.encode()
