"""`specserve bench agentic --record FILE`: the model works HumanEval tasks as a tool loop (agent_tasks.py),
in-process and greedy, with the server's own prompt rendering (tools.chat_prompt: the chat template's `tools`, or
the fallback) and tool-call parsing (`--tool-call-parser`'s format read off the template; a call written as a
fenced JSON block is taken too). Each turn's prompt ids and output ids are written, so a replay sends every engine
the same tokens."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..core import SamplingParams
from ..server.text import TextStream
from ..server.tool_parsers import detect_format, hidden_markers
from ..server.tools import ToolPlan, chat_prompt, split_tool_calls
from .agent_tasks import TOOLS, Task, fenced_calls, humaneval_tasks
from .machine import machine_info


def converse(llm: Any, task: Task, max_turns: int, max_tokens: int) -> dict[str, Any]:
    """One task's conversation: each assistant turn's prompt and output ids, and the messages."""
    tok = llm.tokenizer
    fmt, plan = detect_format(tok.chat_template), ToolPlan(tuple(TOOLS), "auto")
    markers = hidden_markers(tok, fmt)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    messages, turns = task.first_messages(), []
    for turn in range(max_turns):
        ids = tok.encode(chat_prompt(tok, messages, True, plan, fmt), add_special_tokens=False)
        out = llm.generate([ids], sp)[0]
        turns.append({"prompt_ids": ids, "output_ids": list(out.token_ids)})
        ts = TextStream(tok, keep=markers)  # the format's marker tokens spelled out, as the server does
        ts.ids = list(out.token_ids)
        content, parsed = split_tool_calls(ts.final_text(None), plan, fmt)
        calls = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed]
        if not calls:  # a call written outside the template's format, as small models do
            content, fenced = fenced_calls(content)
            calls = [(f"call_{turn}_{i}", name, args) for i, (name, args) in enumerate(fenced)]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": name, "arguments": args}}
                                     for i, name, args in calls]
        messages.append(message)
        for i, name, args in calls:
            messages.append({"role": "tool", "tool_call_id": i, "content": task.call(name, args)})
        if not calls:
            messages.append({"role": "user", "content": task.without_call(content)})
        if task.passed:
            break
    return {"task_id": task.task_id, "split": task.split, "passed": task.passed, "turns": turns,
            "messages": messages}


def record_tool_loop(a: argparse.Namespace) -> dict[str, Any]:
    from ..engine.llm import LLM

    if not a.model:
        raise ValueError("--record needs --model (a GGUF path or a model name)")
    tasks = humaneval_tasks()[: a.num_tasks]
    llm = LLM(a.model, speculative_algorithm="AUTO", num_threads=a.num_threads)
    convs = []
    t0 = time.perf_counter()
    for i, task in enumerate(tasks):
        convs.append(converse(llm, task, a.max_turns, a.max_new_tokens))
        c = convs[-1]
        print(f"[{i + 1}/{len(tasks)}] {task.task_id} ({task.split}): {len(c['turns'])} turns, "
              f"{sum(len(t['output_ids']) for t in c['turns'])} tokens, tests {'pass' if c['passed'] else 'fail'}")
    llm.close()
    doc = {"model": Path(a.model).name, "tool_format": type(detect_format(llm.tokenizer.chat_template)).__name__,
           "max_turns": a.max_turns, "max_new_tokens": a.max_new_tokens, "record_s": time.perf_counter() - t0,
           "machine": machine_info(), "conversations": convs}
    out = Path(a.record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, separators=(",", ":")))
    print(f"wrote {out}: {len(convs)} conversations, {sum(len(c['turns']) for c in convs)} turns")
    return doc
