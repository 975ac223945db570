"""The docs state the present and point only at what exists.

- Every performance figure in README.md (a number followed by tok/s, × or x, or %) appears, with its unit, in
  docs/benchmarks.md, where each current table names its command and result file.
- No file in the repository carries the words of a work diary (a numbered stop, or the words for a working period
  in BANNED) in docs, comments, test names, result file names or their fields.
- No file points at design notes that are not in the repository, or at a Markdown file outside it, and every
  docs/*.md named exists.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM = r"\d+(?:[.,]\d+)*"
UNIT = r"(tok/s|×|x(?![A-Za-z0-9_])|%)"
SKIP_DIRS = {".git", ".venv", "venv", "build", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}


def repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (a plain walk where git is unavailable)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                             capture_output=True).stdout.decode()
        return [ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts)]


def text_files() -> list[tuple[Path, str]]:
    out = []
    for p in repo_files():
        if p.stat().st_size > 5_000_000:
            continue
        try:
            out.append((p, p.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue  # weights, tables, images
    return out


def _unit(u: str) -> str:
    return "×" if u in ("x", "×") else u


def figures(text: str) -> set[tuple[str, str]]:
    """(number, unit) for every performance figure in prose: '160.1 tok/s', '1.92×', '9.6x', both ends of
    '1.27–1.36×', '30%'. Fenced code is left out (flags and sizes, not results)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    found = set()
    for m in re.finditer(rf"(?<![\w.])({NUM})\s?(?:[–-]|to)\s?({NUM})\s?{UNIT}", text):
        found |= {(m.group(1), _unit(m.group(3))), (m.group(2), _unit(m.group(3)))}
    for m in re.finditer(rf"(?<![\w.])({NUM})\s?{UNIT}", text):
        found.add((m.group(1), _unit(m.group(2))))
    return found


def stated(number: str, unit: str, text: str) -> bool:
    units = r"(?:×|x(?![A-Za-z0-9_]))" if unit == "×" else re.escape(unit)
    pattern = rf"(?<![\w.]){re.escape(number)}(?![\d])(?:\s?(?:[–-]|to)\s?{NUM})?\s?{units}"
    return re.search(pattern, text) is not None


def test_figures_parser() -> None:
    text = "plain 160.1 tok/s, **1.92×** llama.cpp, 9.6x HF, AUTO 1.27–1.36× plain, +30% and `--n 4x`"
    assert figures(text) == {("160.1", "tok/s"), ("1.92", "×"), ("9.6", "×"), ("1.27", "×"), ("1.36", "×"),
                             ("30", "%"), ("4", "×")}
    assert stated("1.27", "×", "| AUTO | 1.27–1.36× |") and stated("1.36", "×", "1.27–1.36×")
    assert not stated("1.2", "×", "1.27×") and not stated("60.1", "tok/s", "160.1 tok/s")
    assert not stated("2.5", "×", "2.5 ms") and stated("2.5", "×", "2.5x plain")


def test_readme_figures_are_in_benchmarks() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    bench = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    figs = figures(readme)
    assert figs, "README.md states no performance figure: the parser is broken"
    missing = sorted(f"{n} {u}" for n, u in figs if not stated(n, u, bench))
    assert not missing, f"README.md figures not in docs/benchmarks.md: {missing}"


BANNED = [
    re.compile(r"\bstop[ _-]?\d+\b", re.I),  # numbered stops of a work log ("stop" + a number)
    re.compile(r"\b" + "sit" + r"tings?\b", re.I),
    re.compile(r"\b" + "ses" + r"sions?\b", re.I),
]
#: library identifiers that contain the word and cannot be renamed (pytest's fixture scope)
ALLOWED = re.compile(r"""scope=["']""" + "ses" + r"""sion["']""")


def test_no_work_log_words() -> None:
    hits = []
    for p, text in text_files():
        rel = str(p.relative_to(ROOT))
        for pat in BANNED:
            if pat.search(rel):
                hits.append(f"{rel} (file name)")
            for i, line in enumerate(text.splitlines(), 1):
                if pat.search(ALLOWED.sub("", line)):
                    hits.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not hits, "work-log words in the repository:\n" + "\n".join(hits)


MISSING_NOTES = re.compile(r"\b(?:" + "|".join(["ALGO" + "RITHMS", "MO" + "DELS", "DE" + "SIGN"]) + r")\.md\b")
MD_PATH = re.compile(r"(?<![\w./:{}-])((?:~|\.{1,2})?/?[\w./-]*\.md)\b")


def test_no_references_outside_the_repository() -> None:
    bad = []
    for p, text in text_files():
        rel = p.relative_to(ROOT)
        for i, line in enumerate(text.splitlines(), 1):
            if MISSING_NOTES.search(line):
                bad.append(f"{rel}:{i}: names notes that are not in the repository")
            for m in MD_PATH.finditer(line):
                ref = m.group(1)
                if ref.startswith(("/", "~")):
                    bad.append(f"{rel}:{i}: {ref} is outside the repository")
                elif ref.startswith("../") and not (p.parent / ref).resolve().is_relative_to(ROOT):
                    bad.append(f"{rel}:{i}: {ref} is outside the repository")
                elif ref.startswith("docs/") and not (ROOT / ref).is_file():
                    bad.append(f"{rel}:{i}: {ref} does not exist")
    assert not bad, "\n".join(bad)


def test_every_engine_option_is_in_the_usage_table() -> None:
    """docs/usage.md's option table names every field of the one config tree (a flag missing there is one a
    user cannot find)."""
    import dataclasses

    from specserve.config import EngineConfig

    doc = (ROOT / "docs" / "usage.md").read_text()
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f"| `--{f.name.replace('_', '-')}`" not in doc]
    assert not missing, f"docs/usage.md lacks rows for {missing}"
