"""A corpus n-gram table: for each context of n = 1..max_n tokens seen at least `min_count` times in a corpus,
the token that most often followed it, with a calibrated probability that a draft of it is accepted.

Drafting chains lookups: the longest context with an entry gives the next token and its confidence; the
drafted token extends the context for the next lookup (REST-style retrieval without a model: microseconds
per token). Lossless like every drafter: its tokens are verified by the target (one-hot).

Storage (`table.npz` + `table.json` in an artifact directory): one sorted uint32 array of context keys for
all n (n is folded into the hash), uint16 tokens and uint8 confidences (×255). NOTE: keys are 32-bit hashes:
a colliding context only yields a wrong draft, which verification rejects.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from ..models.config import ModelConfig

_P = 1_000_003  # polynomial base of the context hash
_MIX = 0x9E3779B97F4A7C15  # multiplicative mix; the key is the high 32 bits
_M64 = (1 << 64) - 1
BINS = 10  # calibration bins of the raw probability count(best) / count(context)
SHIPPED = Path(__file__).parent / "shipped"


def context_keys(ctx: list[int], max_n: int) -> list[int]:
    """keys[n-1] = key of the context's last n tokens (n = 1..min(max_n, len(ctx)))."""
    out, h = [], 0
    for j in range(1, min(max_n, len(ctx)) + 1):
        h = (h * _P + int(ctx[-j]) + 1) & _M64
        out.append(((h * _MIX) & _M64) >> 32)
    return out


def _keys_np(ids: np.ndarray, n: int) -> np.ndarray:
    """Vectorised context_keys: the key of ids[p-n+1..p] at every p (garbage for p < n-1)."""
    with np.errstate(over="ignore"):
        h = np.zeros(len(ids), np.uint64)
        for j in range(n):
            sh = np.zeros(len(ids), np.uint64)
            sh[j:] = ids[: len(ids) - j]
            h = h * np.uint64(_P) + sh + np.uint64(1)
        return ((h * np.uint64(_MIX)) >> np.uint64(32)).astype(np.uint32)


@dataclass
class TableMeta:
    vocab_size: int
    max_n: int
    min_count: int
    target: str = ""
    tokens: int = 0  # corpus positions counted
    #: calibration[n-1][bin]: measured acceptance of a draft whose raw probability falls in `bin`
    calibration: list[list[float]] = field(default_factory=list)
    training: dict = field(default_factory=dict)  # data, command, measured acceptance


class NgramTable:
    def __init__(self, meta: TableMeta, keys: np.ndarray, tokens: np.ndarray, conf: np.ndarray) -> None:
        self.meta, self.keys, self.tokens, self.conf = meta, keys, tokens, conf
        self._conf = conf.astype(np.float32) / 255.0

    @classmethod
    def build(cls, streams: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int, max_n: int = 4,
              min_count: int = 2, **meta: object) -> tuple["NgramTable", list[np.ndarray]]:
        """streams: (ids, use) pairs; position p counts (context ids[..p], next ids[p+1]) where use[p+1].
        Returns the table (uncalibrated: confidence = raw probability) and the raw probabilities per n."""
        ks, nx, ns = [], [], []
        total = 0
        for ids, use in streams:
            ids = np.asarray(ids, np.int64)
            ok = np.asarray(use, bool)[1:].copy()
            total += int(ok.sum())
            for n in range(1, max_n + 1):
                sel = ok.copy()
                sel[: n - 1] = False
                ks.append(_keys_np(ids[:-1], n)[sel] ^ np.uint32(n))  # NOTE: n folded in (distinct tables)
                nx.append(ids[1:][sel])
                ns.append(np.full(int(sel.sum()), n, np.uint8))
        k, t, n = np.concatenate(ks), np.concatenate(nx), np.concatenate(ns)
        o = np.lexsort((t, k))
        k, t, n = k[o], t[o], n[o]
        pair = np.r_[True, (k[1:] != k[:-1]) | (t[1:] != t[:-1])]
        at = np.flatnonzero(pair)
        cnt = np.diff(np.r_[at, len(k)])
        pk, pt, pn = k[at], t[at], n[at]
        new = np.r_[True, pk[1:] != pk[:-1]]
        kid = np.cumsum(new) - 1
        tot = np.bincount(kid, weights=cnt).astype(np.int64)
        o2 = np.lexsort((-cnt, kid))
        best = o2[np.r_[True, kid[o2][1:] != kid[o2][:-1]]]  # the most frequent next token per context
        keep = tot >= min_count
        raw = cnt[best][keep] / tot[keep]
        tokens = pt[best][keep].astype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
        table = cls(TableMeta(vocab_size, max_n, min_count, tokens=total, **meta),  # type: ignore[arg-type]
                    pk[best][keep], tokens, np.round(raw * 255).astype(np.uint8))
        return table, [pn[best][keep]]

    def calibrate(self, n_of_entry: np.ndarray, calibration: list[list[float]]) -> None:
        """Replace raw probabilities by measured acceptance per (n, raw-probability bin)."""
        cal = np.asarray(calibration, np.float32)
        b = np.minimum(self.conf.astype(np.int64) * BINS // 256, BINS - 1)
        self.conf = np.round(cal[n_of_entry.astype(np.int64) - 1, b] * 255).astype(np.uint8)
        self._conf = self.conf.astype(np.float32) / 255.0
        self.meta.calibration = calibration

    def lookup(self, ctx: list[int]) -> tuple[int, float, int] | None:
        """(token, confidence, n) from the longest context with an entry, or None."""
        qs = [k ^ n for n, k in enumerate(context_keys(ctx, self.meta.max_n), 1)]
        if not qs:
            return None
        q = np.array(qs, np.uint32)
        at = np.minimum(np.searchsorted(self.keys, q), len(self.keys) - 1)
        hit = self.keys[at] == q
        for n in range(len(qs), 0, -1):
            if hit[n - 1]:
                i = int(at[n - 1])
                return int(self.tokens[i]), float(self._conf[i]), n
        return None

    def draft(self, ctx: list[int], k: int, stop_below: float = 0.0) -> tuple[list[int], list[float]]:
        """Up to k chained drafts and their confidences; stops at a miss or once the cumulative
        confidence falls below `stop_below` (the window policy would not verify further)."""
        tail = list(ctx[-self.meta.max_n :])
        toks: list[int] = []
        confs: list[float] = []
        live = 1.0
        while len(toks) < k:
            r = self.lookup(tail)
            if r is None:
                break
            live *= r[1]
            if live < stop_below or r[1] <= 0.0:
                break
            toks.append(r[0])
            confs.append(r[1])
            tail = tail[1:] + [r[0]] if len(tail) >= self.meta.max_n else tail + [r[0]]
        return toks, confs

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(out / "table.npz", keys=self.keys, tokens=self.tokens, conf=self.conf)
        (out / "table.json").write_text(json.dumps(asdict(self.meta), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, target: ModelConfig | None = None) -> "NgramTable":
        p = Path(path)
        if not (p / "table.json").is_file() or not (p / "table.npz").is_file():
            raise ValueError(f"--speculative-ngram-table: {p} is not an n-gram table (needs table.json and table.npz; "
                             "build one with `specserve build-ngram-table`)")
        meta = TableMeta(**json.loads((p / "table.json").read_text()))
        if target is not None and meta.vocab_size != target.vocab_size:
            raise ValueError(f"--speculative-ngram-table: {p} was built for a vocabulary of {meta.vocab_size} tokens, "
                             f"the target has {target.vocab_size}")
        z = np.load(p / "table.npz")
        keys, tokens, conf = z["keys"], z["tokens"], z["conf"]
        if not len(keys) == len(tokens) == len(conf) or (len(tokens) and int(tokens.max()) >= meta.vocab_size):
            raise ValueError(f"--speculative-ngram-table: {p}/table.npz is inconsistent with its table.json "
                             f"(array lengths, or a token id outside the vocabulary of {meta.vocab_size})")
        return cls(meta, keys, tokens, conf)


def shipped_table(target: ModelConfig) -> Path | None:
    """The table shipped for this target, if any (matched by target name)."""
    norm = "".join(ch for ch in target.name.lower() if ch.isalnum())
    for d in sorted(SHIPPED.iterdir()) if SHIPPED.is_dir() else []:
        if (d / "table.json").is_file():
            t = json.loads((d / "table.json").read_text()).get("target", "")
            if "".join(ch for ch in t.lower() if ch.isalnum()) == norm:
                return d
    return None
