"""The prefix cache's disk tier in the engine (--prefix-cache-dir): an engine built later on the same directory
serves the prefixes an earlier one computed (target pool and draft pools), with the cold prefill's output; files of
another model or layout are not read; damaged files are ignored with a warning (output unchanged); the directory
stays under its budget; the flag is refused where it cannot apply."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from specserve.cache.prefix_cache import extend_page_keys
from specserve.cli import build_parser
from specserve.config import EngineConfig
from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from specserve.flags import config_from_args
from tests.drafter_setup import _spec_llm  # noqa: F401  (the `trained` fixture: conftest.py)
from tests.engine.test_prefix_engine import BOUND, SP, _same_drafting, assert_clean, assert_same, one_by_one, shared_prompts
from tests.hybrid_setup import tiny_hybrid
from tests.tiny import target_and_draft_dirs, tiny_model

OPTS = dict(page_size=4, kv_cache_memory="256KiB", max_prefill_tokens=11)


def disk_llm(d: Path, seed: int = 0, **kw) -> LLM:  # noqa: ANN003
    return LLM.from_model(tiny_model("llama", seed=seed), **{**OPTS, "prefix_cache_dir": str(d), **kw})


def cold(prompts: list[list[int]], seed: int = 0, sp: SamplingParams = SP, **kw) -> list:  # noqa: ANN003
    return one_by_one(LLM.from_model(tiny_model("llama", seed=seed), **{**OPTS, **kw}, disable_prefix_cache=True),
                      prompts, sp)


def page_files(d: Path) -> list[Path]:
    return sorted(d.rglob("*.page"))


def test_a_restart_serves_the_prefix_from_disk(tmp_path: Path) -> None:
    prompts = shared_prompts()
    first = disk_llm(tmp_path)
    out0 = one_by_one(first, prompts[:1])
    first.close()  # its queued pages written
    assert first.engine.prefix.cache.disk.stats.saved == len(page_files(tmp_path)) > 9
    again = disk_llm(tmp_path)  # a new engine, a new model object: the same weights
    hot = one_by_one(again, prompts[1:])
    assert [o.meta_info["cached_tokens"] for o in hot] == [36] * 4  # the first from disk, the rest from RAM
    assert again.engine.prefix.stats.disk_pages == 9
    assert_same(out0 + hot, cold(prompts), BOUND["float64"])
    # the same prompt as before: its pages and its answer's, all from disk in a third engine
    again.close()
    third = disk_llm(tmp_path)
    same = one_by_one(third, prompts[:1])
    assert same[0].meta_info["cached_tokens"] == (len(prompts[0]) - 1) // 4 * 4
    assert_same(same, out0, BOUND["float64"])
    assert_clean(third.engine)
    third.close()


def test_files_of_another_model_or_layout_are_not_read(tmp_path: Path) -> None:
    prompts = shared_prompts(n=2)
    one_by_one(disk_llm(tmp_path), prompts[:1])[0]
    others = [(lambda: tiny_model("llama", seed=1), OPTS), (tiny_model, {**OPTS, "page_size": 8}),
              (lambda: tiny_model("llama", dtype=torch.float32), OPTS)]  # weights, page size, dtype
    for model, opts in others:
        llm = LLM.from_model(model(), **opts, prefix_cache_dir=str(tmp_path))
        out = one_by_one(llm, prompts[1:])
        assert out[0].meta_info["cached_tokens"] == 0 and llm.engine.prefix.stats.disk_pages == 0
        assert_same(out, one_by_one(LLM.from_model(model(), **opts, disable_prefix_cache=True), prompts[1:]))
        llm.close()
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 4  # one namespace per fingerprint, side by side


def test_damaged_files_are_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    prompts = shared_prompts()
    first = disk_llm(tmp_path)
    one_by_one(first, prompts[:1])
    first.close()
    ns = first.engine.prefix.cache.disk.ns
    keys = extend_page_keys(prompts[1], [], 4, 9)
    path = lambda i: first.engine.prefix.store.path(ns, keys[i])  # noqa: E731
    raw = bytearray(path(5).read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of the K/V
    path(5).write_bytes(raw)
    caplog.set_level(logging.WARNING, logger="specserve")
    llm = disk_llm(tmp_path)
    out = one_by_one(llm, prompts[1:2])
    assert out[0].meta_info["cached_tokens"] == 20 and "fails its checksum" in caplog.text  # pages 0-4 read
    assert_same(out, cold(prompts[1:2]), BOUND["float64"])
    llm.close()  # page 5 was computed again and written again
    path(2).write_bytes(path(2).read_bytes()[:100])
    caplog.clear()
    llm = disk_llm(tmp_path)
    out = one_by_one(llm, prompts[2:3])
    assert out[0].meta_info["cached_tokens"] == 8 and "truncated" in caplog.text  # pages 0-1 read
    assert_same(out, cold(prompts[2:3]), BOUND["float64"])
    llm.close()
    assert path(2).stat().st_size > 100  # computed again, written again


def test_the_directory_stays_under_its_budget(tmp_path: Path) -> None:
    prompts = shared_prompts(seed=4, n=6, stem=20)
    budget = 20 * 1024  # ~18 tiny pages (1,080 bytes each)
    llm = disk_llm(tmp_path, prefix_cache_disk_budget="20KiB")
    one_by_one(llm, prompts)
    llm.close()
    store = llm.engine.prefix.store
    assert store.stats.evicted > 0 and sum(p.stat().st_size for p in page_files(tmp_path)) <= budget
    again = disk_llm(tmp_path, prefix_cache_disk_budget="20KiB")
    assert_same(one_by_one(again, prompts[-1:]), cold(prompts[-1:]), BOUND["float64"])
    again.close()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return target_and_draft_dirs(tmp_path_factory.mktemp("models"))


def test_a_draft_models_pool_survives_a_restart(dirs: dict[str, str], tmp_path: Path) -> None:
    prompts = [p + p[-6:] for p in shared_prompts(seed=1, n=3)]
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=1)

    def make(**kw) -> LLM:  # noqa: ANN003
        return LLM(dirs["target"], dtype="float64", speculative_algorithm="STANDALONE", speculative_num_draft_tokens=3,
                   speculative_draft_model_path=dirs["small"], page_size=4, **kw)

    first = make(prefix_cache_dir=str(tmp_path))
    one_by_one(first, prompts[:1], sp)
    first.close()
    llm = make(prefix_cache_dir=str(tmp_path))
    hot = one_by_one(llm, prompts[1:], sp)
    want = one_by_one(make(disable_prefix_cache=True), prompts[1:], sp)
    assert_same(hot, want)
    _same_drafting(hot, want)
    assert hot[0].meta_info["cached_tokens"] == 36 and llm.engine.drafter.prefix.cache.stats.disk_pages == 9
    assert_clean(llm.engine)
    llm.close()


@pytest.mark.parametrize("algo", ["eagle3", "dspark"])
def test_a_learned_drafters_pool_survives_a_restart(trained: dict, algo: str, tmp_path: Path) -> None:
    """EAGLE-3 keeps a feature with each page (its extra, saved with the page); DSpark keeps none."""
    prompts = shared_prompts(seed=2, n=3)
    sp = SamplingParams(temperature=0, max_tokens=20, logprobs=1)
    first = _spec_llm(trained, algo, page_size=4, prefix_cache_dir=str(tmp_path))
    one_by_one(first, prompts[:1], sp)
    first.close()
    llm = _spec_llm(trained, algo, page_size=4, prefix_cache_dir=str(tmp_path))
    hot = one_by_one(llm, prompts[1:], sp)
    want = one_by_one(_spec_llm(trained, algo, page_size=4, disable_prefix_cache=True), prompts[1:], sp)
    assert_same(hot, want)
    _same_drafting(hot, want)
    assert hot[0].meta_info["cached_tokens"] == 36 and llm.engine.drafter.prefix.cache.stats.disk_pages == 9
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2  # the target's pool and the drafter's
    assert_clean(llm.engine)
    llm.close()


def test_the_flags_are_refused_where_they_cannot_apply(tmp_path: Path) -> None:
    d = str(tmp_path)
    args = build_parser().parse_args(["serve", "m", "--prefix-cache-dir", d, "--disable-prefix-cache"])
    with pytest.raises(ValueError, match="--prefix-cache-dir.*--disable-prefix-cache"):
        config_from_args(args, "m")
    with pytest.raises(ValueError, match="--prefix-cache-dir.*--disable-prefix-cache"):
        LLM.from_model(tiny_model("llama"), prefix_cache_dir=d, disable_prefix_cache=True)
    with pytest.raises(ValueError, match="--prefix-cache-disk-budget applies only with --prefix-cache-dir"):
        EngineConfig(prefix_cache_disk_budget="1GB")
    with pytest.raises(ValueError, match="--prefix-cache-dir is not supported with --tp-size"):
        EngineConfig(prefix_cache_dir=d, tp_size=2)
    with pytest.raises(ValueError, match="--prefix-cache-disk-budget.*not a size"):
        LLM.from_model(tiny_model("llama"), prefix_cache_dir=d, prefix_cache_disk_budget="0.5")
    with pytest.raises(ValueError, match="--prefix-cache-dir.*hybrid"):
        LLM.from_model(tiny_hybrid(), prefix_cache_dir=d)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--prefix-cache-dir .*file"):  # not a directory
        LLM.from_model(tiny_model("llama"), prefix_cache_dir=str(tmp_path / "file"))
    env = EngineConfig.from_sources({}, {"SPECSERVE_PREFIX_CACHE_DIR": d, "SPECSERVE_PREFIX_CACHE_DISK_BUDGET": "2GB"})
    assert (env.prefix_cache_dir, env.prefix_cache_disk_budget) == (d, "2GB")
    assert EngineConfig().value("prefix_cache_disk_budget") == "4GiB"
