"""One config tree: `EngineConfig` feeds the CLI flags (--kebab-case), the environment
(SPECSERVE_UPPER_SNAKE) and the offline API (`LLM(**snake_case)`). Precedence: explicit > env > default."""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

SPEC_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE3", "MTP", "DFLASH", "DSPARK", "SYNTHETIC")
LEARNED_ALGORITHMS = ("EAGLE3", "MTP", "DFLASH", "DSPARK")
_ALGO_ALIASES = {"PROMPT_LOOKUP": "NGRAM", "DRAFT_MODEL": "STANDALONE", "EAGLE": "EAGLE3", "NEXTN": "MTP"}
ACCEPT_RULES = ("auto", "greedy", "sample", "onehot", "block")
TREE_STEPS, TREE_NODES = 4, 8  # EAGLE-2 tree defaults: depth, nodes besides the root


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:  # noqa: A002
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    model: str = _f("smollm2-135m", "model: an HF checkpoint dir, a .gguf file, or an alias (smollm2-135m)")
    dtype: str = _f("auto", "weights/activations dtype (auto = float32: exact and fastest on CPU here)",
                    ("auto", "float32", "bfloat16", "float64"))
    quantization: str | None = _f(None, "quantized linear layers (not bit-equal to float32): w4a8 = 4-bit weight "
                                  "blocks of 32 (a GGUF's own Q4_0/Q4_1/Q4_K/Q8_0 blocks kept exactly) x int8 "
                                  "activations per block of 32, our VNNI kernel (rows independent), float32 elsewhere; "
                                  "w8a8 = the same with 8-bit weights; int4 = torch's weight-only 4-bit kernel",
                                  ("int4", "w4a8", "w8a8"))
    kv_cache_memory: str = _f("1GiB", "KV pool budget: a size (2GiB, 512MB) or a fraction of RAM (0.2)")
    page_size: int = _f(16, "tokens per KV page")
    max_model_len: int | None = _f(None, "max prompt + output tokens (default: the model's context)")
    max_prefill_tokens: int = _f(2048, "prefill tokens per step (longer prompts are chunked)")
    max_running_requests: int = _f(64, "max requests decoding at once")
    seed: int = _f(0, "engine seed; unseeded requests draw their seeds from it")
    num_threads: int | None = _f(None, "torch intra-op threads (default: torch's choice)")
    speculative_algorithm: str | None = _f(None, "drafter: NGRAM, STANDALONE, EAGLE3 (EAGLE), MTP (NEXTN), DFLASH, "
                                           "DSPARK, SYNTHETIC (tests/benchmarks only); NONE = plain decoding; AUTO = the drafter shipped for "
                                           "the target (DSPARK) if any (the default of serve/generate/chat)")
    speculative_draft_model_path: str | None = _f(None, "draft model for STANDALONE, or a drafter artifact dir for "
                                                  "EAGLE3/MTP/DFLASH/DSPARK (default: the one shipped for the target)")
    speculative_num_draft_tokens: int | None = _f(None, "draft tokens proposed per request per step (K; default 4, "
                                                  "block drafters: block size − 1; trees: nodes besides the root, "
                                                  "default 8)")
    speculative_num_steps: int | None = _f(None, "EAGLE3/MTP: draft depth (chain length with topk 1; tree depth, "
                                           "default 4, with topk > 1)")
    speculative_eagle_topk: int = _f(1, "EAGLE3/MTP: children per expanded node; > 1 drafts an EAGLE-2 dynamic "
                                     "tree (1 = chain)")
    speculative_dflash_block_size: int | None = _f(None, "DFLASH: block size at serving (≤ the trained one; default it)")
    speculative_dspark_block_size: int | None = _f(None, "DSPARK: block size at serving (≤ the trained one; default it)")
    speculative_lattice_topk: int = _f(0, "DFLASH/DSPARK: rerank each drafted block over the top-k candidates per "
                                       "offset by dynamic programming (per-offset log-probs + Markov transition "
                                       "scores); 0 = off")
    speculative_draft_window_size: int | None = _f(None, "EAGLE3/MTP/DFLASH/DSPARK: the drafter attends only to the "
                                                   "last W committed positions (and its own drafts); draft KV "
                                                   "pages behind the window are freed (default: all)")
    speculative_window: str = _f("fixed", "window policy: fixed = K for every request; confidence = the prefix whose "
                                 "cumulative draft confidence stays >= --speculative-confidence-threshold; cost = "
                                 "per-request windows maximising expected tokens per second of a measured verify-cost "
                                 "curve (0 = plain)", ("fixed", "confidence", "cost"))
    speculative_confidence_threshold: float = _f(0.2, "confidence window: keep draft positions while the cumulative "
                                                 "acceptance probability is at least this")
    speculative_accept: str = _f("auto", "acceptance rule at temperature > 0 (greedy always at 0)", ACCEPT_RULES)
    speculative_ngram_min_match: int = _f(1, "NGRAM: shortest suffix to match")
    speculative_ngram_max_match: int = _f(4, "NGRAM: longest suffix to match")
    speculative_synthetic_accept_rate: float = _f(0.7, "SYNTHETIC: probability each drafted token is the target's")
    speculative_draft_dtype: str | None = _f(None, "dtype of the draft model (default: the target's)")

    def __post_init__(self) -> None:
        algo = self.speculative_algorithm
        if algo is not None and algo.upper() == "NONE":
            algo = None
            object.__setattr__(self, "speculative_algorithm", None)
        if algo is not None:
            algo = _ALGO_ALIASES.get(algo.upper(), algo.upper())
            if algo not in SPEC_ALGORITHMS + ("AUTO",):
                raise ValueError(f"--speculative-algorithm: unknown {self.speculative_algorithm!r}; "
                                 f"choose one of {', '.join(SPEC_ALGORITHMS)}")
            object.__setattr__(self, "speculative_algorithm", algo)
        for f in dataclasses.fields(self):
            ch = f.metadata.get("choices")
            if ch and getattr(self, f.name) is not None and getattr(self, f.name) not in ch:
                raise ValueError(f"--{flag(f.name)}: {getattr(self, f.name)!r} is not one of {', '.join(ch)}")
        for name in ("page_size", "max_prefill_tokens", "max_running_requests", "speculative_ngram_min_match"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.speculative_num_draft_tokens is not None and not 0 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError(f"--speculative-num-draft-tokens must be in [0, 64], got {self.speculative_num_draft_tokens}")
        for name in ("speculative_dflash_block_size", "speculative_dspark_block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 2:
                raise ValueError(f"--{flag(name)} must be >= 2 (an anchor and at least one MASK), got {getattr(self, name)}")
        if self.speculative_num_steps is not None and not 1 <= self.speculative_num_steps <= 32:
            raise ValueError(f"--speculative-num-steps must be in [1, 32], got {self.speculative_num_steps}")
        if not 1 <= self.speculative_eagle_topk <= 16:
            raise ValueError(f"--speculative-eagle-topk must be in [1, 16], got {self.speculative_eagle_topk}")
        if self.speculative_eagle_topk > 1 and self.speculative_algorithm is not None:  # plain decoding ignores it
            if self.speculative_algorithm not in ("EAGLE3", "MTP"):
                raise ValueError("--speculative-eagle-topk > 1 drafts EAGLE-2 trees, which need "
                                 f"--speculative-algorithm EAGLE3 or MTP (got {self.speculative_algorithm})")
            if self.speculative_accept == "block":
                raise ValueError("--speculative-accept block verifies chains; trees (--speculative-eagle-topk > 1) "
                                 "use their own lossless walk: use auto")
            k, d = self.speculative_eagle_topk, self.speculative_num_steps or TREE_STEPS
            m = self.speculative_num_draft_tokens
            if m is not None and not 1 <= m <= k + (d - 1) * k * k:
                raise ValueError(f"--speculative-num-draft-tokens must be in [1, {k + (d - 1) * k * k}] for a tree of "
                                 f"depth {d} and topk {k}, got {m}")
        if not 0 <= self.speculative_lattice_topk <= 64:
            raise ValueError(f"--speculative-lattice-topk must be in [0, 64], got {self.speculative_lattice_topk}")
        if self.speculative_draft_window_size is not None and self.speculative_algorithm is not None:
            if self.speculative_draft_window_size < 1:
                raise ValueError(f"--speculative-draft-window-size must be >= 1, got {self.speculative_draft_window_size}")
            if self.speculative_algorithm not in LEARNED_ALGORITHMS + ("AUTO",):
                raise ValueError("--speculative-draft-window-size applies to the learned drafters (EAGLE3, MTP, DFLASH, "
                                 f"DSPARK), not {self.speculative_algorithm}")
        if self.speculative_ngram_max_match < self.speculative_ngram_min_match:
            raise ValueError("--speculative-ngram-max-match must be >= --speculative-ngram-min-match")
        if not 0.0 <= self.speculative_confidence_threshold <= 1.0:
            raise ValueError("--speculative-confidence-threshold must be in [0, 1]")
        if not 0.0 <= self.speculative_synthetic_accept_rate <= 1.0:
            raise ValueError("--speculative-synthetic-accept-rate must be in [0, 1]")
        if self.speculative_algorithm == "STANDALONE" and not self.speculative_draft_model_path:
            raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path")

    @classmethod
    def from_sources(cls, explicit: dict[str, Any] | None = None, environ: typing.Mapping[str, str] | None = None) -> "EngineConfig":
        """Merge explicit values over SPECSERVE_* environment variables over defaults."""
        environ = os.environ if environ is None else environ
        explicit = dict(explicit or {})
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(explicit) - set(names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name, f in names.items():
            env = environ.get(env_name(name))
            if name in explicit and explicit[name] is not None:
                values[name] = explicit[name]
            elif env is not None:
                values[name] = parse_field(env, f, source=env_name(name), owner=cls)
        return cls(**values)


def flag(name: str) -> str:
    return name.replace("_", "-")


def env_name(name: str) -> str:
    return "SPECSERVE_" + name.upper()


def _base_type(f: dataclasses.Field, owner: type | None = None) -> type:
    t = typing.get_type_hints(owner or EngineConfig)[f.name]
    if isinstance(t, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def parse_field(text: str, f: dataclasses.Field, source: str, owner: type | None = None) -> Any:
    """`text` (an environment variable or a `--algos` override) as the field's type; errors name `source`."""
    t = _base_type(f, owner)
    try:
        return t(text)
    except ValueError:
        raise ValueError(f"{source}: expected {t.__name__}, got {text!r}") from None


def add_engine_args(parser: argparse.ArgumentParser, owner: type | None = None) -> None:
    """Add every field of EngineConfig (or another config dataclass with `from_sources`, e.g. the
    server's ServerConfig) as --kebab-case (default None so env/defaults apply later)."""
    for f in dataclasses.fields(owner or EngineConfig):
        if f.name == "model":
            continue
        parser.add_argument(f"--{flag(f.name)}", dest=f.name, type=_base_type(f, owner), default=None,
                            choices=f.metadata.get("choices"),
                            help=f"{f.metadata['help']} [env {env_name(f.name)}; default {f.default}]")


def config_from_args(args: argparse.Namespace, model: str | None) -> EngineConfig:
    explicit = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    explicit["model"] = model
    return EngineConfig.from_sources(explicit)
