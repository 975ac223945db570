"""The server's own options. Same mechanism as EngineConfig: each field is a --kebab-case flag and a
SPECSERVE_UPPER_SNAKE environment variable (explicit > environment > default)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from ..config import EngineConfig, _f
from ..flags import add_engine_args
from .reasoning import REASONING_PARSERS
from .tool_parsers import TOOL_PARSER_NAMES


@dataclass(frozen=True)
class ServerConfig:
    host: str = _f("127.0.0.1", "address to listen on (0.0.0.0 to listen on every interface)")
    port: int = _f(30000, "TCP port to listen on")
    api_key: str | None = _f(None, "if set, requests must send `Authorization: Bearer <key>` (/health and /metrics stay open)")
    served_model_name: str | None = _f(None, "model id reported by /v1/models and in responses (default: the model's name)")
    log_interval: float = _f(10.0, "seconds between stats log lines (acceptance length, throughput); 0 = off")
    max_sequences_per_request: int = _f(256, "max prompts x n in one request (larger requests get a 400)")
    reasoning_parser: str | None = _f(None, "move a thinking model's <think> block from the chat answer's content into "
                                      "reasoning_content (SGLang's names)", tuple(REASONING_PARSERS))
    tool_call_parser: str | None = _f(None, "how chat answers write tool calls (SGLang's names; vLLM's hermes and "
                                      "llama3_json too); default: read from the chat template", TOOL_PARSER_NAMES)

    # NOTE: the very same merge as the engine's (explicit > SPECSERVE_* env > default).
    from_sources = EngineConfig.__dict__["from_sources"]

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")
        if self.log_interval < 0:
            raise ValueError(f"--log-interval must be >= 0, got {self.log_interval}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: unknown {self.reasoning_parser!r}; choose one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSER_NAMES:
            raise ValueError(f"--tool-call-parser: unknown {self.tool_call_parser!r}; choose one of "
                             f"{', '.join(TOOL_PARSER_NAMES)}")
        if self.max_sequences_per_request < 1:
            raise ValueError(f"--max-sequences-per-request must be >= 1, got {self.max_sequences_per_request}")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, ServerConfig)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig.from_sources({f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServerConfig)})
