"""Two engine replicas behind the router: per-replica counts follow each policy, and
prefix_affinity keeps agentic sessions on one replica with a higher prefix-cache hit rate.

One gateway (2 replica processes, in-process HTTP server) for the module; each test
installs the router policy it checks. Workloads differ by seed between policies, so one
policy's run never warms the cache for the other's.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import httpx
import pytest

from layerscope.engine.config import EngineConfig
from layerscope.engine.gateway.gateway import Gateway
from layerscope.engine.gateway.router import Router
from layerscope.engine.gateway.server import serving
from layerscope.regressions.load.loadgen import run_load
from layerscope.regressions.load.workloads import builtin


@pytest.fixture(scope="module")
def stack(tiny_model):
    config = EngineConfig.from_overrides(model=str(tiny_model), num_kv_blocks=512, block_size=16)
    gateway = Gateway(config, num_replicas=2, record=True, served_model_name="tiny")
    with serving(gateway) as url:
        yield gateway, url


def _use(gateway: Gateway, policy: str) -> None:
    gateway.router = Router(policy, 2, gateway.config.block_size)


def _replicas_of(gateway: Gateway, ids) -> list[int]:
    by_id = {r.request_id: r.replica for r in gateway.records}
    return [by_id[i] for i in ids]


async def _complete(c: httpx.AsyncClient, prompt: str, max_tokens: int = 4) -> str:
    r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                              "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, trust_env=False, timeout=60)


def test_round_robin_alternates(stack):
    gateway, url = stack
    _use(gateway, "round_robin")

    async def main():
        async with _client(url) as c:
            return [await _complete(c, f"round robin {i}") for i in range(8)]

    ids = asyncio.run(main())
    assert _replicas_of(gateway, ids) == [0, 1] * 4
    assert gateway.router.num_routed == [4, 4]


def test_least_loaded_avoids_the_busy_replica(stack):
    gateway, url = stack
    _use(gateway, "least_loaded")

    async def main():
        async with _client(url) as c:
            body = {"model": "tiny", "prompt": "a long one", "max_tokens": 900, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                busy = [s.record.replica for s in gateway._streams.values()]
                shorts = [await _complete(c, f"short {i}") for i in range(3)]
                in_flight = list(gateway.num_in_flight)
                async for _ in lines:
                    pass
            concurrent = await asyncio.gather(*(_complete(c, f"together {i}", 8) for i in range(8)))
            return busy, shorts, in_flight, concurrent

    busy, shorts, in_flight, concurrent = asyncio.run(main())
    assert len(busy) == 1
    other = 1 - busy[0]
    assert _replicas_of(gateway, shorts) == [other] * 3  # the long request kept its replica loaded
    assert in_flight[busy[0]] == 1
    counts = Counter(_replicas_of(gateway, concurrent))
    assert abs(counts[0] - counts[1]) <= 2, counts  # equal loads share out evenly


def _agentic(gateway: Gateway, url: str, policy: str, seed: int):
    _use(gateway, policy)
    spec = builtin("agentic", seed=seed)
    result = run_load(url, spec, spec.build(gateway.tokenizer), model="tiny")
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok]
    prompt = sum(r.num_prompt_tokens for r in result.records)
    cached = sum(r.num_cached_tokens for r in result.records)
    sessions: dict[str, set[int]] = defaultdict(set)
    by_id = {r.request_id: r for r in gateway.records}
    for r in result.records:
        g = by_id[r.request_id]
        assert g.session_id == r.session_id  # the session id reached the gateway
        sessions[r.session_id].add(g.replica)
    return cached / prompt, sessions, Counter(by_id[r.request_id].replica for r in result.records)


def test_prefix_affinity_keeps_sessions_together_and_hits_the_cache_more(stack):
    gateway, url = stack
    rr_rate, rr_sessions, rr_counts = _agentic(gateway, url, "round_robin", seed=11)
    pa_rate, pa_sessions, pa_counts = _agentic(gateway, url, "prefix_affinity", seed=12)
    print(f"\nagentic prefix-cache hit rate: round_robin {rr_rate:.3f} (per replica {dict(rr_counts)}), "
          f"prefix_affinity {pa_rate:.3f} (per replica {dict(pa_counts)})")
    assert all(len(r) == 1 for r in pa_sessions.values()), pa_sessions  # every session on one replica
    assert len(pa_counts) == 2  # this seed's four apps hash onto both replicas
    assert any(len(r) == 2 for r in rr_sessions.values())  # round robin splits sessions
    assert rr_counts[0] == rr_counts[1]
    assert pa_rate > rr_rate + 0.03
