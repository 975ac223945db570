"""Speculative settings resolved in one place.

`spec_settings` is the one source of K (--speculative-num-draft-tokens), the chain/tree depth and width, the
block size and the verify-window policy: their defaults and every check between them. It runs in
`check_config` (what the flags alone decide, with every other check that reads a registry) and again when the
engine is built, with the drafter artifact's trained block read (`resolve_settings`). `resolve_config` makes
AUTO and the default window concrete.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import EngineConfig
from ..drafters.artifact import is_drafter_artifact, learned_artifact, read_config, shipped_drafter
from ..drafters.base import (AUTO_ARTIFACT, CAP_FLAGS, TREE_NODES, TREE_STEPS, canonical_algorithm, capabilities,
                             default_window, validate_flags)
from ..drafters.context import SpecSettings
from ..drafters.nets import DrafterConfig
from ..drafters.ngram_table import shipped_table
from ..models.config import ModelConfig
from ..cost.policy import policy_names
from .rules import RULES, check_rule

DEFAULT_NUM_DRAFT_TOKENS = 4  # chains without a depth, and drafters without a shape of their own


def block_size(c: EngineConfig) -> int | None:
    """--speculative-block-size (rows, anchor included), or SGLang's --speculative-dspark-block-size (drafts,
    the anchor not counted: SGLang's 8 is our 9)."""
    if c.speculative_dspark_block_size is not None:
        return c.speculative_dspark_block_size + 1
    return c.speculative_block_size


def spec_settings(c: EngineConfig, trained: DrafterConfig | None = None, path: Path | None = None) -> SpecSettings:
    """`trained`: the config of the learned artifact the drafter will load (None: not read yet, or none)."""
    algo = c.speculative_algorithm
    caps = capabilities(algo)
    trained = trained if caps.block or caps.tree else None  # NOTE: an artifact of another kind is refused on load
    k, b = c.speculative_num_draft_tokens, block_size(c)
    if c.speculative_block_size is not None and c.speculative_dspark_block_size is not None:
        raise ValueError("--speculative-block-size counts the anchor, --speculative-dspark-block-size (SGLang's) does "
                         "not: give one of them")
    if trained is not None and not trained.is_block and caps.block:
        given = [f for f in ("speculative_block_size", "speculative_dspark_block_size", "speculative_lattice_topk")
                 if getattr(c, f) is not None]
        if given:  # HYBRID over a chain drafter: its block flags have no block to shape
            raise ValueError(f"--{given[0].replace('_', '-')} applies to block drafters (DFLASH, DSPARK); {path} is "
                             f"an {trained.algorithm.upper()} drafter (chains)")
    block = trained is not None and trained.is_block and caps.block
    if block:
        B, sg = trained.block_size, c.speculative_dspark_block_size
        if b is not None and b > B:
            given = f"--speculative-dspark-block-size {sg}" if sg is not None else f"--speculative-block-size {b}"
            allowed = f"[1, {B - 1}]" if sg is not None else f"[2, {B}]"
            raise ValueError(f"{given}: this drafter was trained with block size {B} (the anchor and {B - 1} drafts); "
                             f"use a value in {allowed}")
        b = B if b is None else b
    if k is not None and b is not None and k > b - 1:
        raise ValueError(f"--speculative-num-draft-tokens {k} exceeds the block: a block of {b} drafts at most {b - 1}")
    topk = c.value("speculative_eagle_topk")
    if topk == 1 and c.speculative_num_steps is not None and k is not None:
        raise ValueError("--speculative-num-steps is the chain length, which --speculative-num-draft-tokens already "
                         "sets (give one of them)")
    steps = c.speculative_num_steps or (TREE_STEPS if topk > 1 else 0)
    if topk > 1 and k is not None and not 1 <= k <= topk + (steps - 1) * topk * topk:
        raise ValueError(f"--speculative-num-draft-tokens must be in [1, {topk + (steps - 1) * topk * topk}] for a "
                         f"tree of depth {steps} and topk {topk}, got {k}")
    if k is None:
        k = b - 1 if block else TREE_NODES if topk > 1 else steps or DEFAULT_NUM_DRAFT_TOKENS
    return SpecSettings(k, steps, topk, b if block else None, c.speculative_window or default_window(algo))


def check_config(c: EngineConfig) -> EngineConfig:
    """The checks that read a registry, naming the flag: the acceptance rule (a rule no flag selects is refused
    with its reason), the window policy, the algorithm (returned under its registered name: aliases, any case)
    and, with one, every flag it would ignore and the settings' checks. NOTE: every entry point runs it (the CLI's
    flags, `LLM`, the engine builder); EngineConfig itself checks only what its own fields decide."""
    check_rule(c.speculative_accept)
    if c.speculative_window is not None and c.speculative_window not in policy_names():
        raise ValueError(f"--speculative-window: {c.speculative_window!r} is not one of {', '.join(policy_names())}")
    if c.speculative_algorithm is None:  # plain decoding ignores the speculative flags
        return c
    c = dataclasses.replace(c, speculative_algorithm=canonical_algorithm(c.speculative_algorithm))
    validate_speculative(c)
    return c


def validate_speculative(c: EngineConfig) -> None:
    """Config time: the flags the algorithm ignores (drafters/base.py), the acceptance rule against its drafts,
    and the settings' checks that need no artifact."""
    validate_flags(c)
    caps, rule = capabilities(c.speculative_algorithm), RULES.get(c.speculative_accept)
    deterministic = (not caps.samples or c.value("speculative_greedy_draft") or c.value("speculative_lattice_topk"))
    if rule is not None and rule.requires_q and deterministic:
        why = ("--speculative-lattice-topk drafts" if c.value("speculative_lattice_topk") else
               "--speculative-greedy-draft drafts" if c.value("speculative_greedy_draft") else
               f"{c.speculative_algorithm} drafts")
        raise ValueError(f"--speculative-accept {rule.name} needs draft distributions q, but {why} are deterministic "
                         "(verified one-hot); use auto or onehot")
    if rule is not None and rule.chains_only and c.value("speculative_eagle_topk") > 1:
        raise ValueError(f"--speculative-accept {rule.name} verifies chains; trees (--speculative-eagle-topk > 1) "
                         "use their own lossless walk: use auto")
    spec_settings(c)


def resolve_settings(c: EngineConfig, target: ModelConfig) -> SpecSettings:
    """Engine build time (`c` resolved): the settings with the learned artifact's trained shape."""
    trained, path = None, None
    caps = capabilities(c.speculative_algorithm)
    if caps.block or caps.tree:  # a learned drafter's artifact (STANDALONE loads a model of its own)
        path = learned_artifact(c, target, c.speculative_algorithm)
        if path is not None and c.speculative_algorithm == "HYBRID" and not is_drafter_artifact(path):
            path = None  # HYBRID over a draft model: chains of --speculative-num-draft-tokens
            block_flags = [f for f in CAP_FLAGS["block"] if getattr(c, f) is not None]
            if block_flags:
                raise ValueError(f"--{block_flags[0].replace('_', '-')} applies to block drafters (DFLASH, DSPARK); "
                                 f"{c.speculative_draft_model_path} is a draft model (chains)")
        elif c.speculative_algorithm == "HYBRID" and c.speculative_draft_vocab is not None:
            raise ValueError("--speculative-draft-vocab applies to a draft model's LM head (STANDALONE, or HYBRID/AUTO "
                             "over --speculative-draft-model-path MODEL); HYBRID here drafts with "
                             f"{path or 'the shipped learned drafter'}")
        trained = read_config(path) if path is not None else None
    return spec_settings(c, trained, path)


def auto_algorithm(config: EngineConfig, target: ModelConfig) -> str:
    """NGRAM over the table shipped for the target, else HYBRID over its shipped DSpark, else NGRAM's prompt
    lookup alone (any target: under `cost` windows it drafts only where lookups measure faster than plain).
    A flag only one of them takes picks that one (--speculative-draft-model-path: HYBRID over that draft model or
    drafter); flags of both are refused by name."""
    def given(algo: str, other: str) -> list[str]:
        own = capabilities(algo).flags() - capabilities(other).flags()
        return sorted(f for f in own if getattr(config, f) is not None)

    ngram, hybrid = given("NGRAM", "HYBRID"), given("HYBRID", "NGRAM")
    if ngram and hybrid:
        raise ValueError(f"--speculative-algorithm AUTO: --{ngram[0].replace('_', '-')} (NGRAM) and "
                         f"--{hybrid[0].replace('_', '-')} (HYBRID) choose different drafters; name one")
    if ngram or (not hybrid and shipped_table(target) is not None):
        return "NGRAM"
    return "HYBRID" if hybrid or shipped_drafter(target, AUTO_ARTIFACT) is not None else "NGRAM"


def resolve_config(config: EngineConfig, target: ModelConfig) -> EngineConfig:
    algo = config.speculative_algorithm
    if algo is None:
        return config
    window = spec_settings(config).window
    if algo == "AUTO":
        algo = auto_algorithm(config, target)
    return dataclasses.replace(config, speculative_algorithm=algo, speculative_window=window)
