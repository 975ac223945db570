"""The optimisation loop of `train-drafter`: AdamW, warmup + cosine, resumable at any step.

A checkpoint (`<work>/<algorithm>[-ft]-checkpoint.pt`, -ft for a fine-tune; written atomically every
--checkpoint-every steps and every --checkpoint-minutes) holds the net, the optimizer, the step, the RNG
state and the data position (epoch permutation seed + offset), so a resumed run continues the same data
stream. With a held-out set, each checkpoint is also scored by the teacher-forced evaluator (= serving τ
at T = 0, weights rounded to bf16 as the artifact stores them) and kept as a snapshot in
`<work>/<algorithm>[-ft]-snapshots/` — the log's (seen tokens, data tokens, held-out τ) rows are the
scaling curve.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..bench.metrics import acceptance
from ..drafters.nets import DraftNet
from .accept_eval import teacher_forced_meta
from .losses import block_loss, chain_loss


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, int(0.04 * total))
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


class HeldOut:
    """Held-out records (prompt + the target's greedy answer) with their target features cached."""

    def __init__(self, recs: list[dict], labeler, max_tokens: int) -> None:  # noqa: ANN001
        self.recs, self.max_tokens = recs, max_tokens
        self.labeler = _Cached(labeler)

    @torch.no_grad()
    def score(self, net: DraftNet, k: int | None = None) -> dict:
        """Pooled τ overall and per domain, with the net's weights rounded to bf16 (as served)."""
        saved = {n: p.detach().clone() for n, p in net.state_dict().items() if p.is_floating_point()}
        for n, p in net.state_dict().items():
            if p.is_floating_point():
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
        was = net.training
        net.eval()
        try:
            metas = [(r.get("domain", "all"), teacher_forced_meta(net, self.labeler, r["prompt_ids"], r["response_ids"],
                                                                  self.max_tokens, k)) for r in self.recs]
        finally:
            net.load_state_dict(saved, strict=False)
            net.train(was)
        out = {"tau": round(acceptance(m for _, m in metas)["accept_length"], 4)}
        for d in sorted({d for d, _ in metas}):
            res = acceptance(m for dd, m in metas if dd == d)
            out[f"tau_{d}"] = round(res["accept_length"], 4)
            out[f"p1_{d}"] = round(res["per_position"][0], 4) if res["per_position"] else 0.0
        out["p1"] = round(acceptance(m for _, m in metas)["per_position"][0], 4) if metas else 0.0
        return out


class _Cached:
    def __init__(self, labeler) -> None:  # noqa: ANN001
        self.labeler, self.cache = labeler, {}

    def __call__(self, ids: list[int]):  # noqa: ANN204
        key = tuple(ids)
        if key not in self.cache:
            self.cache[key] = self.labeler(ids)
        return self.cache[key]


def train(a, net: DraftNet, t2d: torch.Tensor, stream_factory: Callable, ckpt: Path,  # noqa: ANN001, PLR0913
          log_path: Path, heldout: HeldOut | None, data_tokens: Callable[[], int]) -> dict:
    """Run to --steps; returns the last log record. `stream_factory(gen, position)` yields batches."""
    cfg = net.cfg
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, gen, before, seen, position = 0, torch.Generator().manual_seed(a.seed), 0.0, 0, {}
    if ckpt.exists():
        blob = torch.load(ckpt, weights_only=False)
        if blob["config"] == cfg.to_json():
            net.load_state_dict(blob["net"])
            opt.load_state_dict(blob["opt"])
            step, before, seen = blob["step"], blob.get("elapsed", 0.0), blob.get("seen_tokens", 0)
            gen.set_state(blob["gen"])
            position = blob.get("position", {})
            print(f"resumed from {ckpt} at step {step}", flush=True)
        else:
            print(f"{ckpt} was made for another drafter config: starting over (it will be overwritten)", flush=True)
    snaps = ckpt.parent / ckpt.name.replace("-checkpoint.pt", "-snapshots")
    stream = stream_factory(gen, position)
    bar = tqdm(total=a.steps, initial=step, desc=f"train {cfg.algorithm}", unit="step", mininterval=30)
    t0, last_ckpt, rec = time.time() - before, time.time(), {}
    offpath = getattr(a, "offpath_weight", 0.0)
    while step < a.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps, a.lr)
        opt.zero_grad()
        batch = next(stream)
        stats = []
        for seq in batch:
            if cfg.is_block:
                loss, st = block_loss(net, seq, t2d, a.num_anchors, a.gamma, gen, offpath)
            else:
                loss, st = chain_loss(net, seq, t2d, cfg.ttt_steps, offpath=offpath)
            (loss / len(batch)).backward()
            stats.append((loss.item(), st))
            seen += len(seq.ids)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        rec = _summary(step, stats, time.time() - t0) | {"seen_tokens": seen, "data_tokens": data_tokens(),
                                                         "epoch": position.get("epoch", 0)}
        bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau_est']:.2f}")
        bar.update(1)
        due = step % a.checkpoint_every == 0 or time.time() - last_ckpt >= 60 * a.checkpoint_minutes
        if due or step == a.steps:
            torch.save({"config": cfg.to_json(), "net": net.state_dict(), "opt": opt.state_dict(), "step": step,
                        "gen": gen.get_state(), "elapsed": time.time() - t0, "seen_tokens": seen,
                        "position": dict(position)}, str(ckpt) + ".tmp")
            os.replace(str(ckpt) + ".tmp", ckpt)
            last_ckpt = time.time()
            if heldout is not None:
                rec["heldout"] = heldout.score(net)
                snaps.mkdir(exist_ok=True)
                torch.save({k: v for k, v in net.state_dict().items()}, snaps / f"step-{step:06d}.pt")
                print(json.dumps(rec), flush=True)
        if step % 10 == 0 or due or step == a.steps:
            with log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
    bar.close()
    return rec


def _summary(step: int, stats: list, elapsed: float) -> dict:
    losses = [l for l, _ in stats]
    taus = [s["tau"] for _, s in stats if not math.isnan(s["tau"])]
    accs = [s["acc"] for _, s in stats]
    acc = [sum(x for x in col if not math.isnan(x)) / max(1, sum(1 for x in col if not math.isnan(x))) for col in zip(*accs)]
    return {"step": step, "loss": sum(losses) / len(losses), "tau_est": sum(taus) / len(taus) if taus else float("nan"),
            "acc_per_pos": [round(x, 4) for x in acc], "elapsed_s": round(elapsed, 1)}
