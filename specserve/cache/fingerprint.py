"""What names a KV pool's page contents, for the prefix cache's disk tier (cache/disk_tier.py): equal fingerprints
promise equal K/V under equal page keys, so a page file is read only by a pool with its writer's fingerprint.

A fingerprint hashes (BLAKE2b-128 of the parts as sorted JSON):
  format    FORMAT_VERSION (bumped when the file layout changes), specserve's and torch's versions, and a digest
            of the code that computes K/V (code_digest)
  model     its file (path, size, mtime; for an HF directory, each file's), a digest of a strided sample of every
            tensor and array the model holds (an in-memory model, a re-quantized one, an edited file told apart),
            and its whole ModelConfig (layers, heads, RoPE settings, window, ...)
  compute   the forward's dtype and quantization
  layout    the pool's attention layers, kv heads, head dim, page size and KV dtype
A draft pool's adds the target's fingerprint (learned drafters build their rows from the target's features) and
the drafter's label, network digest and config.
"""
from __future__ import annotations

import hashlib
import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
    from .kv_pool import KVPool

FORMAT_VERSION = 1
_SAMPLE = 4096  # elements hashed per tensor
_OPAQUE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)


@dataclass(frozen=True)
class Fingerprint:
    digest: bytes  # 16 bytes: the namespace of the pool's files
    parts: dict[str, Any]  # what went in (meta.json beside the files, for whoever looks)


def fingerprint(parts: dict[str, Any]) -> Fingerprint:
    text = json.dumps(parts, sort_keys=True, default=str)
    return Fingerprint(hashlib.blake2b(text.encode(), digest_size=16).digest(), parts)


def file_identity(path: str | Path | None) -> list[Any] | None:
    """[path, size, mtime_ns] of a model file; of an HF directory, [name, size, mtime_ns] of each file in it."""
    if path is None:
        return None
    p = Path(path).resolve()
    if p.is_dir():
        return [str(p)] + [[e.name, e.stat().st_size, e.stat().st_mtime_ns] for e in sorted(p.iterdir()) if e.is_file()]
    st = p.stat()
    return [str(p), st.st_size, st.st_mtime_ns]


def _arrays(obj: Any, name: str, seen: set[int], depth: int = 4) -> Iterator[tuple[str, torch.Tensor | np.ndarray]]:
    """Every tensor and array `obj` holds: a module's parameters, buffers, submodules and plain attributes, and
    what those hold in lists, dicts and objects (packed weights) down to `depth` levels below a module."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        yield name, obj
    elif isinstance(obj, torch.nn.Module):
        for group in (obj._parameters, obj._buffers, obj._modules):
            for k, v in group.items():
                yield from _arrays(v, f"{name}.{k}", seen)
        for k, v in sorted(vars(obj).items()):
            if not k.startswith("_"):
                yield from _arrays(v, f"{name}.{k}", seen)
    elif depth > 0:
        if isinstance(obj, (list, tuple)):
            items: Any = enumerate(obj)
        elif isinstance(obj, dict):
            items = sorted(((str(k), v) for k, v in obj.items()), key=lambda kv: kv[0])
        elif hasattr(obj, "__dict__") and not isinstance(obj, _OPAQUE):
            items = sorted(vars(obj).items())
        else:
            return
        for k, v in items:
            yield from _arrays(v, f"{name}.{k}", seen, depth - 1)


def weights_digest(model: Any) -> str:
    """BLAKE2b of every array's name, shape, dtype and a strided sample of _SAMPLE elements (milliseconds for a
    1.5B model: what changes a model changes nearly every element of the tensors it touches)."""
    h = hashlib.blake2b(digest_size=16)
    for name, a in _arrays(model, "", set()):
        h.update(f"{name}:{tuple(a.shape)}:{a.dtype};".encode())
        if isinstance(a, torch.Tensor):
            flat = a.detach().reshape(-1)
            s = flat[:: max(1, flat.numel() // _SAMPLE)].contiguous()
            h.update(s.view(torch.uint8).numpy().tobytes() if s.numel() else b"")
        else:
            flat = np.asarray(a).reshape(-1)
            h.update(np.ascontiguousarray(flat[:: max(1, flat.size // _SAMPLE)]).tobytes())
    return h.hexdigest()


def pool_layout(pool: "KVPool") -> dict[str, Any]:
    slots, kv_heads, head_dim = pool.k[0].shape if pool.k else (0, 0, 0)
    return {"attention_layers": len(pool.k), "kv_heads": kv_heads, "head_dim": head_dim, "page_size": pool.page_size,
            "kv_dtype": str(pool.dtype)}


_CODE = ("models", "runtime", "formats", "loading", "kernels")  # the packages whose code decides the K/V written


def code_digest() -> str:
    """A digest of the source that computes K/V (the model forwards, the runner, the quantized formats and the
    kernels, C++ included): an edited checkout never reads pages an earlier one wrote (the version string does not
    change with the code)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in _CODE:
        for f in sorted((root / pkg).rglob("*")):
            if f.suffix in (".py", ".cpp", ".h") and f.is_file():
                h.update(str(f.relative_to(root)).encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _versions() -> dict[str, str]:
    from .. import __version__

    return {"disk_format": str(FORMAT_VERSION), "specserve": __version__, "torch": torch.__version__,
            "code": code_digest()}


def target_fingerprint(model: torch.nn.Module, quantization: str | None, pool: "KVPool",
                       source: str | Path | None) -> Fingerprint:
    """The target pool's; `source`: the checkpoint the model was loaded from (None: built in memory)."""
    return fingerprint({"format": _versions(), "pool": "target", "file": file_identity(source),
                        "weights": weights_digest(model), "config": repr(getattr(model, "cfg", None)),
                        "dtype": str(getattr(model, "dtype", None)), "quantization": quantization,
                        "layout": pool_layout(pool)})


def draft_fingerprint(target: Fingerprint, label: str, net: torch.nn.Module, pool: "KVPool") -> Fingerprint:
    """A draft pool's: its rows come from the draft network, and for learned drafters from the target's features."""
    return fingerprint({"format": _versions(), "pool": "draft", "target": target.digest.hex(), "drafter": label,
                        "weights": weights_digest(net), "config": repr(getattr(net, "cfg", None)),
                        "layout": pool_layout(pool)})
