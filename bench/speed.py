"""Decode speed: specserve (plain and speculative) vs HF transformers.generate, one run, side by side.

    python bench/speed.py --batch-sizes 1 8 --algos plain NGRAM --hf --max-new-tokens 128

Configurations are interleaved prompt-batch by prompt-batch to cancel machine drift. Reports
tokens/s (completion tokens / wall time), ratios vs plain specserve and vs HF, and acceptance
length (bonus included) for speculative runs. Writes bench/results/speed-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import load  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--algos", nargs="+", default=["plain", "NGRAM"])
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--draft-model", default=None, help="for STANDALONE")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers.generate on the same GGUF")
    a = ap.parse_args()

    engines = {}
    for algo in a.algos:
        kw = {} if algo == "plain" else dict(speculative_algorithm=algo, speculative_num_draft_tokens=a.num_draft_tokens,
                                             speculative_draft_model_path=a.draft_model)
        engines[algo] = LLM(a.model, dtype=a.dtype, **kw)
    tok = next(iter(engines.values())).tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in load(a.workload, a.num_prompts)]
    hf = None
    if a.hf:
        import transformers

        from specserve.models.loader import resolve_model_path

        path = resolve_model_path(a.model)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=DTYPES[a.dtype]).eval()
    sp = SamplingParams(temperature=0, max_tokens=a.max_new_tokens, ignore_eos=True)
    results: dict = {}
    for bs in a.batch_sizes:
        batches = [prompts[i : i + bs] for i in range(0, len(prompts), bs) if len(prompts[i : i + bs]) == bs]
        tot = {k: [0, 0.0, 0, 0] for k in list(engines) + (["hf"] if hf else [])}  # tokens, secs, verify, accepted
        for batch in batches:  # interleave configurations per batch
            for name, llm in engines.items():
                t = time.perf_counter()
                outs = llm.generate(batch, sp)
                tot[name][1] += time.perf_counter() - t
                tot[name][0] += sum(len(o.token_ids) for o in outs)
                tot[name][2] += sum(o.meta_info.get("spec_verify_ct", 0) for o in outs)
                tot[name][3] += sum(o.meta_info.get("spec_accepted_tokens", 0) for o in outs)
            if hf is not None:
                t = time.perf_counter()
                tot["hf"][0] += _hf_generate(hf, batch, a.max_new_tokens)
                tot["hf"][1] += time.perf_counter() - t
        row = {}
        for name, (n, s, v, acc) in tot.items():
            row[name] = {"tok_s": n / s, "tokens": n, "seconds": s,
                         "accept_length": (1 + acc / v) if v else None}
        base = row["plain"]["tok_s"] if "plain" in row else None
        for name, r in row.items():
            r["vs_plain"] = r["tok_s"] / base if base else None
            r["vs_hf"] = r["tok_s"] / row["hf"]["tok_s"] if "hf" in row else None
        results[bs] = row
        print(f"\nbatch {bs} ({len(batches)} batches, {a.max_new_tokens} new tokens, {a.dtype}, {a.workload})")
        print(f"{'config':12s} {'tok/s':>8s} {'vs plain':>9s} {'vs HF':>7s} {'accept len':>11s}")
        for name, r in row.items():
            f = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
            print(f"{name:12s} {r['tok_s']:8.1f} {f(r['vs_plain']):>9s} {f(r['vs_hf']):>7s} {f(r['accept_length']):>11s}")
    out = Path(__file__).parent / "results" / f"speed-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "machine": platform.platform(), "cpus": torch.get_num_threads(),
                               "torch": torch.__version__, "results": results}, indent=1))
    print(f"\nwrote {out}")


def _hf_generate(hf, batch: list[list[int]], new: int) -> int:  # noqa: ANN001
    """Left-padded batch through HF generate; returns generated tokens (exactly `new` per row)."""
    L = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return (out.shape[1] - L) * len(batch)


if __name__ == "__main__":
    main()
