"""The GGUF tokenizer: encode/decode and chat-template parity with HF transformers (test-only oracle) and with
llama.cpp where llama-cpp-python is installed, and incremental detokenization."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.formats.gguf_file import GGUFFile
from specserve.loading.checkpoint import resolve_model_path
from specserve.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 2024; they'll pay $1,234.56.",
    "héllo wörld — naïve café, Ærøskøbing",
    "日本語のテキストと中文文本，还有한국어.",
    "مرحبا بالعالم",
    "emoji: 😀🚀👩‍👩‍👧 🇺🇸 and x² + y³ = ½",
    "def f(x):\n    return {'a': [1, 2, 3]}\n\n\tif x  !=  0:   pass\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces and trailing   \n\n\n",
    "a\r\nb\r\n\r\nc\t\t\td    e",
    "<|endoftext|>raw special then text<file_sep>more",
    "1234567890 3.14159 0xDEADBEEF 1e-5",
    "",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! 👋"},
        {"role": "user", "content": "Tell me a joke about café owners."},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return resolve_model_path("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(str(gguf_path)))


@pytest.fixture(scope="module")
def hf_tok(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers

    hf = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # transformers splits a "smollm" GGUF with the plain GPT-2 regex; SmolLM2's own tokenizer.json, like llama.cpp,
    # isolates every digit first ("    1" is ĠĠĠĠ 1, not ĠĠĠ Ġ1): the oracle gets that pre-tokenizer back.
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return hf


# ---- tokenizer parity ------------------------------------------------------------------------
def test_tokenizer_matches_transformers(tok, hf_tok) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tok.id_to_piece(tok.encode(" world")[0]) == "Ġworld"
    assert [tok.id_to_piece(i) for i in tok.encode("    1 ½")] == ["ĠĠĠĠ", "1", "Ġ", "Â½"]


def test_tokenizer_matches_llama_cpp(tok, gguf_path: Path) -> None:
    """llama.cpp on the same file, on these texts and the lines of the Gemma fixture (tests/tokenizer/test_spm.py)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    golden = Path(__file__).with_name("gemma3_golden.jsonl").read_text(encoding="utf-8").split("\n")[1:]
    texts = TEXTS + [json.loads(line)["text"] for line in golden if line]
    bad = [t for t in texts if tok.encode(t) != ref.tokenize(t.encode(), add_bos=True, special=True)]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ from llama.cpp, e.g. {bad[:3]!r}"


# ---- chat template ---------------------------------------------------------------------------
def test_chat_template_matches_transformers(tok, hf_tok) -> None:
    for msgs in MESSAGES:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want


def test_no_chat_template_error(tok) -> None:
    bare = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=[2], chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    raising = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=[2],
                        chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(Exception, match="roles must alternate"):
        raising.apply_chat_template([])


# ---- incremental detokenization ----------------------------------------------------------------
def test_incremental_detokenizer(tok) -> None:
    text = "Grüße 😀 世界! naïve 👩‍👩‍👧 ½ done<|im_end|>"
    ids = tok.encode(text)
    for skip in (True, False):
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = [det.feed(i) for i in ids]
        deltas.append(det.flush())
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == det.text == tok.decode(ids, skip_special_tokens=skip)
        assert sum(1 for d in deltas if d == "") > 0  # multibyte chars were held back at least once
    # context from the prompt does not leak into the output
    det = tok.incremental(prompt_ids=tok.encode("Hello"))
    out = "".join(det.feed(i) for i in tok.encode(" world"))
    assert out == " world"
