"""Offline API: `LLM(model=..., **engine options)` with `generate` and `chat`."""
from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from ..config import EngineConfig
from ..core import Completion, Request, RequestOutput, SamplingParams
from .build import build_engine
from .engine import Engine

Prompt = str | list[int]


def request_meta(r: Request, engine: Engine) -> dict[str, Any]:
    """meta_info for one finished request. spec_accept_length includes the bonus token."""
    end = r.finish_time or r.arrival
    meta: dict[str, Any] = {
        "id": r.request_id,
        "prompt_tokens": len(r.prompt_ids),
        "completion_tokens": len(r.output_ids),
        "cached_tokens": r.cached_tokens or 0,  # prompt tokens whose KV came from the prefix cache
        "e2e_latency": end - r.arrival,
        "ttft": (r.first_token_time - r.arrival) if r.first_token_time else None,
        "num_preemptions": r.num_preemptions,
    }
    if engine.drafter is not None:
        meta.update(
            speculative_algorithm=engine.drafter.label,
            spec_verify_ct=r.spec_verify_ct,
            spec_draft_tokens=r.spec_draft_tokens,
            spec_accepted_tokens=r.spec_accepted_tokens,
            spec_accept_length=1.0 + r.spec_accepted_tokens / r.spec_verify_ct if r.spec_verify_ct else 1.0,
            spec_accepted_per_pos=list(r.spec_accepted_per_pos),
            spec_mean_window=r.spec_draft_tokens / r.spec_decode_steps if r.spec_decode_steps else 0.0,
        )
    return meta


class LLM:
    def __init__(self, model: str = "smollm2-135m", **options: Any) -> None:
        self._attach(EngineConfig.from_sources({"model": model, **options}), None, None)

    def _attach(self, config: EngineConfig, model: Any, tokenizer: Any) -> None:
        self.engine = build_engine(config, model, tokenizer)
        while self.engine.idle_work():  # offline, ready means measured (a server measures while it idles)
            pass
        self.config = self.engine.config  # AUTO resolved to the drafter actually used
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop what the engine started (tensor-parallel workers; also done at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """Build from a resolved EngineConfig (the CLI and benchmarks)."""
        self = cls.__new__(cls)
        self._attach(config, None, None)
        return self

    @classmethod
    def from_model(cls, model: "LlamaModel", tokenizer: Any = None, **options: Any) -> "LLM":  # noqa: F821
        """Wrap an already-built model (tests, notebooks) instead of loading a checkpoint."""
        self = cls.__new__(cls)
        self._attach(EngineConfig.from_sources({"model": model.cfg.name or "in-memory", **options}), model, tokenizer)
        return self

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError("prompt: each prompt must be a string or a list of token ids")

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        plist: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        sp = sampling_params or SamplingParams()
        sps = [sp] * len(plist) if isinstance(sp, SamplingParams) else list(sp)
        if len(sps) != len(plist):
            raise ValueError(f"sampling_params: got {len(sps)} for {len(plist)} prompts")
        ids = [self._encode(p) for p in plist]
        for p in sps:
            p.validate(self.engine.model.cfg.vocab_size)
        return self._run(plist, ids, sps, use_tqdm)

    def chat(
        self, conversations: list[dict] | Sequence[list[dict]], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """OpenAI-style message lists; the model's chat template is applied with a generation prompt."""
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else list(conversations)
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        sp = sampling_params or SamplingParams()
        sps = [sp] * len(convs) if isinstance(sp, SamplingParams) else list(sp)
        return self._run(texts, ids, sps, use_tqdm)

    def _run(self, prompts: Sequence[Prompt], ids: list[list[int]], sps: list[SamplingParams],
             use_tqdm: bool = False) -> list[RequestOutput]:
        eng = self.engine
        groups: list[list[Request]] = []
        try:
            for pid, sp in zip(ids, sps):
                group = []
                for i in range(sp.n):
                    child = sp if sp.n == 1 or sp.seed is None else _with_seed(sp, sp.seed + i)
                    group.append(eng.add_request(pid, child))
                groups.append(group)
        except ValueError:
            for g in groups:
                for r in g:
                    eng.abort(r.request_id)
            raise
        total = sum(len(g) for g in groups)
        bar = tqdm(total=total, desc="requests", unit="req", disable=not use_tqdm)
        while eng.has_unfinished():
            eng.step()
            bar.update(total - len(eng.requests) - bar.n)
        bar.close()
        return [
            RequestOutput(g[0].request_id, p if isinstance(p, str) else None, pid,
                          [self._completion(i, r) for i, r in enumerate(g)],
                          g[0].prompt_logprobs if g[0].params.prompt_logprobs is not None else None)
            for p, pid, g in zip(prompts, ids, groups)
        ]

    def _completion(self, index: int, r: Request) -> Completion:
        if r.stop_text is not None:
            text = r.stop_text
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids)
        else:
            text = ""
        return Completion(index, text, list(r.output_ids), r.finish_reason,
                          r.logprobs if r.params.logprobs is not None else None, request_meta(r, self.engine), r.error)


def _with_seed(sp: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(sp, seed=seed)
