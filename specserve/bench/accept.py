"""`specserve bench accept`: acceptance length per workload for a target + drafter.

Prints τ (bonus included), per-position acceptance and the macro mean over workloads, at each
temperature; writes JSON. Speed is not the point here (see `bench speed`).
"""
from __future__ import annotations

import argparse
import sys

from ..flags import config_from_args
from ..core import SamplingParams
from .common import add_prompt_args, record, workloads
from .metrics import acceptance


def add_args(p: argparse.ArgumentParser) -> None:
    add_prompt_args(p)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--sampling-seed", type=int, default=0, help="per-request seed base at T > 0")
    p.add_argument("--update-card", action="store_true",
                   help="record the T=0 τ per workload in the drafter artifact's config.json and model card")


def run(a: argparse.Namespace) -> dict:
    from ..engine.llm import LLM

    cfg = config_from_args(a, a.model)
    if not cfg.speculative_algorithm:
        raise SystemExit("specserve: error: --speculative-algorithm: bench accept needs a drafter")
    llm = LLM.from_config(cfg)
    results: dict = {}
    for temp in a.temperature:
        row = {}
        for name, convs in workloads(a).items():
            sps = [SamplingParams(temperature=temp, max_tokens=a.max_new_tokens, seed=a.sampling_seed + i)
                   for i in range(len(convs))]
            outs = llm.chat(convs, sps, use_tqdm=True)
            row[name] = acceptance(o.meta_info for o in outs)
        row["macro_mean"] = {"accept_length": sum(r["accept_length"] for r in row.values()) / len(row)}
        results[f"T={temp}"] = row
        _print(temp, row, llm.engine.drafter.label)
    path = record("accept", a, results, {"drafter": llm.engine.drafter.label, "model": cfg.model})
    print(f"wrote {path}")
    art = getattr(llm.engine.drafter, "path", None)
    if a.update_card and art is not None and "T=0.0" in results:
        from ..drafters.card import update_card

        tau = {w: round(r["accept_length"], 3) for w, r in results["T=0.0"].items()}
        update_card(art, tau, "specserve bench accept " + " ".join(sys.argv[3:]))
        print(f"updated {art}/README.md")
    return results


def _print(temp: float, row: dict, label: str) -> None:
    print(f"\n{label}, temperature {temp}: acceptance length τ (bonus included) and P(accept) by draft position")
    width = max(len(r.get("per_position", [])) for r in row.values())
    print(f"{'workload':12s} {'τ':>6s} " + " ".join(f"{'p' + str(i + 1):>6s}" for i in range(width)))
    for name, r in row.items():
        pos = " ".join(f"{x:6.3f}" for x in r.get("per_position", []))
        print(f"{name:12s} {r['accept_length']:6.3f} {pos}")
