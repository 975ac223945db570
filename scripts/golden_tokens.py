"""Regenerate tests/tokenizer/gemma3_golden.jsonl: llama.cpp's token ids for ~300 varied lines of text on Gemma 3
(scripts/fetch_gemma.py), the reference tests/tokenizer/test_spm.py holds our SentencePiece tokenizer to where
llama-cpp-python is not installed (`scripts/setup.sh test llamacpp` builds it).

    python scripts/golden_tokens.py [--model ~/.cache/specserve/models/gemma-3-270m-q4_k_m.gguf] [--out PATH]

The lines are written here (a deterministic mix of hand-written pieces: prose in several scripts, code,
emoji, whitespace runs, Gemma's special and user-defined tokens), not taken from any prompt set.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "tokenizer" / "gemma3_golden.jsonl"
MODEL = Path.home() / ".cache" / "specserve" / "models" / "gemma-3-270m-q4_k_m.gguf"

PROSE = [
    "The lighthouse keeper counted the ships twice before he wrote the number down.",
    "Our train left at 7:45, forty minutes late; nobody on the platform seemed surprised.",
    "She said it's fine, they'll manage, and we'd better not worry about it.",
    "A well-tuned cache makes the second request 30x faster than the first one.",
    "Prices rose 3.5% in March (up from 2.9%), the third increase in a row.",
    "Les élèves ont répondu à la question sans hésiter, même les plus timides.",
    "Der Straßenbahnfahrer grüßte jeden Fahrgast mit einem freundlichen Nicken.",
    "El niño pidió una piña y un café con leche, por favor.",
    "Она открыла окно, и в комнату ворвался холодный осенний ветер.",
    "Η θάλασσα ήταν ήρεμη και ο ουρανός καθαρός όλη την ημέρα.",
    "今日は朝から雨が降っていたので、図書館で一日中本を読んでいました。",
    "我们在山顶上看到了日出，景色非常壮观，大家都拍了很多照片。",
    "도서관은 오전 아홉 시에 문을 열고 저녁 여섯 시에 닫습니다.",
    "مرحباً بكم في المدينة القديمة، حيث تلتقي الأسواق بالحدائق.",
    "שלום לכולם, הפגישה הבאה תתקיים ביום שלישי בבוקר.",
    "नमस्ते, आज मौसम बहुत सुहावना है और बच्चे बाहर खेल रहे हैं।",
    "วันนี้อากาศดีมาก เราจึงไปเดินเล่นที่สวนสาธารณะ",
    "Tiếng Việt có nhiều dấu thanh: à, á, ả, ã, ạ và những chữ như ơ, ư, đ.",
    "Türkçe'de ı, ğ, ş ve ç harfleri sık kullanılır.",
    "Kiswahili ni lugha inayozungumzwa na mamilioni ya watu Afrika Mashariki.",
    "Ísland er eyja í Norður-Atlantshafi; þar búa um fjögur hundruð þúsund manns.",
    "Hawaiʻi's ʻōlelo uses the ʻokina and the kahakō.",
]
CODE = [
    "def area(r: float) -> float:\n    return 3.14159 * r ** 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "const total = items.reduce((acc, x) => acc + x.price, 0);",
    "SELECT name, COUNT(*) AS n FROM orders WHERE status = 'open' GROUP BY name HAVING n > 3;",
    "if [ -z \"$HOME\" ]; then echo 'no home' >&2; exit 1; fi",
    "fn main() { let v: Vec<u32> = (1..=10).map(|x| x * x).collect(); println!(\"{:?}\", v); }",
    "<div class=\"card\"><p>Hello <b>world</b> &amp; friends</p></div>",
    "{\"id\": 17, \"tags\": [\"a\", \"b\"], \"ok\": true, \"score\": -0.25, \"note\": null}",
    "x = [i for i in range(10) if i % 3 == 0]  # multiples of three",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "git commit -m \"fix: handle empty input\" && git push origin HEAD:refs/heads/main",
    "matrix = [[1, 0, 0],\n          [0, 1, 0],\n          [0, 0, 1]]",
    "    indented with four spaces\n\tand a tab\n  \t mixed\n",
    "| col a | col b |\n|---|---:|\n| 1 | 2.50 |\n",
    "**bold**, _italic_, `code`, [link](https://example.org/path?q=1&r=2#frag)",
    "E = mc² ; ∑ᵢ xᵢ² ≤ ∞ ; ∀x ∈ ℝ, x² ≥ 0 ; ½ + ¼ = ¾",
    "0xDEADBEEF 0b1011 1e-9 6.022e23 -17 +3 1,000,000 3.14159265358979",
]
EMOJI = ["😀", "🚀", "👩‍👩‍👧‍👦", "🇯🇵", "🇫🇷", "👍🏽", "❤️", "🧑‍💻", "🫠", "☕", "🐍", "✨", "🏳️‍🌈", "1️⃣", "©", "™"]
SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<mask>", "<unk>", "<unused0>",
            "<unused42>", "[multimodal]", "<start_of_image>", "<end_of_image>", "<table>", "</table>", "<b>", "</b>",
            "<s>", "</s>", "<code>", "</code>", "<h1>", "<li>"]
NEAR_SPECIALS = ["<start_of_turn", "end_of_turn>", "<start_of_turn >", "< bos>", "<unused>", "<0x41>", "<0xZZ>",
                 "<<start_of_turn>>", "<start_of_turn><end_of_turn>", "▁", "▁▁hello", "<b><i>x</i></b>"]
EDGES = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "a", " a", "a ", "  a  ", "a  b", "a\tb",
    "a\n\n\n\nb", "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\nend",
    " " * 40 + "x", "\t" * 35 + "y", "word\u00a0word", "non\u2009breaking\u202fthin", "ideographic\u3000space",
    "zero\u200bwidth\u200djoiner\u2060", "cafe\u0301 vs café", "n\u0303o\u0308 Z\u0351\u0364\u0351a\u0489l",
    "\ufeffbyte order mark", "soft\u00adhyphen", "tab\tthen  two  spaces   three", "trailing spaces   ",
    "\u2028line separator\u2029paragraph", "control \x01\x02\x7f chars", "emoji at end 🎉",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>model\nSure! Here is the list:\n\n1. one\n2. two\n<end_of_turn>",
    "<bos><bos>double bos", "text<eos>", " <start_of_turn> spaced <end_of_turn> ",
    "\U0001f600\U0001f600\U0001f600", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙", "Ａｂｃ１２３ fullwidth", "ｶﾀｶﾅ halfwidth",
    "𠀋𡈽𡌛 rare CJK", "\ue000\uf8ff private use", "a" * 60, "ab" * 30, "🙂" * 12,
]
# Code point ranges for random "soup" lines: ASCII, Latin-1/Extended, Greek, Cyrillic, Arabic, Devanagari, Thai,
# combining marks, CJK, Hangul, emoji, symbols, whitespace.
RANGES = [(0x20, 0x7e), (0xa0, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff), (0x600, 0x6ff), (0x900, 0x97f),
          (0xe00, 0xe7f), (0x300, 0x36f), (0x4e00, 0x9fff), (0xac00, 0xd7a3), (0x1f300, 0x1f6ff), (0x2000, 0x206f),
          (0x2190, 0x22ff)]


def texts(n_random: int = 170, seed: int = 0) -> list[str]:
    """The fixture's lines: every hand-written piece once, then seeded random mixtures of them."""
    rng = random.Random(seed)
    out = PROSE + CODE + EDGES + NEAR_SPECIALS + [f"{s}{p}" for s, p in zip(SPECIALS, PROSE + CODE)]
    pools = [PROSE, CODE, EMOJI, SPECIALS, NEAR_SPECIALS, EDGES]
    seps = ["", " ", "  ", "\n", "\n\n", "\t", " \n", "   \n\t"]
    for _ in range(n_random // 2):  # mixtures of the pieces above
        parts = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(2, 5))]
        out.append("".join(p + rng.choice(seps) for p in parts))
    for _ in range(n_random - n_random // 2):  # character soup
        lo, hi = rng.choice(RANGES)
        n = rng.randint(1, 30)
        out.append("".join(chr(rng.randint(lo, hi)) if rng.random() < 0.8 else rng.choice(" \n\t") for _ in range(n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    import llama_cpp

    ref = llama_cpp.Llama(model_path=a.model, vocab_only=True, verbose=False)
    lines = texts()
    ids = [ref.tokenize(t.encode(), add_bos=True, special=True) for t in lines]
    meta = {"model": Path(a.model).name, "llama_cpp_python": llama_cpp.__version__,
            "call": "Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=True, special=True)"}
    rows = [meta] + [{"text": t, "ids": i} for t, i in zip(lines, ids)]  # a line per text: readable diffs
    Path(a.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{a.out}: {len(lines)} lines, {sum(map(len, ids))} tokens")


if __name__ == "__main__":
    main()
