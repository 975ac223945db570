"""The config tree as command-line flags: every field of a config dataclass (EngineConfig, the server's
ServerConfig) is a --kebab-case flag. NOTE: this is the CLI layer, above the registries: the fields whose
names a registry lists (drafters, window policies, acceptance rules) take their choices and help from it."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .config import EngineConfig, env_name, flag, parse_bool, base_type
from .cost.policy import policies_help, policy_names
from .drafters.base import algorithm_help, window_defaults_help
from .speculative.resolve import check_config
from .speculative.rules import rules_help, selectable_rules


def registry_options() -> dict[str, dict[str, Any]]:
    """Help (and choices) of the fields a registry owns, read at parser build time (a drafter, policy or rule
    registered later is listed too)."""
    return {
        "speculative_algorithm": {"help": algorithm_help()},
        "speculative_window": {"help": f"verify-window policy: {policies_help()}. {window_defaults_help()}",
                               "choices": policy_names()},
        "speculative_accept": {"help": "acceptance rule at temperature > 0 (every temperature-0 request is verified "
                                       "greedily): auto = sample for drafts sampled from q, onehot for deterministic "
                                       f"ones; {rules_help()}",
                               "choices": selectable_rules()},
    }


#: SGLang server arguments that ask for what a CPU engine cannot do: refused with the reason, never ignored
REFUSED = {
    "--attention-backend": "there is one attention backend on a CPU (specserve's paged attention kernel)",
    "--mem-fraction-static": "GPU memory is not shared out here: --kv-cache-memory sizes the KV pools (bytes, or a "
                             "fraction of RAM for the KV cache alone)",
    "--cuda-graph-max-bs": "there are no CUDA graphs on a CPU",
    "--cuda-graph-bs": "there are no CUDA graphs on a CPU",
}


class _Refused(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string}: not supported: {REFUSED[option_string]}")


def add_engine_args(parser: argparse.ArgumentParser, owner: type | None = None) -> None:
    """Add every field of EngineConfig (or another config dataclass with `from_sources`, e.g. the
    server's ServerConfig) as --kebab-case (default None so env/defaults apply later); with EngineConfig, also
    the SGLang arguments it refuses (`REFUSED`)."""
    owned = registry_options() if owner in (None, EngineConfig) else {}
    if owner in (None, EngineConfig):
        for name, why in REFUSED.items():
            parser.add_argument(name, action=_Refused, nargs="?", help=f"refused: {why}")
    for f in dataclasses.fields(owner or EngineConfig):
        if f.name == "model":
            continue
        t = base_type(f, owner)
        # a boolean flag alone means true (`--disable-prefix-cache`); `--flag false` still parses
        boolean = dict(nargs="?", const=True) if t is bool else {}
        opt = owned.get(f.name, {})
        parser.add_argument(f"--{flag(f.name)}", *f.metadata.get("aliases", ()), dest=f.name,
                            type=parse_bool if t is bool else t, default=None,
                            choices=opt.get("choices", f.metadata["choices"]), **boolean,
                            help=f"{opt.get('help', f.metadata['help'])} [env "
                                 f"{' or '.join((env_name(f.name), *f.metadata.get('env_aliases', ())))}; default "
                                 f"{f.default if f.default is not None else f.metadata.get('unset')}]")


def config_from_args(args: argparse.Namespace, model: str | None) -> EngineConfig:
    """The flags over the environment over the defaults, checked against the registries."""
    explicit = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    explicit["model"] = model
    return check_config(EngineConfig.from_sources(explicit))
