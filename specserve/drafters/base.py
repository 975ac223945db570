"""Drafter contract and registry: the one list of speculative algorithms and what each can do.

A drafter proposes up to `window[b]` tokens for each decoding request. Lifecycle per request:
  prefill(chunks, feats)                after each target prefill chunk (build draft-side state)
  propose(reqs, window) → Proposal      DRAFT stage of a step (chains; or trees with `parents`,
                                        nodes in topological best-first order, ≤ window[b] nodes)
  commit(reqs, num_accepted, feats)     after the target committed accepted + 1 tokens
`feats` are the target's hidden states of the drafter's `aux_layers` ([n, len(aux), H] per request:
the prefill chunk's tokens, or the verify window's rows) — None for drafters that need none.
  release(req)                          at finish / abort / preemption: free draft-side state
Prefix cache (engine/prefix.py): a request admitted past a cached prefix of whole pages starts its
prefill chunks at that prefix's end; `cached_prefix` says how many of those pages the drafter can start
from (the target's hit is cut to it), `attach_prefix` then takes them.
NOTE: after commit, the drafter must agree with the target about what is committed: anything it
built for rejected drafts is dropped (truncated), never reused.

Adding a drafter: one module with a factory `(DrafterContext) → Drafter` decorated with
`@register_drafter(NAME, Capabilities(...), help=...)`, and its module name in `_MODULES`. The registry
is the one list: --speculative-algorithm's names and help, the flags only some algorithms take
(`algorithm_flags`), and config validation (`validate_flags`: a flag the algorithm does not use is
refused by name) are read from it.
"""
from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..core import DraftPlan, Proposal, Request

if TYPE_CHECKING:
    from ..cache.kv_pool import KVPool
    from ..config import EngineConfig
    from .context import DrafterContext


class Drafter(ABC):
    #: True when proposals carry the draft distributions q the tokens were sampled from
    #: (then `sample` / `block` acceptance apply); False for deterministic drafts (verified one-hot).
    supplies_q: bool = False
    #: Shown in outputs and logs (the SYNTHETIC drafter labels itself test-only).
    label: str = ""
    #: target layers whose outputs the drafter consumes (learned drafters); () = no capture at all.
    aux_layers: tuple[int, ...] = ()
    #: pays for its whole window up front (DFlash/DSpark blocks: one forward; EAGLE-2 trees: their
    #: depth), so window policies that weigh cost choose windows after drafting, from the confidence.
    drafts_whole_window: bool = False
    #: where a request's drafts come from, cheapest first (HYBRID: a free lookup, then a learned drafter);
    #: the `cost` policy's gate measures and opens each source on its own
    sources: tuple[str, ...] = ("draft",)

    def draft_source(self, req: Request, model: bool = True) -> str:
        """Which of `sources` would draft for `req` this step (decided from committed tokens only: the draft
        stage asks before drafting and hands the answer back in the plan). `model` False: the draft stage turned
        the drafter's draft model off for req, so a source without a forward must answer (drafting nothing is
        allowed)."""
        return self.sources[-1]

    def prefill(self, chunks: list[tuple[Request, int, int]], feats: list[torch.Tensor] | None = None) -> None:
        """(request, start, num_tokens) target prefill chunks just run. Default: nothing to build."""

    @abstractmethod
    def propose(self, reqs: list[Request], plan: DraftPlan) -> Proposal:
        """Draft at most plan.windows[b] tokens for reqs[b] from source plan.sources[b] (fewer, even zero, is
        always allowed)."""

    def commit(self, reqs: list[Request], num_accepted: list[int], feats: list[torch.Tensor] | None = None) -> None:
        """Target committed num_accepted[b] drafts + 1 token for reqs[b]."""

    def release(self, req: Request) -> None:
        """Forget a request's draft-side state."""

    def save(self, now: bool = False) -> None:
        """Persist what outlives the process (the suffix index), in idle time if due, or `now` (shutdown)."""

    def use_prefix_cache(self) -> None:
        """The engine caches prefixes: a drafter with a pool of its own may cache its pages too."""

    def cached_prefix(self, req: Request, keys: list[bytes]) -> int:
        """How many leading pages (hash-chain `keys`, cache/prefix_cache.py) req may skip: the drafter
        builds its state for them without the target's prefill of them. Default: all (no such state, or
        state the drafter catches up on by itself)."""
        return len(keys)

    def attach_prefix(self, req: Request, keys: list[bytes]) -> None:
        """req starts past the pages of `keys` (≤ what `cached_prefix` allowed)."""

    def prefix_pool(self) -> "tuple[KVPool, torch.nn.Module] | None":
        """The pool whose pages this drafter caches (drafters/prefix.py) and the network that writes them (its
        identity is part of the pool's fingerprint for the disk tier, cache/fingerprint.py); None: it caches none."""
        return None


@dataclass(frozen=True)
class Capabilities:
    """What an algorithm does, hence which flags apply to it (`flags`)."""

    block: bool = False  # drafts a block in one forward: --speculative-(dspark-)block-size, --speculative-lattice-topk
    tree: bool = False  # chain runtime with depth and EAGLE-2 trees: --speculative-num-steps, --speculative-eagle-topk
    features: bool = False  # consumes target hidden states: --speculative-draft-attention-window
    samples: bool = False  # samples drafts with q at T > 0 (sample/block acceptance): --speculative-greedy-draft
    draft_model: bool = False  # loads a draft model: --speculative-draft-model-path, --speculative-draft-dtype
    needs_draft_model_path: bool = False  # no default draft model ships
    default_window: str = "fixed"  # verify-window policy when --speculative-window is not given
    extra_flags: tuple[str, ...] = ()  # the algorithm's own fields (e.g. NGRAM's match lengths)

    def flags(self) -> frozenset[str]:
        out = set(self.extra_flags)
        for cap, names in CAP_FLAGS.items():
            if getattr(self, cap):
                out |= set(names)
        return frozenset(out)


CAP_FLAGS = {"block": ("speculative_block_size", "speculative_dspark_block_size", "speculative_lattice_topk"),
              "tree": ("speculative_num_steps", "speculative_eagle_topk"),
              "features": ("speculative_draft_attention_window",),
              "samples": ("speculative_greedy_draft",),
              "draft_model": ("speculative_draft_model_path", "speculative_draft_dtype")}
TREE_STEPS, TREE_NODES = 4, 8  # EAGLE-2 tree defaults: depth, nodes besides the root
#: what AUTO resolves to (speculative/resolve.py), first choice first: NGRAM over the corpus n-gram table shipped for
#: the target (prompt lookup, else the table: microseconds per draft), else HYBRID over the shipped DSpark
#: (prompt lookup, else the learned drafter); each source gated on its own by `cost`. The flags of both apply;
#: --speculative-draft-model-path (a HYBRID flag) picks HYBRID over that drafter or draft model.
AUTO_ALGORITHMS = ("NGRAM", "HYBRID")
AUTO_ARTIFACT = "dspark"  # the shipped learned drafter HYBRID needs
AUTO_HELP = ("HYBRID over --speculative-draft-model-path when given (prompt lookup, else that draft model or "
             "drafter); else NGRAM over the n-gram table shipped for the target, else HYBRID over its shipped DSpark, "
             "else NGRAM's prompt lookup alone (the default of serve/generate/chat)")

Factory = Callable[["DrafterContext"], Drafter]


@dataclass(frozen=True)
class DrafterEntry:
    name: str
    factory: Factory
    caps: Capabilities
    aliases: tuple[str, ...] = ()
    help: str = ""  # --speculative-algorithm's help for it


_REGISTRY: dict[str, DrafterEntry] = {}
#: modules whose import registers drafters (a new drafter module is added here)
_MODULES = ("ngram", "standalone", "synthetic", "artifact", "hybrid")


def register_drafter(name: str, caps: Capabilities | None = None, aliases: tuple[str, ...] = (),
                     help: str = "") -> Callable[[Factory], Factory]:  # noqa: A002
    def deco(factory: Factory) -> Factory:
        _REGISTRY[name] = DrafterEntry(name, factory, caps or Capabilities(), aliases, help)
        return factory

    return deco


def registry() -> dict[str, DrafterEntry]:
    for m in _MODULES:
        importlib.import_module(f"{__package__}.{m}")
    return _REGISTRY


def algorithm_flags() -> frozenset[str]:
    """Fields that only some algorithms use (every other speculative_* field applies to all of them)."""
    return frozenset({n for names in CAP_FLAGS.values() for n in names}
                     | {n for e in registry().values() for n in e.caps.extra_flags})


def __getattr__(name: str) -> frozenset[str]:
    # NOTE: ALGORITHM_FLAGS is derived from the registry, which fills as drafter modules import: computed on use
    if name == "ALGORITHM_FLAGS":
        return algorithm_flags()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def algorithm_help() -> str:
    """--speculative-algorithm's help, from the registry."""
    def one(e: DrafterEntry) -> str:
        alias = f" ({', '.join(e.aliases)})" if e.aliases else ""
        return f"{e.name}{alias}" + (f" = {e.help}" if e.help else "")

    return f"drafter: {'; '.join(one(e) for _, e in sorted(registry().items()))}; NONE = plain decoding; AUTO = {AUTO_HELP}"


def window_defaults_help() -> str:
    """Which verify-window policy each algorithm gets when --speculative-window is not given."""
    by: dict[str, list[str]] = {}
    for name in [*sorted(registry()), "AUTO"]:
        by.setdefault(default_window(name), []).append(name)
    common = max(by, key=lambda w: len(by[w]))
    return "Default: " + ", ".join(f"{w} for {'/'.join(ns)}" for w, ns in by.items() if w != common) + \
        f", {common} otherwise"


def canonical_algorithm(name: str) -> str:
    """NAME or an alias (case-insensitive) → the registered name; AUTO stays AUTO."""
    up = name.upper()
    if up == "AUTO":
        return up
    for e in registry().values():
        if up == e.name or up in e.aliases:
            return e.name
    raise ValueError(f"--speculative-algorithm: unknown {name!r}; choose one of {', '.join(registry())}")


def capabilities(algorithm: str) -> Capabilities:
    if algorithm != "AUTO":
        return registry()[algorithm].caps
    caps = [registry()[a].caps for a in AUTO_ALGORITHMS]  # AUTO: what any of its choices accepts
    return Capabilities(**{f.name: any(getattr(c, f.name) for c in caps) for f in dataclasses.fields(Capabilities)
                           if f.type in (bool, "bool")},
                        default_window="cost",
                        extra_flags=tuple(dict.fromkeys(x for c in caps for x in c.extra_flags)))


def default_window(algorithm: str) -> str:
    """The verify-window policy of an algorithm when --speculative-window is not given. AUTO: cost
    (NOTE: with the fixed window a learned block drafter's full block costs more than it returns on a CPU;
    docs/benchmarks.md, "The cost policy's constants")."""
    return "cost" if algorithm == "AUTO" else capabilities(algorithm).default_window


def create_drafter(name: str, ctx: "DrafterContext") -> Drafter:
    if name not in registry():
        raise ValueError(f"--speculative-algorithm: no drafter {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name].factory(ctx)


def validate_flags(c: "EngineConfig") -> None:
    """Refuse, naming the flag, every option the chosen algorithm would silently ignore (the acceptance rule
    and K/depth/block are checked with the rest of the speculative settings: speculative/resolve.py)."""
    def flag(name: str) -> str:
        return name.replace("_", "-")

    algo, caps = c.speculative_algorithm, capabilities(c.speculative_algorithm)
    for name in sorted(algorithm_flags() - caps.flags()):
        if getattr(c, name) is not None:
            raise ValueError(f"--{flag(name)} does not apply to --speculative-algorithm {algo}")
    if caps.needs_draft_model_path and not c.speculative_draft_model_path:
        raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
    window = c.speculative_window or default_window(algo)
    if c.speculative_confidence_threshold is not None and window != "confidence":
        raise ValueError(f"--speculative-confidence-threshold applies to --speculative-window confidence, not {window}")
