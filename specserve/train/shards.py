"""Target features and labels on disk: the feature pass writes fixed-size shards, training memory-maps them.

One target prefill per sequence yields, for every position, the hidden states of the drafter's aux
layers (fp16; n_aux × H × 2 bytes per token) and the target's argmax — in the precision the target
serves in. `labels[p]` is the target's greedy token *for* position p (its argmax at p − 1; −1 at 0),
so a drafter trained to predict labels[p] learns what verification will accept, whatever the text.

A shard directory `shard-NNNNN/` holds ids, labels, mask (int32/bool, [T]), feats (fp16 [T, n_aux, H])
and offsets ([n + 1] sequence boundaries); it appears by an atomic rename, so readers never see a
half-written shard and an interrupted pass resumes at the next sequence (`progress.json`).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from ..cache.kv_pool import KVPool
from ..runtime.runner import ModelRunner
from ..models.llama import LlamaModel
from .data import Sequence


class Labeler:
    """Runs the target over whole sequences: aux-layer hidden states and the argmax at every position."""

    def __init__(self, model: LlamaModel, aux_layers: tuple[int, ...], max_len: int) -> None:
        self.model, self.aux = model, tuple(aux_layers)
        self.runner = ModelRunner(model, KVPool(model.cfg, 1, max_len, model.dtype))  # one page = one sequence

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (feats [S, n_aux, H] fp32, labels [S] int64 with labels[0] = −1)."""
        logits, captured = self.runner.forward([[0]], [0], [ids], [list(range(len(ids)))], self.aux)
        order = sorted(self.aux)
        feats = torch.stack([captured[order.index(a)] for a in self.aux], dim=1).float()
        labels = torch.cat([torch.tensor([-1]), logits[0][:-1].argmax(-1)])
        return feats, labels


def _meta(out: Path) -> dict:
    p = out / "progress.json"
    return json.loads(p.read_text()) if p.exists() else {"next": 0, "shards": 0, "tokens": 0, "seconds": 0.0}


def extract(labeler: Labeler, items: Callable[[int], tuple[list[int], list[bool]] | None], num_items: int,
            out: Path, shard_tokens: int, describe: dict, max_tokens: int | None = None,
            log: Callable[[str], None] = print) -> dict:
    """Label items[next:] into shards of ≥ `shard_tokens` tokens until `max_tokens` are stored; resumable. `items(i)` returns the
    (ids, assistant mask) of item i, or None to skip it. `describe` (target, precision, aux layers,
    max length) must match the directory's, so shards of different runs never mix."""
    out.mkdir(parents=True, exist_ok=True)
    meta = _meta(out)
    if meta.get("describe", describe) != describe:
        raise ValueError(f"{out} holds features made with {meta['describe']}, not {describe}; use another --work-dir")
    meta["describe"] = describe
    buf: dict[str, list] = {"ids": [], "labels": [], "mask": [], "feats": []}
    i, t0 = meta["next"], time.time()
    while i < num_items and (max_tokens is None or meta["tokens"] < max_tokens):
        item = items(i)
        i += 1
        if item is not None:
            ids, mask = item
            feats, labels = labeler(ids)
            buf["ids"].append(np.asarray(ids, np.int32))
            buf["labels"].append(labels.numpy().astype(np.int32))
            buf["mask"].append(np.asarray(mask, np.bool_))
            buf["feats"].append(feats.half().numpy())
        n = sum(len(x) for x in buf["ids"])
        if n >= shard_tokens or (i == num_items and n):
            name = f"shard-{meta['shards']:05d}"
            tmp = out / (name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for k, v in buf.items():
                np.save(tmp / f"{k}.npy", np.concatenate(v))
            np.save(tmp / "offsets.npy", np.cumsum([0] + [len(x) for x in buf["ids"]]))
            os.replace(tmp, out / name)
            meta.update(next=i, shards=meta["shards"] + 1, tokens=meta["tokens"] + n,
                        seconds=round(meta["seconds"] + time.time() - t0, 1))
            t0 = time.time()
            (out / "progress.json.tmp").write_text(json.dumps(meta, indent=1))
            os.replace(out / "progress.json.tmp", out / "progress.json")
            log(f"{name}: {n} tokens; {meta['tokens']} tokens from {i} items in {meta['seconds']:.0f} s "
                f"({meta['tokens'] / max(meta['seconds'], 1e-9):.1f} tok/s)")
            buf = {k: [] for k in buf}
    return meta


class ShardSet:
    """The complete shards of a directory, memory-mapped; `refresh()` picks up shards written since."""

    def __init__(self, root: Path, max_tokens: int | None = None) -> None:
        self.root, self.max_tokens = root, max_tokens
        self.shards: list[dict[str, np.ndarray]] = []
        self.index: list[tuple[int, int]] = []  # (shard, sequence) in shard order
        self.used: list[int] = []  # tokens in use per shard (max_tokens may cut the last one)
        self.tokens = 0
        self.refresh()

    def refresh(self) -> None:
        names = sorted(p.name for p in self.root.glob("shard-?????") if p.is_dir())
        for name in names[len(self.shards) :]:
            if self.max_tokens is not None and self.tokens >= self.max_tokens:
                return
            d = self.root / name
            sh = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in ("ids", "labels", "mask", "feats", "offsets")}
            s = len(self.shards)
            self.shards.append(sh)
            j = 0
            while j < len(sh["offsets"]) - 1 and (self.max_tokens is None or self.tokens < self.max_tokens):
                self.index.append((s, j))
                self.tokens += int(sh["offsets"][j + 1] - sh["offsets"][j])
                j += 1
            self.used.append(int(sh["offsets"][j]))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, k: int) -> Sequence:
        s, j = self.index[k]
        sh = self.shards[s]
        a, b = int(sh["offsets"][j]), int(sh["offsets"][j + 1])
        return Sequence(torch.from_numpy(sh["ids"][a:b].astype(np.int64)),
                        torch.from_numpy(np.array(sh["mask"][a:b])),
                        torch.from_numpy(sh["feats"][a:b].astype(np.float32)),
                        torch.from_numpy(sh["labels"][a:b].astype(np.int64)))

    def token_counts(self, vocab: int) -> torch.Tensor:
        """How often each target id is the target's label on an assistant position (draft vocabulary)."""
        counts = torch.zeros(vocab, dtype=torch.long)
        for sh, n in zip(self.shards, self.used):
            lab = torch.from_numpy(sh["labels"][:n].astype(np.int64))
            m = torch.from_numpy(np.array(sh["mask"][:n])) & (lab >= 0)
            counts += torch.bincount(lab[m], minlength=vocab)
        return counts


def epochs(data: "ShardSet | list[Sequence]", tokens_per_batch: int, gen: torch.Generator,
           position: dict) -> Iterator[list[Sequence]]:
    """Shuffled batches of whole sequences (~`tokens_per_batch` tokens), forever. `position` (epoch,
    offset into that epoch's permutation) is updated in place, so a checkpoint resumes mid-epoch:
    each epoch's order is a function of (seed of `gen` at the epoch start) only."""
    while True:
        if isinstance(data, ShardSet):
            data.refresh()  # a feature pass still running adds shards between epochs
        if "perm_seed" not in position:  # a new epoch over the sequences that exist now (they only grow)
            position.update(perm_seed=int(torch.randint(0, 2**62, (1,), generator=gen)), size=len(data), offset=0)
        order = torch.randperm(position["size"], generator=torch.Generator().manual_seed(position["perm_seed"])).tolist()
        batch, n = [], 0
        while position["offset"] < len(order):
            seq = data[order[position["offset"]]]
            position["offset"] += 1
            batch.append(seq)
            n += len(seq.ids)
            if n >= tokens_per_batch:
                yield batch
                batch, n = [], 0
        position["epoch"] = position.get("epoch", 0) + 1
        del position["perm_seed"]
