"""The prefix cache over HTTP: meta_info.cached_tokens, OpenAI usage.prompt_tokens_details.cached_tokens, and the
/metrics counters move by exactly what the requests report."""
from __future__ import annotations

import httpx
import openai

from tests.server_fixtures import client, model_dir, srv  # noqa: F401, F811  (fixtures)
from tests.server_utils import ServerThread, scrape

IDS = [(7 * i) % 90 + 1 for i in range(40)]  # 2 whole pages of 16 and a bit


def test_cached_tokens_reported_and_counted(srv: ServerThread, client: openai.OpenAI) -> None:
    before = scrape(srv.url)

    def generate(ids: list[int]) -> dict:
        return httpx.post(f"{srv.url}/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}, timeout=60).json()["meta_info"]

    first, second = generate(IDS), generate(IDS)
    assert (first["cached_tokens"], second["cached_tokens"]) == (0, 32)
    r = client.completions.create(model="tiny", prompt=IDS + [3, 4], max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 32 and r.usage.prompt_tokens == 42
    r = client.completions.create(model="tiny", prompt=[IDS, IDS], max_tokens=2, n=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 64  # once per prompt, as prompt_tokens counts
    after = scrape(srv.url)

    def delta(name: str) -> float:
        return after.get(f"specserve:prefix_cache_{name}_total", 0) - before.get(f"specserve:prefix_cache_{name}_total", 0)

    # 7 admissions: 40, 40, 42 and 4 × 40 prompt tokens; all but the first hit 2 pages
    assert (delta("queries"), delta("hits"), delta("hit_requests"), delta("evictions")) == (282, 6 * 32, 6, 0)
    assert after["specserve:kv_cache_usage_perc"] == 0  # cached pages nobody holds count as free
