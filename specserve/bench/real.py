"""`specserve bench real`: a real GGUF as a user meets it, against llama.cpp on the same file.

Each configuration runs in its own process (so load time and peak RSS are its own): load, decode the
prompts at batch 1 (greedy, ignore_eos, the same token ids for every engine), then prefill one long prompt.
The llama.cpp peers: `llama.cpp` (llama-cpp-python in process) and llama-server over HTTP (`llama-server`,
`llama-server+draft`, `llama-server+ngram`: bench/launch.py; load = seconds until its /health answers).
Reported per configuration: load seconds, peak RSS, decode tok/s and its ratio to the baseline (llama-server
plain where it ran, else llama.cpp), weight bytes streamed per decoded token and the GB/s that implies (plain
decoding is memory-bound: compare with the machine's streaming bandwidth, measured here too), prefill tok/s,
acceptance length (llama-server: the share of drafted tokens accepted) and whether the text equals plain
decoding's on the same engine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

# NOTE: stdlib imports only at module level: a configuration's process runs this file as a script, so the
# llama.cpp baseline's peak RSS holds neither torch nor specserve.


def add_args(p: argparse.ArgumentParser) -> None:
    from .common import add_prompt_args

    add_prompt_args(p, default="mtbench")
    p.add_argument("--configs", nargs="+", default=["llama.cpp", "plain", "AUTO"],
                   help="llama.cpp, llama-server, llama-server+draft, llama-server+ngram, plain, or "
                        "ALGO[+WINDOW][:flag=value...] (AUTO, STANDALONE+fixed, AUTO:speculative-num-draft-tokens=6...); "
                        "engine flags given here (e.g. --speculative-draft-model-path) apply to every specserve config "
                        "(the draft model path to llama-server+draft too)")
    p.add_argument("--prefill-tokens", type=int, default=2000, help="length of the prefill probe (0: skip)")
    p.add_argument("--synthetic-acceptance", type=float, default=None, metavar="RATE",
                   help="speculative configs: each drafted token is plain decoding's token with probability RATE, "
                        "else another (the drafter still runs: its cost is real, its tokens are not). For a pair "
                        "whose real acceptance says nothing (a random-weight target). Runs plain first")


class _Peer:
    """One configuration's engine as `_child` drives it: load seconds, greedy generation of token ids, the
    weight bytes a decoded token streams, and its speculative counters (zeroed after the warm-up)."""

    def __init__(self, load: float, gen: Callable[[list[int], int], list[int]], weight_bytes: int,
                 meta: dict[str, Any] | None = None, counters: dict[str, int] | None = None) -> None:
        self.load, self.gen, self.weight_bytes = load, gen, weight_bytes
        self.meta, self.counters = meta or {}, counters if counters is not None else {}

    def peak_rss_gib(self) -> float:
        # NOTE: VmHWM, not ru_maxrss: the latter survives exec, so it would report the parent's peak (its 1 GiB
        # bandwidth probe) for any configuration smaller than that
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20

    def close(self) -> None:
        pass


def _llama_cpp(cfg: dict[str, Any]) -> _Peer:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=cfg["path"], n_ctx=4096, n_threads=cfg["threads"], verbose=False)

    def gen(ids: list[int], n: int) -> list[int]:  # reuses the longest prefix it holds, as specserve does
        out = []
        for tok in llm.generate(ids, temp=0.0, reset=True):
            out.append(int(tok))
            if len(out) >= n:
                break
        return out
    return _Peer(time.perf_counter() - t0, gen, cfg["file_weight_bytes"])


class _LlamaServer(_Peer):
    """llama-server over HTTP: its /completion with token ids, its own peak RSS."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from specserve.bench.launch import free_port, launch, llama_server_argv

        port = free_port()
        self.server = launch(llama_server_argv(cfg["name"], cfg["path"], port, cfg["threads"], cfg["draft"]), port)
        super().__init__(self.server.ready_s, self._gen, cfg["file_weight_bytes"],
                         counters={"draft_n": 0, "draft_n_accepted": 0})

    def _gen(self, ids: list[int], n: int) -> list[int]:
        r = self.server.post("/completion", {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True,
                                             "cache_prompt": True, "return_tokens": True})
        for k in self.counters:
            self.counters[k] += r.get("timings", {}).get(k, 0)
        return [int(t) for t in r["tokens"]]

    def peak_rss_gib(self) -> float:
        return self.server.peak_rss_gib()

    def close(self) -> None:
        self.server.stop()


def _specserve(cfg: dict[str, Any]) -> _Peer:
    from specserve.core import SamplingParams
    from specserve.engine.llm import LLM
    from specserve.flags import config_from_args

    t0 = time.perf_counter()
    llm = LLM.from_config(config_from_args(argparse.Namespace(**cfg["args"]), cfg["path"]))
    load = time.perf_counter() - t0
    if cfg.get("reference") and llm.engine.drafter is not None:
        stated_acceptance(llm.engine, {tuple(p): o for p, o in zip(cfg["prompts"], cfg["reference"])},
                          cfg["synthetic_acceptance"])
    meta = {"drafter": llm.engine.drafter.label if llm.engine.drafter else None,
            "window": llm.config.speculative_window, "quantization": llm.engine.config.quantization}
    counters = {"verify": 0, "accepted": 0}

    def gen(ids: list[int], n: int) -> list[int]:
        o = llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        counters["verify"] += o.meta_info.get("spec_verify_ct", 0)
        counters["accepted"] += o.meta_info.get("spec_accepted_tokens", 0)
        return list(o.token_ids)
    return _Peer(load, gen, streamed_weight_bytes(llm.engine.model), meta, counters)


def _child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in this (fresh) process."""
    name = cfg["name"]
    peer = _llama_cpp(cfg) if name == "llama.cpp" else _LlamaServer(cfg) if name.startswith("llama-server") \
        else _specserve(cfg)
    try:
        peer.gen(cfg["warmup"], 8)  # shares no prefix with the prompts: every engine prefills each prompt cold
        c = peer.counters
        c.update({k: 0 for k in c})
        outs, t = [], time.perf_counter()
        for ids in cfg["prompts"]:
            outs.append(peer.gen(ids, cfg["new_tokens"]))
        decode_s = time.perf_counter() - t
        n_tok = sum(len(o) for o in outs)
        res = {"load_s": peer.load, "decode_tok_s": n_tok / decode_s, "tokens": n_tok, "outputs": outs,
               "weight_bytes_per_token": peer.weight_bytes, **peer.meta}
        if c.get("verify"):
            res["accept_length"] = (c["accepted"] + c["verify"]) / c["verify"]
        if c.get("draft_n"):  # llama-server counts drafted and accepted tokens, not verify steps
            res["draft_acceptance"] = c["draft_n_accepted"] / c["draft_n"]
        if cfg["prefill"]:
            t = time.perf_counter()
            peer.gen(cfg["prefill"], 1)
            res["prefill_tok_s"] = len(cfg["prefill"]) / (time.perf_counter() - t)
        res["peak_rss_gib"] = peer.peak_rss_gib()
        return res
    finally:
        peer.close()


def stated_acceptance(engine: Any, reference: dict[tuple[int, ...], list[int]], rate: float, seed: int = 0) -> None:
    """--synthetic-acceptance: after the drafter proposes (its forwards run as always), each chain token becomes
    the reference's (plain decoding's) token at that position with probability `rate`, else a token that is
    not. At T = 0 a draft is accepted up to its first such miss, so acceptance is stated, not learned; the
    text stays plain decoding's, as verification guarantees. Trees keep their own tokens."""
    import random

    rng, stage, vocab = random.Random(seed), engine.draft_stage, engine.model.cfg.vocab_size
    propose = stage.run

    def run(reqs: list) -> Any:
        d = propose(reqs)
        if d.proposal.parents is not None:
            return d
        for r, toks in zip(d.reqs, d.proposal.tokens):
            ref, at = reference.get(tuple(r.prompt_ids), []), len(r.output_ids)
            for i in range(min(len(toks), len(ref) - at)):
                want = ref[at + i]
                toks[i] = want if rng.random() < rate else (want + 1) % vocab
        return d

    stage.run = run


def streamed_weight_bytes(model: Any) -> int:
    """Bytes of every matrix a decode step multiplies (the embedding is gathered, not streamed); an MoE layer's:
    its top-k experts' (what one token reads) and its shared expert's."""
    import torch

    total = 0
    for layer in model.layers:
        for a in ("qkv_w", "o_w", "gate_up_w", "down_w"):
            w = getattr(layer, a)
            total += 0 if w is None else _nbytes(w)
        if hasattr(layer, "expert_nbytes"):
            total += layer.top_k * layer.expert_nbytes(0)
    head = model.lm_head
    return total + (_nbytes(head) if not isinstance(head, torch.Tensor) or head is not model.embed else head.nbytes)


def _nbytes(w: Any) -> int:
    import torch

    if isinstance(w, torch.Tensor):
        return w.nbytes
    return sum(t.nbytes for t in vars(w).values() if isinstance(t, torch.Tensor))


def file_weight_bytes(path: str) -> int:
    """A GGUF's matrices a decode step reads: all but the embedding, unless it is also the (tied) head; of an
    MoE's stacked experts (`*_exps`), the `expert_used_count` of `expert_count` one token reads."""
    from ..formats.gguf_file import GGUFFile

    f = GGUFFile(path)
    arch = f.fields["general.architecture"].contents()
    used, count = (f.fields.get(f"{arch}.{k}") for k in ("expert_used_count", "expert_count"))
    share = used.contents() / count.contents() if used is not None and count is not None else 1.0
    tied = not any(t.name == "output.weight" for t in f.tensors)
    return round(sum(t.n_bytes * (share if t.name.endswith("_exps.weight") else 1.0)
                     for t in f.tensors if tied or t.name != "token_embd.weight"))


def run(a: argparse.Namespace) -> dict:
    import torch

    from ..formats.gguf_file import GGUFFile
    from ..loading.checkpoint import resolve_model_path
    from ..tokenizer.tokenizer import Tokenizer
    from .common import config_args, record, workloads
    from .launch import is_llama_server
    from .machine import stream_bandwidth_gbs

    path = str(resolve_model_path(a.model or "smollm2-135m"))
    tok = Tokenizer.from_gguf(GGUFFile(path))
    # a base model without a chat template (Gemma-3-270M) reads the prompt text itself, after its BOS
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) if tok.chat_template
               else tok.encode("\n\n".join(m["content"] for m in c)) for convs in workloads(a).values() for c in convs]
    filler = tok.encode("The quick brown fox jumps over the lazy dog. " * 400, add_special_tokens=False)
    threads = a.num_threads or torch.get_num_threads()
    bw = stream_bandwidth_gbs()
    results: dict[str, Any] = {"stream_bandwidth_gbs": bw}
    configs = list(a.configs)
    if a.synthetic_acceptance is not None:  # plain first: its tokens are the drafts' reference
        configs = ["plain", *[c for c in configs if c != "plain"]]
        results["synthetic_acceptance"] = a.synthetic_acceptance
    for name in configs:
        peer = name == "llama.cpp" or is_llama_server(name)
        args = {} if peer else vars(config_args(a, name, "--configs")[0])
        cfg = {"name": name, "path": path, "args": {k: v for k, v in args.items() if not callable(v)},
               "threads": threads, "prompts": prompts, "warmup": tok.encode("Say hello.", add_special_tokens=False),
               "new_tokens": a.max_new_tokens, "prefill": filler[: a.prefill_tokens] if a.prefill_tokens else [],
               "file_weight_bytes": file_weight_bytes(path), "draft": a.speculative_draft_model_path}
        if a.synthetic_acceptance is not None and name != "plain" and not peer:
            if "outputs" not in results["plain"]:
                raise SystemExit("--synthetic-acceptance: plain decoding failed, so the drafts have no reference")
            cfg.update(reference=results["plain"]["outputs"], synthetic_acceptance=a.synthetic_acceptance)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        p = subprocess.run([sys.executable, str(Path(__file__).resolve())], input=json.dumps(cfg), text=True,
                           capture_output=True, env=env)
        if p.returncode != 0:
            print(f"{name}: failed\n{p.stderr[-3000:]}")
            results[name] = {"error": p.stderr[-3000:]}
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["gb_s"] = r["weight_bytes_per_token"] * r["decode_tok_s"] / 1e9
        results[name] = r
    _summarize(results, configs)
    path_out = record("real", a, results)
    print(f"wrote {path_out}")
    return results


def _summarize(results: dict[str, Any], names: list[str]) -> None:
    """The table; each config's speed as a ratio to the baseline (llama-server plain where it ran, else
    llama.cpp) and its text against plain decoding on the same engine (specserve's `plain`, `llama-server`)."""
    ok = [n for n in names if "error" not in results[n]]
    base_name = next((n for n in ("llama-server", "llama.cpp") if n in ok), None)
    base = results[base_name]["decode_tok_s"] if base_name else None
    print(f"machine streaming bandwidth: {results['stream_bandwidth_gbs']:.1f} GB/s; baseline: {base_name}")
    w = max([12, *(len(n) + 2 for n in ok)])
    print(f"{'config':<{w}}{'load s':>8}{'peak GiB':>10}{'tok/s':>8}{'vs base':>9}{'GB/s':>7}{'prefill':>9}"
          f"{'tau':>6}{'drafts':>8}  text")
    for n in ok:
        r = results[n]
        r["vs_baseline"] = r["decode_tok_s"] / base if base else None
        ref = "llama-server" if n.startswith("llama-server") else None if n == "llama.cpp" else "plain"
        same = results.get(ref, {}).get("outputs") if ref and ref != n else None
        r["text_equals_plain"] = None if same is None else r["outputs"] == same
        tau = f"{r['accept_length']:>6.2f}" if "accept_length" in r else f"{'':>6}"
        acc = f"{r['draft_acceptance']:>8.2f}" if "draft_acceptance" in r else f"{'':>8}"
        print(f"{n:<{w}}{r['load_s']:>8.1f}{r['peak_rss_gib']:>10.2f}{r['decode_tok_s']:>8.1f}"
              f"{(r['vs_baseline'] or 0):>9.2f}{r['gb_s']:>7.1f}{r.get('prefill_tok_s', 0):>9.1f}{tau}{acc}"
              f"  {r['text_equals_plain']}")


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.stdin.read()))))
