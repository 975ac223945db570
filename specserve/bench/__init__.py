"""`specserve bench {accept,speed,real,serving,agentic,verify,quality,gemm,step,prefix}`: acceptance tables, speed
against baselines, a real GGUF against llama.cpp (load, memory, decode, prefill), serving load, a coding agent's
recorded tool loop replayed against servers, ragged verify cost, quantized-model drift, quantized GEMM timings,
step-time breakdown, the prefix cache on multi-turn chat."""
from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from . import accept, agentic, gemm, prefix, quality, real, serving, speed, step_time, verify_cost

    b = sub.add_parser("bench", help="benchmarks: acceptance per workload, speed vs baselines")
    bs = b.add_subparsers(dest="bench_command", required=True)
    accept.add_args(bs.add_parser("accept", help="acceptance-length table per workload"))
    speed.add_args(bs.add_parser("speed", help="tokens/s of plain vs speculative vs HF/llama.cpp"))
    real.add_args(bs.add_parser("real", help="a real GGUF vs llama.cpp, one process each: load, peak RSS, decode, "
                                            "GB/s, prefill"))
    serving.add_args(bs.add_parser("serving", help="load generator against an OpenAI-compatible server"))
    agentic.add_args(bs.add_parser("agentic", help="a coding agent's tool loop: record it, replay it against servers"))
    verify_cost.add_args(bs.add_parser("verify", help="ragged verify forward: compact vs padded packing"))
    quality.add_args(bs.add_parser("quality", help="quantized modes vs fp32: top-1 agreement and perplexity"))
    gemm.add_args(bs.add_parser("gemm", help="quantized GEMM timings per token count at the model's shapes"))
    step_time.add_args(bs.add_parser("step", help="step-time breakdown of one decode and one verify forward"))
    prefix.add_args(bs.add_parser("prefix", help="prefix cache: multi-turn chat TTFT and end-to-end, cache on vs off"))


def run_bench(a: argparse.Namespace) -> None:
    from . import accept, agentic, gemm, prefix, quality, real, serving, speed, step_time, verify_cost

    try:
        {"accept": accept.run, "speed": speed.run, "real": real.run, "serving": serving.run, "agentic": agentic.run, "verify": verify_cost.run,
         "quality": quality.run, "gemm": gemm.run, "step": step_time.run,
         "prefix": prefix.run}[a.bench_command](a)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"specserve: error: {e}") from None
