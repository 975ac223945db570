"""Speculation on mixture-of-experts targets (tiny random Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): NGRAM,
STANDALONE, EAGLE-3, DFlash, DSpark and HYBRID equal plain decoding, from the HF directory and on the integer kernels;
sampled STANDALONE speculation keeps the target's exact distribution; the prefix cache hits exactly.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from tests.families_setup import save_family_dir
from tests.models.test_families import ENGINE, spm_model  # noqa: F401  (ggufs' fixture)
from tests.models.test_moe import _tokens, dirs, ggufs  # noqa: F401  (the fixtures)
from tests.moe_setup import MOE_FAMILIES, save_moe_dir


_PLAIN: dict[str, list[list[int]]] = {}


def _plain(dirs: dict[str, str], family: str) -> list[list[int]]:
    """Plain (no speculation) greedy tokens of the family's directory, decoded once."""
    if family not in _PLAIN:
        _PLAIN[family] = _tokens(LLM(dirs[family], dtype="float32", **ENGINE))
    return _PLAIN[family]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny dense mistral of the same vocabulary and tokenizer."""
    return save_family_dir(tmp_path_factory.mktemp("draft") / "mistral", "mistral")


def _artifact(algo: str, target_dir: str, out: Path) -> str:
    """A randomly initialised learned drafter (EAGLE-3, DFlash, DSpark) for a target: its drafts are mostly
    rejected, so verify's rejection path runs every step."""
    from specserve.drafters.artifact import build_net, save_drafter
    from specserve.drafters.nets import DrafterConfig
    from specserve.loading.checkpoint import open_checkpoint

    torch.manual_seed(3)
    kind = "eagle3" if algo == "HYBRID" else algo.lower()  # HYBRID: n-grams and an EAGLE-3 head
    net = build_net(DrafterConfig.for_target(kind, open_checkpoint(target_dir).cfg))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_drafter(net, out, "", torch.float32)
    return str(out)


@pytest.mark.parametrize(("family", "algo"), [(f, "NGRAM") for f in MOE_FAMILIES]
                         + [("qwen2_moe", "STANDALONE"), ("mixtral", "STANDALONE"), ("qwen3_moe", "EAGLE3"),
                            ("olmoe", "DFLASH"), ("qwen2_moe", "DSPARK"), ("mixtral", "HYBRID")])
def test_speculation_equals_plain(dirs: dict[str, str], draft_dir: str, tmp_path: Path, family: str,
                                  algo: str) -> None:
    """A draft's windows (a tiny dense mistral's for STANDALONE; a random learned drafter reading the MoE
    target's hidden states) verified on an MoE target: plain's tokens."""
    plain = _plain(dirs, family)
    path = draft_dir if algo == "STANDALONE" else None if algo == "NGRAM" else _artifact(algo, dirs[family], tmp_path)
    draft = {"speculative_draft_model_path": path} if path else {}
    llm = LLM(dirs[family], dtype="float32", speculative_algorithm=algo, speculative_num_draft_tokens=3,
              speculative_window="fixed", **draft, **ENGINE)
    assert _tokens(llm) == plain


def test_speculation_on_the_integer_kernels_equals_plain(ggufs) -> None:  # noqa: ANN001
    """A w8a8 MoE target: verify windows run the experts on their rows and give decode's bits, so NGRAM's
    output is plain's."""
    path = ggufs("qwen2_moe", "q8_0")
    plain = _tokens(LLM(path, **ENGINE))
    llm = LLM(path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, speculative_window="fixed",
              **ENGINE)
    assert _tokens(llm) == plain
    assert llm.engine.stats.num_accepted_tokens > 0


def test_prefix_cache_hit_equals_cold(dirs: dict[str, str]) -> None:
    """A second prompt sharing a cached prefix reads its pages and decodes as with no cache (the KV of an MoE
    layer's attention is the same as a dense one's)."""
    shared = [(7 * i + 3) % 128 for i in range(23)]
    prompts = [shared + [1, 2, 3], shared + [4, 5]]
    cold = _tokens(LLM(dirs["qwen2_moe"], dtype="float32", disable_prefix_cache=True, **ENGINE), prompts)
    warm = LLM(dirs["qwen2_moe"], dtype="float32", **ENGINE)
    first, second = _tokens(warm, prompts[:1]), _tokens(warm, prompts[1:])
    assert warm.engine.kv.prefix_cache.stats.hit_tokens >= 20
    assert first + second == cold


@pytest.mark.slow
def test_sampled_standalone_speculation_matches_the_moe_targets_distribution(tmp_path: Path) -> None:
    """At T > 0, a dense draft's sampled windows verified on a Qwen2-MoE target (fp64, a 3-token vocabulary):
    the engine's joint over 5 tokens is the target's exact joint."""
    from tests.dist import engine_vs_exact_joint
    from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

    target = save_moe_dir(tmp_path / "t", "qwen2_moe", seed=1, vocab=3, dtype=torch.float64)
    cfg = tiny_config("llama", vocab=3)
    draft = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=12), tmp_path / "d")
    llm = LLM(target, dtype="float64", speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
              speculative_num_draft_tokens=3, max_running_requests=256)
    fit = engine_vs_exact_joint(llm, [1, 2], 5, SamplingParams(temperature=6.0, max_tokens=5, top_p=0.95), 2500)
    assert fit.ok, fit
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0
