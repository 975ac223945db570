"""One config tree: `EngineConfig` feeds the CLI flags (--kebab-case, flags.py), the environment
(SPECSERVE_UPPER_SNAKE) and the offline API (`LLM(**snake_case)`). Precedence: explicit > env > default.
Plain data: it checks what its own fields decide and imports nothing of specserve; the checks that read a
registry run in speculative/resolve.py `check_config`."""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

VERIFY_PACKINGS = ("compact", "padded")
Names = tuple[str, ...]


def _f(default: Any, help: str, choices: Names | None = None, unset: Any = None,  # noqa: A002
       aliases: tuple[str, ...] = (), env_aliases: tuple[str, ...] = ()) -> Any:
    """A field; `unset` is the value a None default stands for (None defaults let validation tell a
    flag that was given from one that was not: flags that do not apply are refused only when given).
    `aliases`, `env_aliases`: other flag and environment spellings (another server's name for the same option,
    read after ours). NOTE: the fields whose names
    a registry lists (drafters, window policies, acceptance rules) get their choices and help at the CLI
    layer (flags.py) and their checks in speculative/resolve.py `check_config`: config reads no registry."""
    return field(default=default, metadata={"help": help, "choices": choices, "unset": unset, "aliases": aliases,
                                            "env_aliases": env_aliases})


@dataclass(frozen=True)
class EngineConfig:
    model: str = _f("smollm2-135m", "model: an HF checkpoint dir, a .gguf file, or an alias (smollm2-135m)")
    dtype: str = _f("auto", "weights/activations dtype (auto = float32, bf16 under int4; with auto a "
                    "quantized GGUF is served quantized: see --quantization; float32 = exact fp32)",
                    ("auto", "float32", "bfloat16", "float64"))
    quantization: str | None = _f(None, "quantized linear layers (not bit-equal to float32; default: w4a8 for a GGUF "
                                  "stored in 4- to 6-bit blocks, w8a8 for Q8_0, when --dtype is auto; none = unquantized): w4a8 = 4-bit weight "
                                  "blocks (a GGUF's own Q4_*/Q5_*/Q6_K/Q8_0 blocks kept exactly) x int8 "
                                  "activations per block of 32, our VNNI kernel (rows independent), float32 elsewhere; "
                                  "w8a8 = the same with 8-bit weights; int4 = torch's weight-only 4-bit kernel",
                                  ("int4", "w4a8", "w8a8", "none"))
    kv_cache_memory: str = _f("1GiB", "KV pool budget: a size (2GiB, 512MB) or a fraction of RAM (0.2)")
    kv_cache_dtype: str = _f("auto", "target KV cache dtype: auto = the model's; bfloat16 under a float32 model (e.g. "
                             "w4a8) halves the bytes attention reads per context token (K/V rounded once when written)",
                             ("auto", "float32", "bfloat16"))
    page_size: int = _f(16, "tokens per KV page")
    disable_prefix_cache: bool = _f(False, "do not reuse the KV pages of prompt prefixes across requests (the prefix "
                                    "cache is on by default; hybrid recurrent targets never use it)",
                                    aliases=("--disable-radix-cache",))
    prefix_cache_dir: str | None = _f(None, "a directory where the prefix cache also keeps its pages on disk, so a "
                                      "restarted server (same model, same KV layout) hits the prefixes it had "
                                      "cached; pages are written as they enter the cache and read back at admission "
                                      "(default: RAM only)")
    prefix_cache_disk_budget: str | None = _f(None, "most bytes of page files under --prefix-cache-dir (a size: "
                                              "4GiB, 500MB); the least recently used are deleted past it",
                                              unset="4GiB")
    max_model_len: int | None = _f(None, "max prompt + output tokens (default: the model's context)",
                                   aliases=("--context-length",))
    max_prefill_tokens: int = _f(2048, "prefill tokens per step (longer prompts are chunked)",
                                 aliases=("--chunked-prefill-size",))
    max_running_requests: int = _f(64, "max requests decoding at once")
    seed: int = _f(0, "engine seed; unseeded requests draw their seeds from it")
    num_threads: int | None = _f(None, "torch intra-op threads (default: torch's choice)")
    tp_size: int = _f(1, "tensor-parallel ranks (Megatron layout over torch.distributed, gloo on CPU): rank 0 runs the "
                      "engine, scheduler, drafter and server, every rank its shard of the target forward",
                      aliases=("--tp",))
    dist_init_addr: str | None = _f(None, "host:port where the tensor-parallel ranks meet (default: a free port on "
                                    "127.0.0.1; required with --nnodes > 1)")
    nnodes: int = _f(1, "machines the --tp-size ranks span (each runs tp_size / nnodes of them)")
    node_rank: int = _f(0, "this machine's index among --nnodes: 0 runs the engine and the server, others only "
                        "their ranks' forward workers")
    grammar_backend: str = _f("llguidance", "structured output backend (response_format json_object/json_schema, "
                              "json_schema, regex, ebnf): llguidance, or xgrammar (pip install 'specserve[xgrammar]')",
                              ("llguidance", "xgrammar"))
    grammar_forced_drafts: int = _f(8, "structured output: where the grammar allows exactly one continuation, propose "
                                    "up to this many of its forced tokens as drafts (verified like any draft, also "
                                    "without a drafter); 0 = off")
    speculative_algorithm: str | None = _f(None, "drafter: a registered algorithm or alias, NONE = plain decoding, "
                                           "AUTO = the drafter shipped for the target")
    speculative_draft_model_path: str | None = _f(None, "draft model for STANDALONE, or a drafter artifact dir for "
                                                  "EAGLE3/MTP/DFLASH/DSPARK (default: the one shipped for the target)")
    speculative_num_draft_tokens: int | None = _f(None, "draft tokens proposed per request per step (K; default 4, "
                                                  "block drafters: block size − 1; trees: nodes besides the root, "
                                                  "default 8; chains: --speculative-num-steps)")
    speculative_num_steps: int | None = _f(None, "EAGLE3/MTP: draft depth (chain length with topk 1, where it is the "
                                           "default of --speculative-num-draft-tokens; tree depth, default 4, with topk > 1)")
    speculative_eagle_topk: int | None = _f(None, "EAGLE3/MTP: children per expanded node; > 1 drafts an EAGLE-2 dynamic "
                                            "tree (1 = chain)", unset=1)
    speculative_block_size: int | None = _f(None, "DFLASH/DSPARK: block size at serving, the anchor included: a block "
                                            "of B verifies B rows and drafts B − 1 tokens (≤ the trained one; default it)")
    speculative_dspark_block_size: int | None = _f(None, "DFLASH/DSPARK: SGLang's spelling of the block size: drafts "
                                                   "per block, the anchor not counted (N here = --speculative-block-size "
                                                   "N + 1)")
    speculative_lattice_topk: int | None = _f(None, "DFLASH/DSPARK: rerank each drafted block over the top-k candidates "
                                              "per offset by dynamic programming (per-offset log-probs + Markov "
                                              "transition scores); 0 = off", unset=0)
    speculative_draft_attention_window: int | None = _f(
        None, "EAGLE3/MTP/DFLASH/DSPARK: the drafter attends only to the last W committed positions (and its own "
        "drafts); draft KV pages behind them are freed (default: all)")
    speculative_window: str | None = _f(None, "verify-window policy (default: the algorithm's)")
    speculative_confidence_threshold: float | None = _f(None, "confidence window: keep draft positions while the "
                                                        "cumulative acceptance probability is at least this", unset=0.2)
    speculative_accept: str = _f("auto", "acceptance rule at temperature > 0 (every temperature-0 request is "
                                 "verified greedily)")
    speculative_verify_packing: str = _f("compact", "ragged verify batch: compact = windows back to back (the "
                                         "linear layers see sum(k+1) rows); padded = every window padded to the "
                                         "longest", VERIFY_PACKINGS, env_aliases=("SGLANG_RAGGED_VERIFY_MODE",))
    speculative_greedy_draft: bool | None = _f(None, "model drafters draft by argmax at every temperature "
                                               "(deterministic drafts, verified one-hot)", unset=False)
    speculative_ngram_min_match: int | None = _f(None, "NGRAM: shortest suffix to match", unset=1)
    speculative_ngram_max_match: int | None = _f(None, "NGRAM: longest suffix to match", unset=4)
    speculative_ngram_table: str | None = _f(None, "NGRAM: a corpus n-gram table directory that drafts where prompt "
                                             "lookup finds no match of --speculative-ngram-min-match (default 2 with "
                                             "a table) tokens (HYBRID over a draft model: where `cost` turns the "
                                             "model off); default: the table shipped for the target, if any; "
                                             "none = prompt lookup only")
    speculative_suffix_cache_tokens: int | None = _f(None, "NGRAM/HYBRID (so AUTO): tokens of past requests' prompts "
                                                     "and outputs the suffix index keeps for drafting (~28 bytes "
                                                     "each); 0 = no index", unset=1 << 20)
    speculative_synthetic_accept_rate: float | None = _f(None, "SYNTHETIC: probability each drafted token is the "
                                                         "target's", unset=0.7)
    speculative_draft_dtype: str | None = _f(None, "dtype of the draft model (default: the target's)",
                                             ("auto", "float32", "bfloat16", "float64"))
    speculative_draft_vocab: str | None = _f(None, "STANDALONE (and HYBRID/AUTO over a draft model): the draft model's LM head keeps only these target "
                                             "tokens (a directory from `specserve build-draft-vocab`); default: the one "
                                             "shipped for the target's tokenizer, if any; none = the full head")

    def __post_init__(self) -> None:
        if self.speculative_algorithm is not None and self.speculative_algorithm.upper() == "NONE":
            object.__setattr__(self, "speculative_algorithm", None)
        for f in dataclasses.fields(self):
            ch = f.metadata["choices"]
            if ch and getattr(self, f.name) is not None and getattr(self, f.name) not in ch:
                raise ValueError(f"--{flag(f.name)}: {getattr(self, f.name)!r} is not one of {', '.join(ch)}")
        if self.speculative_suffix_cache_tokens is not None and self.speculative_suffix_cache_tokens < 0:
            raise ValueError(f"--speculative-suffix-cache-tokens must be >= 0, got {self.speculative_suffix_cache_tokens}")
        for name in ("page_size", "max_prefill_tokens", "max_running_requests", "speculative_ngram_min_match",
                     "tp_size", "nnodes",
                     "speculative_draft_attention_window", "speculative_dspark_block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{flag(name)} must be >= 1, got {getattr(self, name)}")
        ranges = {"grammar_forced_drafts": (0, 64), "speculative_num_draft_tokens": (0, 64), "speculative_num_steps": (1, 32),
                  "speculative_eagle_topk": (1, 16), "speculative_lattice_topk": (0, 64),
                  "speculative_confidence_threshold": (0.0, 1.0), "speculative_synthetic_accept_rate": (0.0, 1.0)}
        for name, (lo, hi) in ranges.items():
            v = getattr(self, name)
            if v is not None and not lo <= v <= hi:
                raise ValueError(f"--{flag(name)} must be in [{lo}, {hi}], got {v}")
        if self.prefix_cache_dir is not None and self.disable_prefix_cache:
            raise ValueError("--prefix-cache-dir keeps the prefix cache's pages on disk: it needs the prefix cache "
                             "(drop --disable-prefix-cache)")
        if self.prefix_cache_disk_budget is not None and self.prefix_cache_dir is None:
            raise ValueError("--prefix-cache-disk-budget applies only with --prefix-cache-dir")
        if self.prefix_cache_dir is not None and self.tp_size > 1:
            raise ValueError("--prefix-cache-dir is not supported with --tp-size > 1 (rank 0's pool holds only its "
                             "shard of each page)")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}] (--nnodes {self.nnodes}), got {self.node_rank}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--dist-init-addr must be host:port, got {self.dist_init_addr!r}")
        elif self.nnodes > 1:
            raise ValueError("--dist-init-addr host:port is required with --nnodes > 1 (where rank 0 listens)")
        if self.speculative_block_size is not None and self.speculative_block_size < 2:
            raise ValueError(f"--speculative-block-size must be >= 2 (an anchor and at least one MASK), "
                             f"got {self.speculative_block_size}")
        if self.value("speculative_ngram_max_match") < (self.speculative_ngram_min_match or 1):
            raise ValueError("--speculative-ngram-max-match must be >= --speculative-ngram-min-match")

    def value(self, name: str) -> Any:
        """The field's value, or what its None default stands for."""
        v = getattr(self, name)
        return self.__dataclass_fields__[name].metadata["unset"] if v is None else v

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
            spellings = (env_name(name), *f.metadata.get("env_aliases", ()))
            src = next((e for e in spellings if e in environ), spellings[0])
            env = environ.get(src)
            if name in explicit and explicit[name] is not None:
                values[name] = explicit[name]
            elif env is not None:
                values[name] = parse_field(env, f, source=src, owner=cls)
        return cls(**values)


def flag(name: str) -> str:
    return name.replace("_", "-")


def env_name(name: str) -> str:
    return "SPECSERVE_" + name.upper()


def base_type(f: dataclasses.Field, owner: type | None = None) -> type:
    t = typing.get_type_hints(owner or EngineConfig)[f.name]
    if isinstance(t, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def parse_field(text: str, f: dataclasses.Field, source: str, owner: type | None = None) -> Any:
    """`text` (an environment variable or a `--algos` override) as the field's type; errors name `source`."""
    t = base_type(f, owner)
    try:
        return parse_bool(text) if t is bool else t(text)
    except ValueError:
        raise ValueError(f"{source}: expected {t.__name__}, got {text!r}") from None


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")
