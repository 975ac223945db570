"""Config validation driven by the drafter registry: every flag the chosen algorithm would ignore is
refused with an error naming it; the window policy's default is per algorithm; the old env-only
switches are EngineConfig fields."""
from __future__ import annotations

import dataclasses

import pytest

from specserve.config import EngineConfig
from specserve.speculative.resolve import check_config
from specserve.drafters.base import ALGORITHM_FLAGS, Capabilities, capabilities, registry
from specserve.speculative.resolve import resolve_config
from tests.tiny import tiny_config


def _not_for(algo: str, **flag: object) -> tuple[dict, str]:
    """A flag `algo` does not take, and the error naming both."""
    (name, _), = flag.items()
    return (dict(speculative_algorithm=algo, **flag),
            f"--{name.replace('_', '-')} does not apply to --speculative-algorithm {algo}")


REFUSED = [
    _not_for("NGRAM", speculative_lattice_topk=2),
    _not_for("EAGLE3", speculative_lattice_topk=0),
    _not_for("NGRAM", speculative_block_size=4),
    (dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_num_draft_tokens=3),
     "--speculative-num-steps is the chain length"),
    (dict(speculative_algorithm="DSPARK", speculative_block_size=4, speculative_num_draft_tokens=4),
     "--speculative-num-draft-tokens 4 exceeds the block"),
    (dict(speculative_algorithm="DSPARK", speculative_window="cost", speculative_confidence_threshold=0.3),
     "--speculative-confidence-threshold applies to --speculative-window confidence, not cost"),
    (dict(speculative_algorithm="NGRAM", speculative_confidence_threshold=0.3),
     "--speculative-confidence-threshold applies to --speculative-window confidence, not fixed"),
    (dict(speculative_algorithm="AUTO", speculative_confidence_threshold=0.3),
     "--speculative-confidence-threshold applies to --speculative-window confidence, not cost"),
    _not_for("DSPARK", speculative_ngram_max_match=3),
    _not_for("NGRAM", speculative_synthetic_accept_rate=0.5),
    _not_for("SYNTHETIC", speculative_draft_model_path="x"),
    _not_for("NGRAM", speculative_draft_attention_window=8),
    _not_for("DFLASH", speculative_eagle_topk=2),
    _not_for("NGRAM", speculative_greedy_draft=True),
    (dict(speculative_algorithm="NGRAM", speculative_accept="block"),
     "--speculative-accept block needs draft distributions q, but NGRAM drafts are deterministic"),
    (dict(speculative_algorithm="DSPARK", speculative_greedy_draft=True, speculative_accept="block"),
     "--speculative-greedy-draft drafts are deterministic"),
    (dict(speculative_algorithm="STANDALONE"), "STANDALONE needs --speculative-draft-model-path"),
    (dict(speculative_algorithm="BOGUS"), "--speculative-algorithm: unknown 'BOGUS'"),
    (dict(speculative_block_size=1), "--speculative-block-size must be >= 2"),
    (dict(speculative_verify_packing="ragged"), "--speculative-verify-packing: 'ragged' is not one of"),
]


@pytest.mark.parametrize("opts,msg", REFUSED)
def test_flags_that_do_not_apply_are_refused(opts: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        check_config(EngineConfig(**opts))


def test_applicable_flags_are_accepted_and_plain_decoding_ignores_them() -> None:
    check_config(EngineConfig(speculative_algorithm="DSPARK", speculative_block_size=4, speculative_num_draft_tokens=3,
                 speculative_lattice_topk=2, speculative_draft_attention_window=16, speculative_confidence_threshold=0.1))
    check_config(EngineConfig(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_greedy_draft=True))
    check_config(EngineConfig(speculative_algorithm="EAGLE3", speculative_eagle_topk=2, speculative_num_steps=3,
                 speculative_num_draft_tokens=5))
    check_config(EngineConfig(speculative_algorithm="PROMPT_LOOKUP", speculative_ngram_max_match=3, speculative_window="cost"))
    check_config(EngineConfig(speculative_algorithm="NONE", speculative_lattice_topk=4))  # plain decoding: flags are inert


def test_every_algorithm_specific_flag_is_claimed_and_refused_elsewhere() -> None:
    """The registry is the one list: each flag that only some algorithms use is claimed by at least one
    registered algorithm's capabilities and refused for at least one other."""
    claimed = {name: [a for a, e in registry().items() if name in e.caps.flags()] for name in ALGORITHM_FLAGS}
    assert all(claimed[n] and len(claimed[n]) < len(registry()) for n in ALGORITHM_FLAGS), claimed
    assert set(registry()) == {"NGRAM", "STANDALONE", "SYNTHETIC", "EAGLE3", "MTP", "DFLASH", "DSPARK", "HYBRID"}
    assert capabilities("AUTO").flags() == capabilities("HYBRID").flags() | capabilities("NGRAM").flags()


def test_a_registered_drafter_is_a_valid_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    from specserve.drafters import base

    registry()
    entry = base.DrafterEntry("TOY", lambda ctx: None, Capabilities(extra_flags=("speculative_ngram_min_match",)))
    monkeypatch.setitem(base._REGISTRY, "TOY", entry)
    assert check_config(EngineConfig(speculative_algorithm="toy", speculative_ngram_min_match=2)).speculative_algorithm == "TOY"
    with pytest.raises(ValueError, match="--speculative-ngram-max-match does not apply to --speculative-algorithm TOY"):
        check_config(EngineConfig(speculative_algorithm="TOY", speculative_ngram_max_match=2))


@pytest.mark.parametrize("algo,window", [("DSPARK", "confidence"), ("DFLASH", "fixed"), ("NGRAM", "fixed"),
                                         ("EAGLE3", "fixed")])
def test_window_policy_default_is_per_algorithm(algo: str, window: str) -> None:
    cfg = resolve_config(EngineConfig(speculative_algorithm=algo), tiny_config())
    assert cfg.speculative_window == window
    fixed = resolve_config(EngineConfig(speculative_algorithm=algo, speculative_window="fixed"), tiny_config())
    assert fixed.speculative_window == "fixed"


def test_env_only_switches_are_config_fields() -> None:
    env = {"SPECSERVE_SPECULATIVE_GREEDY_DRAFT": "1", "SPECSERVE_SPECULATIVE_VERIFY_PACKING": "padded",
           "SPECSERVE_SPECULATIVE_ALGORITHM": "DSPARK"}
    c = EngineConfig.from_sources({}, env)
    assert c.speculative_greedy_draft is True and c.speculative_verify_packing == "padded"
    assert EngineConfig.from_sources({}, {**env, "SPECSERVE_SPECULATIVE_GREEDY_DRAFT": "false"}).speculative_greedy_draft is False
    with pytest.raises(ValueError, match="SPECSERVE_SPECULATIVE_GREEDY_DRAFT"):
        EngineConfig.from_sources({}, {**env, "SPECSERVE_SPECULATIVE_GREEDY_DRAFT": "maybe"})
    assert dataclasses.replace(c, speculative_verify_packing="compact").speculative_verify_packing == "compact"


def test_greedy_acceptance_is_refused_as_a_flag() -> None:
    """Every temperature-0 request is verified greedily whatever the flag says; at T > 0 greedy acceptance
    would emit the target's argmax instead of sampling it, so no flag selects it (it used to be offered,
    sampled anyway, and be reported as greedy)."""
    from specserve.cli import build_parser

    with pytest.raises(ValueError, match="--speculative-accept greedy: runs for every temperature-0 request"):
        check_config(EngineConfig(speculative_algorithm="DSPARK", speculative_accept="greedy"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-accept", "greedy"])


def _option(name: str):  # noqa: ANN202
    from specserve.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return next(a for a in serve._actions if a.dest == name)


def test_name_lists_are_read_from_the_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered window policy, acceptance rule or drafter is a choice, a help entry and a valid config
    value, with no other list to edit."""
    from specserve.cost import policy
    from specserve.speculative import rules

    monkeypatch.setitem(policy._POLICIES, "toy", type("Toy", (policy.WindowPolicy,), {"name": "toy", "help": "TOYW"}))
    monkeypatch.setitem(rules.RULES, "toyrule", rules.AcceptRule("toyrule", rules.RULES["sample"].run, "TOYR"))
    entry = dataclasses.replace(registry()["NGRAM"], name="TOYD", aliases=("TOYALIAS",), help="TOYH")
    from specserve.drafters import base

    monkeypatch.setitem(base._REGISTRY, "TOYD", entry)
    win, acc, algo = _option("speculative_window"), _option("speculative_accept"), _option("speculative_algorithm")
    assert "toy" in win.choices and "toy = TOYW" in win.help
    assert "toyrule" in acc.choices and "toyrule = TOYR" in acc.help and "greedy" not in acc.choices
    assert "TOYD (TOYALIAS) = TOYH" in algo.help
    assert all(f"{n} (" in algo.help or f"{n} =" in algo.help for n in registry())
    cfg = check_config(EngineConfig(speculative_algorithm="toyalias", speculative_window="toy", speculative_accept="toyrule"))
    assert (cfg.speculative_algorithm, cfg.speculative_window, cfg.speculative_accept) == ("TOYD", "toy", "toyrule")
    with pytest.raises(ValueError, match="--speculative-window: 'nope' is not one of fixed, confidence, cost, toy"):
        check_config(EngineConfig(speculative_window="nope"))
