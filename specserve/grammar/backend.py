"""Grammar backends: what a request's grammar is (`GrammarSpec`), one matcher per request (`Matcher`),
and the compiler that turns specs into matchers (`GrammarCompiler`: a backend from the registry, a
cache of compiled grammars, size limits).

NOTE: compilation happens in `Engine.add_request` (a bad grammar is a ValueError there: HTTP 400 with
the backend's reason), never inside the engine step.
"""
from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

KINDS = ("json_schema", "regex", "ebnf")
MAX_SOURCE_CHARS = 256 * 1024  # a grammar larger than this is refused before compiling
CACHE_SIZE = 256  # compiled grammars kept (LRU): repeated schemas compile once


class GrammarError(ValueError):
    """A grammar that does not compile, or a token the grammar rejects."""


@dataclass(frozen=True)
class GrammarSpec:
    """kind: json_schema (source = the schema as JSON text) | regex | ebnf (GBNF: `root ::= ...`)."""

    kind: str
    source: str
    field: str  # the request field it came from, for error messages

    @staticmethod
    def from_params(params: Any) -> "GrammarSpec | None":  # noqa: ANN401 - SamplingParams (core imports us)
        """The one grammar of a SamplingParams (validate() has checked there is at most one), or None."""
        rf = params.response_format
        if rf is not None and rf.get("type", "text") != "text":
            if rf["type"] == "json_object":
                return GrammarSpec("json_schema", '{"type": "object"}', "response_format")
            schema = (rf.get("json_schema") or {}).get("schema")
            return GrammarSpec("json_schema", json.dumps(schema if schema is not None else {}), "response_format")
        for kind in KINDS:
            value = getattr(params, kind)
            if value is not None:
                return GrammarSpec(kind, value, kind)
        return None


def check_grammar_fields(params: Any) -> None:  # noqa: ANN401 - SamplingParams
    """SamplingParams.validate's grammar part: at most one grammar, each well-formed (ValueError "field: …").
    Whether it compiles is the backend's to say, at add_request."""
    def bad(field_: str, msg: str) -> None:
        raise ValueError(f"{field_}: {msg}")

    rf = params.response_format
    if rf is not None:
        kind = rf.get("type", "text") if isinstance(rf, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            bad("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
                bad("response_format", "json_schema must be an object with a 'schema' object")
    given = [n for n in KINDS if getattr(params, n) is not None]
    if rf is not None and rf.get("type", "text") != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        bad(given[1], f"only one of response_format, json_schema, regex, ebnf per request (got {', '.join(given)})")
    for n in KINDS:
        v = getattr(params, n)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            bad(n, "must be a non-empty string")
    if params.json_schema is not None:
        try:
            json.loads(params.json_schema)
        except ValueError as e:
            bad("json_schema", f"not valid JSON: {e}")


class Matcher(ABC):
    """One request's grammar state over token ids.

    NOTE: the engine advances a request's matcher only in the commit stage, one emitted token at a
    time (`accept`); every other reader (the draft cut, the verify masks, drafters) looks ahead with
    `try_accept` and undoes it with `rollback` before returning (grammar/ops.py), so the state always
    equals the emitted output. A terminated matcher is never asked for a mask.
    """

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one token; False if the grammar rejects it (the matcher is then unusable)."""

    @abstractmethod
    def try_accept(self, tokens: list[int]) -> int:
        """Advance by the longest grammar-valid prefix of `tokens`; returns its length."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""

    @abstractmethod
    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar allows next."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing further (the request ends here)."""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (exactly one continuation allowed); [] if none or unknown."""
        return []


class GrammarBackend(ABC):
    """Compiles specs for one tokenizer. `compile` raises GrammarError with the reason."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:  # noqa: ANN401
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:  # noqa: ANN401 - the backend's compiled grammar
        ...

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:  # noqa: ANN401
        ...


_BACKENDS: dict[str, type[GrammarBackend]] = {}
_MODULES = {"llguidance": "llguidance_backend", "xgrammar": "xgrammar_backend"}


def register_backend(name: str) -> Callable[[type[GrammarBackend]], type[GrammarBackend]]:
    def deco(cls: type[GrammarBackend]) -> type[GrammarBackend]:
        _BACKENDS[name] = cls
        return cls

    return deco


def backend_class(name: str) -> type[GrammarBackend]:
    if name not in _MODULES:
        raise ValueError(f"--grammar-backend: unknown {name!r}; choose one of {', '.join(_MODULES)}")
    try:
        importlib.import_module(f"{__package__}.{_MODULES[name]}")
    except ImportError as e:
        hint = "reinstall specserve" if name == "llguidance" else f"pip install 'specserve[{name}]'"
        raise ValueError(f"--grammar-backend {name}: not installed ({e}); {hint}") from None
    return _BACKENDS[name]


class GrammarCompiler:
    """The engine's grammar front door: spec → fresh matcher, compiled grammars cached (LRU). The backend is
    built at the first grammar (most engines never see one)."""

    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:  # noqa: ANN401
        self._args = (backend, tokenizer, vocab_size, sorted(eos_ids))
        self.backend: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def for_params(self, params: Any) -> Matcher | None:  # noqa: ANN401
        """A fresh matcher for a request's grammar (None without one); a bad one is a ValueError naming the field."""
        spec = GrammarSpec.from_params(params)
        if spec is None:
            return None
        if self._args[1] is None or not self._args[3]:
            raise ValueError(f"{spec.field}: structured output needs the model's tokenizer and its EOS token")
        return self.matcher(spec)

    def matcher(self, spec: GrammarSpec) -> Matcher:
        if self.backend is None:
            name, tokenizer, vocab_size, eos_ids = self._args
            self.backend = backend_class(name)(tokenizer, vocab_size, eos_ids)
        if len(spec.source) > MAX_SOURCE_CHARS:
            raise GrammarError(f"{spec.field}: grammar of {len(spec.source)} characters exceeds the limit of "
                               f"{MAX_SOURCE_CHARS}")
        key = (spec.kind, spec.source)
        compiled = self._cache.get(key)
        if compiled is None:
            try:
                compiled = self.backend.compile(spec)
            except GrammarError as e:
                raise GrammarError(f"{spec.field}: {e}") from None
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self.backend.matcher(compiled)
