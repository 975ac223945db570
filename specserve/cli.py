"""`specserve` command line: generate, chat (interactive), serve (HTTP), bench, train-drafter, build-ngram-table.
Engine flags come from EngineConfig."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .config import env_name
from .flags import add_engine_args, config_from_args
from .core import SamplingParams
from .server.config import add_server_args, server_config_from_args


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json-schema", default=None, help="structured output: a JSON schema (JSON text or a .json file)")
    p.add_argument("--regex", default=None, help="structured output: the output matches this regex")
    p.add_argument("--ebnf", default=None, help="structured output: a GBNF grammar (root ::= ...)")


def _text_or_file(value: str | None) -> str | None:
    from pathlib import Path

    return Path(value).read_text() if value and not value.lstrip().startswith("{") and Path(value).is_file() else value


def _params(a: argparse.Namespace) -> SamplingParams:
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                        min_p=a.min_p, repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                        frequency_penalty=a.frequency_penalty, seed=a.sampling_seed, stop=tuple(a.stop),
                        ignore_eos=a.ignore_eos, n=a.n, logprobs=a.logprobs, regex=a.regex, ebnf=a.ebnf,
                        json_schema=_text_or_file(a.json_schema))
    try:
        sp.validate()
    except ValueError as e:
        field, _, msg = str(e).partition(": ")
        raise SystemExit(f"specserve: error: --{field.replace('_', '-')}: {msg}") from None
    return sp


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint dir, .gguf file or alias (default smollm2-135m)")
    p.add_argument("--model-path", default=None, help="the model, as SGLang spells it (instead of the positional)")


def _model(a: argparse.Namespace) -> str | None:
    if a.model and a.model_path and a.model != a.model_path:
        raise SystemExit(f"specserve: error: --model-path {a.model_path!r} and the positional model {a.model!r} "
                         "differ: give one")
    return a.model or a.model_path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Speculative-decoding LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts (arguments or stdin lines)")
    _model_args(g)
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable); default: stdin lines")
    g.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    g.add_argument("--json", action="store_true", help="print one JSON object per result")
    _sampling_args(g)
    add_engine_args(g)
    c = sub.add_parser("chat", help="interactive chat on the terminal")
    _model_args(c)
    c.add_argument("--system", default=None, help="system message")
    _sampling_args(c)
    add_engine_args(c)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (see docs/server.md)")
    _model_args(s)
    add_server_args(s)
    add_engine_args(s)
    from .bench import add_bench_parser
    from .train.draft_vocab import add_args as add_vocab_args
    from .train.ngram_build import add_args as add_table_args
    from .train.trainer import add_args as add_train_args

    add_bench_parser(sub)
    t = sub.add_parser("train-drafter", help="train an EAGLE-3/MTP/DFlash/DSpark drafter for a target (see docs/training.md)")
    add_train_args(t)
    n = sub.add_parser("build-ngram-table", help="build the corpus n-gram table NGRAM drafts from (see docs/training.md)")
    add_table_args(n)
    v = sub.add_parser("build-draft-vocab", help="the N most frequent target tokens a draft model's LM head keeps "
                                                 "(--speculative-draft-vocab; see docs/speculative.md)")
    add_vocab_args(v)
    return parser


def _default_drafter(a: argparse.Namespace) -> None:
    """serve/generate/chat speculate with the shipped drafter unless told otherwise (flag or env)."""
    if a.speculative_algorithm is None and env_name("speculative_algorithm") not in os.environ:
        a.speculative_algorithm = "AUTO"


def _make_llm(a: argparse.Namespace):  # noqa: ANN202
    from .engine.llm import LLM

    _default_drafter(a)
    try:
        return LLM.from_config(config_from_args(a, _model(a)))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"specserve: error: {e}") from None


def cmd_generate(a: argparse.Namespace) -> None:
    prompts = a.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise SystemExit("specserve: error: --prompt: no prompt given (use --prompt or pipe lines on stdin)")
    sp = _params(a)
    llm = _make_llm(a)
    try:
        if a.chat_template:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp)
        else:
            outs = llm.generate(prompts, sp)
    except ValueError as e:
        field, sep, msg = str(e).partition(": ")
        flagged = field in ("json_schema", "regex", "ebnf")  # grammar errors name the sampling flag
        raise SystemExit(f"specserve: error: {'--' + field.replace('_', '-') + sep + msg if flagged else e}") from None
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            if a.json:
                print(json.dumps({"prompt": p, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason, "meta_info": c.meta_info}))
            else:
                print(f"{p}{c.text}" if not a.chat_template else c.text)
                m = c.meta_info
                extra = f", accept length {m['spec_accept_length']:.2f}" if "spec_accept_length" in m else ""
                print(f"[{m['completion_tokens']} tokens, {c.finish_reason}, "
                      f"{m['completion_tokens'] / max(m['e2e_latency'], 1e-9):.1f} tok/s{extra}]", file=sys.stderr)


def cmd_chat(a: argparse.Namespace) -> None:
    sp = _params(a)
    llm = _make_llm(a)
    history: list[dict] = [{"role": "system", "content": a.system}] if a.system else []
    print("specserve chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        out = llm.chat(history, sp)[0]
        print(out.text)
        history.append({"role": "assistant", "content": out.text})


def cmd_serve(a: argparse.Namespace) -> None:
    from .loading.checkpoint import resolve_model_path

    _default_drafter(a)
    try:  # bad flags and a missing model fail here, before the port opens
        cfg, scfg = config_from_args(a, _model(a)), server_config_from_args(a)
        resolve_model_path(cfg.model)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"specserve: error: {e}") from None
    if cfg.node_rank > 0:  # another machine of a multi-node --tp-size: only its forward workers
        from .parallel.worker import run_node

        raise SystemExit(run_node(cfg))
    from .server.app import run_server

    raise SystemExit(run_server(cfg, scfg))


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.command == "bench":
        from .bench import run_bench

        return run_bench(a)
    if a.command in ("train-drafter", "build-ngram-table", "build-draft-vocab"):
        from .train import draft_vocab, ngram_build, trainer

        try:
            {"train-drafter": trainer, "build-ngram-table": ngram_build, "build-draft-vocab": draft_vocab}[a.command].run(a)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"specserve: error: {e}") from None
        return None
    {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve}[a.command](a)


if __name__ == "__main__":
    main()
