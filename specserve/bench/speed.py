"""`specserve bench speed`: tokens/s and per-token latency of plain decoding and each drafter,
on the same prompts, in one run, with HF transformers / llama.cpp baselines where installed.

Configurations are interleaved batch by batch to cancel machine drift. Greedy, ignore_eos, a fixed
number of new tokens per request, so every configuration produces the same token count. Every batch is prefilled
cold (the prefix cache is emptied before it): `bench prefix` measures the cache.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
from tqdm import tqdm

from ..flags import config_from_args
from ..core import SamplingParams
from .common import add_prompt_args, config_args, record, workloads

_DT = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def add_args(p: argparse.ArgumentParser) -> None:
    add_prompt_args(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--algos", nargs="+", default=["plain", "NGRAM"],
                   help="plain and/or drafters (NGRAM, STANDALONE, SYNTHETIC, EAGLE3, MTP, DFLASH, DSPARK), optionally "
                        "+WINDOW_POLICY and :flag=value engine overrides for that configuration alone (e.g. NGRAM+cost, "
                        "EAGLE3:speculative-eagle-topk=4:speculative-num-steps=4); other engine flags apply to all")
    p.add_argument("--hf", action="store_true", help="HF transformers.generate baselines (plain; prompt lookup; "
                   "assistant model when --speculative-draft-model-path is set)")
    p.add_argument("--llama-cpp", action="store_true", help="llama-cpp-python on the same GGUF, if installed")
    p.add_argument("--plot", default=None, help="PNG path (default next to the JSON)")
    p.add_argument("--json-schema", default=None, help="structured output: every request is held to this JSON schema "
                   "(a .json file, or 'answer': the schema of --workload json); configurations must still agree token "
                   "for token, and grammar-ended requests count the tokens they emitted")


def _engines(a: argparse.Namespace) -> dict[str, Any]:
    from ..engine.llm import LLM

    out = {}
    for spec in a.algos:
        a2, algo, window = config_args(a, spec, "--algos")
        overrides = spec.split(":")[1:]
        llm = LLM.from_config(config_from_args(a2, a.model))
        label = algo if algo == "plain" else llm.engine.drafter.label.split(" ")[0]
        if algo.upper() == "AUTO":  # what AUTO resolved to, with its window policy
            label, window = f"AUTO={label}", llm.config.speculative_window
        name = f"specserve {label}" + (f"+{window}" if window else "") + "".join(
            ":" + o.lstrip("-").removeprefix("speculative-").removeprefix("speculative_") for o in overrides)
        if name in out:
            raise ValueError(f"--algos: {spec!r} names the same configuration as an earlier entry ({name})")
        out[name] = llm
    return out


def _hf_runners(a: argparse.Namespace, dtype: torch.dtype) -> dict[str, Callable[[list[list[int]], int], None]]:
    import transformers

    from ..loading.checkpoint import resolve_model_path

    def load(name: str):  # noqa: ANN202
        path = resolve_model_path(name)
        kw = {"gguf_file": path.name} if path.is_file() else {}
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent if path.is_file() else path),
                                                                 dtype=dtype, **kw).eval()

    model = load(a.model or "smollm2-135m")
    assistant = load(a.speculative_draft_model_path) if a.speculative_draft_model_path else None

    def gen(extra: dict) -> Callable[[list[list[int]], int], None]:
        def run(batch: list[list[int]], new: int) -> None:
            L = max(map(len, batch))
            ids = torch.tensor([[0] * (L - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=0, **extra)
        return run

    out = {"hf generate": gen({})}
    out["hf prompt-lookup"] = gen({"prompt_lookup_num_tokens": 10})  # batch 1 only in HF
    if assistant is not None:
        out["hf assistant"] = gen({"assistant_model": assistant})  # batch 1 only in HF
    return out


def _llama_cpp_runner(a: argparse.Namespace) -> dict[str, Callable[[list[list[int]], int], None]]:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python not installed: skipping the llama.cpp baseline")
        return {}
    from ..loading.checkpoint import resolve_model_path

    llm = Llama(model_path=str(resolve_model_path(a.model or "smollm2-135m")), n_ctx=4096, n_threads=torch.get_num_threads(),
                verbose=False)

    def run(batch: list[list[int]], new: int) -> None:
        for p in batch:  # llama-cpp-python serves one sequence at a time
            llm.reset()
            n = 0
            for _ in llm.generate(p, temp=0.0, reset=True):
                n += 1
                if n >= new:
                    break
    return {"llama.cpp": run}


def run(a: argparse.Namespace) -> dict:
    engines = _engines(a)
    first = next(iter(engines.values()))
    tok = first.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False)
               for convs in workloads(a).values() for c in convs]
    if max(a.batch_sizes) > len(prompts):  # NOTE: a batch is never padded with repeats of other prompts
        raise SystemExit(f"--batch-sizes {max(a.batch_sizes)} needs at least that many prompts; the workloads give "
                         f"{len(prompts)} (raise --num-prompts)")
    baselines: dict[str, Callable[[list[list[int]], int], None]] = {}
    if a.hf:
        baselines.update(_hf_runners(a, _DT[first.config.dtype]))
    if a.llama_cpp:
        baselines.update(_llama_cpp_runner(a))
    sp = SamplingParams(temperature=0, max_tokens=a.max_new_tokens, ignore_eos=True, json_schema=_schema(a.json_schema))
    if sp.json_schema and baselines:
        raise SystemExit("--json-schema: the HF / llama.cpp baselines cannot be held to a schema; drop --hf/--llama-cpp")
    for llm in engines.values():  # warm-up (allocator, kernels, caches) outside the timed runs
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for fn in baselines.values():
        fn(prompts[:1], 8)
    results: dict[str, Any] = {}
    # batch size → configuration → batches whose tokens differ from the first configuration's (a speculative
    # configuration of the same mode must stay at 0: lossless; another quantization mode may differ)
    lossless: dict[str, dict[str, int]] = {}
    for bs in a.batch_sizes:
        for llm in engines.values():  # NOTE: the same prompts again: the suffix index would draft their answers
            lookups = getattr(llm.engine.drafter, "lookups", None)
            if lookups is not None and lookups.index is not None:
                lookups.index.clear()
        batches = [prompts[i : i + bs] for i in range(0, len(prompts) - bs + 1, bs)]
        tot: dict[str, list[float]] = {}
        differ: dict[str, int] = {}
        for batch in tqdm(batches, desc=f"batch {bs}", leave=False):
            ref = None
            for name, llm in engines.items():
                if llm.engine.kv.prefix_cache is not None:  # NOTE: every batch prefills cold, as llama.cpp's
                    llm.engine.kv.prefix_cache.clear()      # (reset per prompt): no hit from the warm-up or
                t = time.perf_counter()                     # an earlier batch size's run of the same prompts
                outs = llm.generate(batch, sp)
                toks = [o.token_ids for o in outs]
                if ref is not None and toks != ref:
                    differ[name] = differ.get(name, 0) + 1
                ref = toks if ref is None else ref
                _acc(tot, name, time.perf_counter() - t, sum(len(o.token_ids) for o in outs),
                     sum(o.meta_info.get("spec_verify_ct", 0) for o in outs),
                     sum(o.meta_info.get("spec_accepted_tokens", 0) for o in outs))
            for name, fn in baselines.items():
                if bs > 1 and name in ("hf prompt-lookup", "hf assistant"):
                    continue  # HF supports these at batch 1 only
                t = time.perf_counter()
                fn(batch, a.max_new_tokens)
                _acc(tot, name, time.perf_counter() - t, a.max_new_tokens * len(batch), 0, 0)
        results[str(bs)] = _summarize(tot, bs)
        lossless[str(bs)] = differ
        for name, n in differ.items():
            print(f"WARNING: {n} of {len(batches)} batches of size {bs} differ from the first configuration's tokens "
                  f"in {name}")
        _print(bs, results[str(bs)])
    path = record("speed", a, results, {"batches_differing_from_first_config": lossless})
    _plot(results, a.plot or str(path.with_suffix(".png")))
    print(f"wrote {path}")
    return results


def _schema(arg: str | None) -> str | None:
    import json
    from pathlib import Path

    from .workloads import ANSWER_SCHEMA

    if arg is None:
        return None
    return json.dumps(ANSWER_SCHEMA) if arg == "answer" else Path(arg).read_text()


def _acc(tot: dict, name: str, secs: float, tokens: int, verify: int, accepted: int) -> None:
    t = tot.setdefault(name, [0.0, 0, 0, 0])
    t[0] += secs
    t[1] += tokens
    t[2] += verify
    t[3] += accepted


def _summarize(tot: dict, bs: int) -> dict:
    row = {n: {"tok_s": t[1] / t[0], "ms_per_token": 1000 * t[0] / t[1] * bs, "tokens": t[1], "seconds": t[0],
               "accept_length": 1 + t[3] / t[2] if t[2] else None} for n, t in tot.items()}
    plain = row.get("specserve plain", {}).get("tok_s")
    hf = row.get("hf generate", {}).get("tok_s")
    for r in row.values():
        r["vs_plain"] = r["tok_s"] / plain if plain else None
        r["vs_hf"] = r["tok_s"] / hf if hf else None
    return row


def _print(bs: int, row: dict) -> None:
    f = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
    w = max(22, *map(len, row))
    print(f"\nbatch size {bs}")
    print(f"{'config':{w}s} {'tok/s':>8s} {'ms/token':>9s} {'vs plain':>9s} {'vs HF':>7s} {'τ':>6s}")
    for name, r in row.items():
        print(f"{name:{w}s} {r['tok_s']:8.1f} {r['ms_per_token']:9.1f} {f(r['vs_plain']):>9s} {f(r['vs_hf']):>7s} "
              f"{f(r['accept_length']):>6s}")


def _plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    names = sorted({n for row in results.values() for n in row})
    bss = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([j + i * w for j in range(len(bss))], [results[b].get(n, {}).get("tok_s", 0) for b in bss], w, label=n)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(bss))], [f"batch {b}" for b in bss])
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
