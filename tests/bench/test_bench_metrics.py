"""Benchmark arithmetic on recorded inputs: acceptance length counts the bonus; ITL is per token."""
from __future__ import annotations

import json

import pytest

from specserve.bench.metrics import acceptance, per_token_itl, percentiles, tpot
from specserve.bench.workloads import from_jsonl


def test_acceptance_length_includes_bonus() -> None:
    # two requests: 3 verify forwards accepting 2, 0, 4 drafts (K=4); 1 forward accepting 1
    metas = [
        {"spec_verify_ct": 3, "spec_accepted_tokens": 6, "spec_draft_tokens": 12, "spec_accepted_per_pos": [2, 2, 1, 1]},
        {"spec_verify_ct": 1, "spec_accepted_tokens": 1, "spec_draft_tokens": 4, "spec_accepted_per_pos": [1]},
    ]
    r = acceptance(metas)
    assert r["accept_length"] == pytest.approx(1 + 7 / 4)  # tokens per verify forward, bonus included
    assert r["draft_acceptance_rate"] == pytest.approx(7 / 16)
    assert r["per_position"] == pytest.approx([3 / 4, 2 / 4, 1 / 4, 1 / 4])


def test_acceptance_without_speculation_is_one() -> None:
    assert acceptance([{"completion_tokens": 5}])["accept_length"] == 1.0


def test_itl_is_per_token_not_per_chunk() -> None:
    # first chunk at 1.0 s with 1 token, then a 3-token chunk 0.3 s later, then 1 token 0.1 s later
    itl = per_token_itl([1.0, 1.3, 1.4], [1, 3, 1])
    assert itl == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert len(itl) == 4  # one gap per token after the first


def test_itl_first_chunk_with_many_tokens() -> None:
    assert per_token_itl([0.5, 0.7], [2, 2]) == pytest.approx([0.0, 0.1, 0.1])


def test_tpot_and_percentiles() -> None:
    assert tpot(e2e=2.0, ttft=0.5, completion_tokens=4) == pytest.approx(0.5)
    assert tpot(1.0, 1.0, 1) is None
    p = percentiles([float(x) for x in range(1, 101)])
    assert p["p50"] == pytest.approx(50.0, abs=1) and p["p99"] == pytest.approx(99.0, abs=1)


def test_jsonl_prompts(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hello"}) + "\n\n" + json.dumps({"prompt": "bye", "x": 1}) + "\n")
    assert from_jsonl(str(f), "prompt") == [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "bye"}]]
    with pytest.raises(ValueError, match="--prompt-field"):
        from_jsonl(str(f), "question")


def test_spec_metrics_scrape_parses_prometheus_text() -> None:
    from specserve.bench.serving import parse_spec_metrics

    text = """# HELP specserve:spec_decode_num_drafts_total Verify passes
specserve:spec_decode_num_drafts_total{model_name="m"} 10.0
specserve:spec_decode_num_accepted_tokens_total{model_name="m"} 17.0
specserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0
vllm:spec_decode_num_draft_tokens_total{model_name="x"} 4e1
"""
    assert parse_spec_metrics(text) == {"spec_decode_num_drafts": 10.0, "spec_decode_num_accepted_tokens": 17.0,
                                        "spec_decode_num_draft_tokens": 40.0}


def test_bench_verify_runs_both_packings_on_the_same_batch(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """`bench verify` on a tiny target: both modes time the same ragged batch; token counts add up."""
    from specserve.bench.verify_cost import run
    from specserve.cli import build_parser
    from specserve.engine.llm import LLM
    from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

    cfg = tiny_config(layers=2)
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, 0), tmp_path / "t")
    a = build_parser().parse_args(["bench", "verify", target, "--batch-sizes", "3", "--context", "20",
                                   "--max-window", "4", "--repeats", "1", "--output", str(tmp_path / "v.json")])
    rows: list[int] = []  # tokens each timed target forward actually ran through its first layer
    from_config = LLM.from_config

    def counted(config):  # noqa: ANN001, ANN202
        llm = from_config(config)
        llm.engine.model.layers[0].register_forward_hook(lambda m, args, out: rows.append(out.shape[0]))
        return llm

    monkeypatch.setattr(LLM, "from_config", staticmethod(counted))
    res = run(a)
    assert res["3-mixed"]["tokens_compact"] == 1 + 2 + 3 and res["3-mixed"]["tokens_padded"] == 3 * 3
    assert res["3-uniform"]["tokens_compact"] == res["3-uniform"]["tokens_padded"] == 15
    # each mode's forwards ran the token count it reports (warm-up + 1 repeat, modes interleaved):
    # fails if both "modes" time the same packing (e.g. the mode argument is ignored) or the batch differs
    assert rows == [6, 9, 6, 9] + [15] * 4
    assert all(r["padded_over_compact"] == pytest.approx(r["padded_ms"] / r["compact_ms"]) for r in res.values())
    assert json.loads((tmp_path / "v.json").read_text())["results"] == json.loads(json.dumps(res))


def test_bench_speed_algos_take_per_configuration_overrides(tmp_path) -> None:  # noqa: ANN001
    from specserve.bench.speed import _engines
    from specserve.cli import build_parser
    from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

    cfg = tiny_config(layers=2)
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, 0), tmp_path / "t")
    a = build_parser().parse_args(["bench", "speed", target, "--algos", "plain", "NGRAM+cost:speculative-num-draft-tokens=2",
                                   "--speculative-num-draft-tokens", "5"])
    engines = _engines(a)
    assert list(engines) == ["specserve plain", "specserve NGRAM+cost:num-draft-tokens=2"]
    eng = engines["specserve NGRAM+cost:num-draft-tokens=2"].engine
    assert eng.num_draft_tokens == 2 and eng.config.speculative_window == "cost"
    a.algos = ["NGRAM:no-such-flag=1"]
    with pytest.raises(ValueError, match="not flag=value for an engine flag"):
        _engines(a)
    a.algos = ["NGRAM:speculative-num-draft-tokens=x"]
    with pytest.raises(ValueError, match="expected int"):
        _engines(a)


def test_machine_record_names_cpu_and_kernel_paths() -> None:
    import json

    from specserve.bench.machine import _cpuinfo, machine_info

    info = machine_info()
    model, flags = _cpuinfo()
    assert info["cpu_model"] == model and info["cpu_model"]
    assert set(info["cpu_flags"]) <= flags  # only flags this CPU really has
    assert ("avx512_vnni" in info["cpu_flags"]) == ("avx512_vnni" in flags)
    assert info["torch_threads"] >= 1 and set(info["torch_usable"]) >= {"vnni", "amx_tile"}
    assert 0.1 < info["read_bandwidth_gbs"] < 10_000  # measured by the same run: ratios need their machine
    # the integer kernels' paths: AVX-512-VNNI and AVX2 where the CPU has them (never the portable loops there)
    isa = info["qgemm_isa"].split("+")
    assert ("avx512vnni" in isa) == ("avx512_vnni" in flags) and ("avx2" in isa) == ("avx2" in flags)
    json.dumps(info)  # lands in every result JSON
