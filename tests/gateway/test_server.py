"""``layerscope serve`` as a real subprocess on a free loopback port, driven by the official
``openai`` client and by raw HTTP: streaming, usage, bad input, 429s, disconnects, metrics.

One server for the module: 1 replica, an API key, a small admission window
(max_concurrency=2, max_queue=2) so a bounded burst overflows it, and 2 ms added to
every engine step so a long request is still streaming when a test looks at it.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

KEY = "sk-layerscope-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    from benchmarks.serve_soak import start_server

    proc, url, lines = start_server(
        str(tiny_model), tmp_path_factory.mktemp("serve") / "bundle",
        ["--api-key", KEY, "--set", "num_kv_blocks=128", "--set", "max_num_seqs=4", "--set", "gateway.max_concurrency=2",
         "--set", "gateway.max_queue=2", "--set", "gateway.retry_after_s=3",
         # the tiny model decodes a token in about a millisecond: slow the steps down so that
         # long requests are still running when a test looks at them
         "--fault", "engine.step_overhead_ms=2"])
    assert url.startswith("http://127.0.0.1:")
    yield url
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(30) == 0, "".join(lines[-20:])
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def _metrics(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(url + "/metrics", trust_env=False).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _sample(metrics, name: str, **labels) -> float:
    want = set(labels.items())
    vals = [v for (n, lab), v in metrics.items() if n == name and want <= lab]
    assert vals, f"{name}{labels} not in /metrics"
    return sum(vals)


def _wait_for(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


# ---- 1. the official client, unmodified ---------------------------------------------------------
def test_openai_client_streams_chat_with_matching_usage(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Tell me about caches."}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    tokens, text, usage, finish = 0, "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role and not choice.delta.content:
                continue  # the opening role chunk carries no token
            tokens += 1
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert usage is not None and tokens == usage.completion_tokens == 12 and finish == "length"
    assert usage.prompt_tokens > 5 and usage.total_tokens == usage.prompt_tokens + 12
    same = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Tell me about caches."}],
                                          max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert same.choices[0].message.content == text and same.usage.completion_tokens == 12  # greedy: identical


def test_openai_client_streams_completion_with_matching_usage(client, model_name, tiny_model):
    stream = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=9, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    usage = chunks[-1].usage
    assert len(token_chunks) == usage.completion_tokens == 9
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    assert usage.prompt_tokens == len(tok.encode("Once upon a time", add_special_tokens=False))
    full = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=9, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in token_chunks) == full.choices[0].text  # greedy: the same text
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")


def test_models_health_and_api_key(server, client, model_name):
    assert httpx.get(server + "/health", trust_env=False).status_code == 200  # no key needed
    r = httpx.get(server + "/v1/models", trust_env=False)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server + "/v1/completions", json={"model": model_name, "prompt": "x"}, trust_env=False,
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert [m.id for m in client.models.list().data] == [model_name]


# ---- 2. bad input: the right status, a clear message, a healthy server ---------------------------
def test_vllm_tokenize_and_detokenize_round_trip_with_the_models_tokenizer(server, model_name, tiny_model):
    """vLLM's /tokenize and /detokenize (what `vllm bench serve` aligns its prompts with)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    post = lambda path, **kw: httpx.post(server + path, headers=AUTH, trust_env=False, timeout=30, **kw)  # noqa: E731
    prompt = "the quick brown fox jumps over the lazy dog"
    r = post("/tokenize", json={"model": model_name, "prompt": prompt, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(prompt, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > body["count"]
    r = post("/detokenize", json={"model": model_name, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(body["tokens"])
    chat = post("/tokenize", json={"model": model_name, "messages": [{"role": "user", "content": prompt}]}).json()
    assert chat["count"] > body["count"]  # the chat template wraps the message
    # bad input names what exists
    r = post("/tokenize", json={"model": "nope", "prompt": prompt})
    assert r.status_code == 404 and model_name in r.json()["error"]["message"]
    r = post("/tokenize", json={"model": model_name})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = post("/detokenize", json={"model": model_name, "tokens": [10**9]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_bad_input_gets_clear_errors_and_server_stays_healthy(server, model_name):
    post = lambda path, **kw: httpx.post(server + path, headers=AUTH, trust_env=False, timeout=30, **kw)  # noqa: E731
    cases = [
        (post("/v1/completions", content=b'{"model": "x", "prompt": '), 400, "malformed JSON"),
        (post("/v1/chat/completions", content=b"not json at all"), 400, "malformed JSON"),
        (post("/v1/completions", json={"model": model_name, "prompt": "hello " * 2000}), 400, "maximum context length"),
        (post("/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": 5000}), 400, "5000"),
        (post("/v1/completions", json={"model": model_name, "prompt": "hi", "temperature": -1}), 400, "temperature"),
        (post("/v1/completions", json={"model": model_name, "prompt": "hi", "top_p": 1.5}), 400, "top_p"),
        (post("/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
        (post("/v1/chat/completions", json={"model": model_name, "messages": [{"role": "wizard", "content": "x"}]}),
         400, "role"),
        (post("/v1/completions", json={"model": model_name, "prompt": [1, 99999]}), 400, "vocabulary"),
        (post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404, "gpt-9"),
        (post("/v1/embeddings", json={}), 404, "Not Found"),
    ]
    for resp, status, needle in cases:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert needle in err["message"], err
        assert set(err) == {"message", "type", "param", "code"}
    too_long = cases[2][0].json()["error"]["message"]
    lengths = sorted(int(x) for x in re.findall(r"\d+", too_long))
    assert lengths[0] == 1024 and lengths[-1] > 1024  # both the limit and the prompt's length
    assert httpx.get(server + "/health", trust_env=False).status_code == 200
    ok = post("/v1/completions", json={"model": model_name, "prompt": "still fine", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_burst_beyond_capacity_gets_429_and_nothing_hangs(server, model_name):
    n = 12  # capacity is 2 running + 2 queued

    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": model_name, "prompt": f"burst request {i}", "max_tokens": 48, "ignore_eos": True,
                "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, (await r.aread()), r.headers.get("retry-after")
            tokens = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            return 200, len(tokens), None

    async def main():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, trust_env=False, timeout=60) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(n))), 90)

    results = asyncio.run(main())
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 429]
    assert len(ok) + len(rejected) == n  # every request answered: served in full or refused
    assert len(ok) >= 4 and rejected, [r[0] for r in results]
    assert all(r[1] == 48 for r in ok)
    for _, body, retry_after in rejected:
        assert retry_after == "3" and b"max_queue=2" in body
    m = _metrics(server)
    assert _sample(m, "layerscope_gateway_requests_total", code="429") >= len(rejected)
    assert _sample(m, "layerscope_gateway_queue_length") == 0
    assert _sample(m, "layerscope_gateway_inflight_requests") == 0
    assert httpx.get(server + "/health", trust_env=False).status_code == 200


# ---- 3. disconnects and stops free the KV blocks ----------------------------------------------
def _kv(server) -> float:
    return _sample(_metrics(server), "layerscope_kv_cache_usage_perc", replica="0")


def test_client_disconnect_mid_stream_aborts_and_frees_kv(server, model_name):
    idle = _kv(server)
    aborted_before = _sample(_metrics(server), "layerscope_request_success_total", finished_reason="abort")
    body = {"model": model_name, "prompt": "a long story " * 40, "max_tokens": 800, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.Client(base_url=server, headers=AUTH, trust_env=False, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept referenced: dropping it would close the connection already
            while sum(next(lines).startswith("data: {") for _ in range(2)) < 1:
                pass
            busy = _wait_for(lambda: _kv(server) > idle, 5)  # blocks held while it streams
        # leaving the block closed the connection mid-stream
    assert busy, "KV usage never rose while the request was streaming"
    assert _wait_for(lambda: _sample(_metrics(server), "layerscope_request_success_total",
                                     finished_reason="abort") == aborted_before + 1, 10)
    assert _wait_for(lambda: _kv(server) == idle, 10), f"KV usage stuck at {_kv(server)} (idle {idle})"
    m = _metrics(server)
    assert _sample(m, "layerscope_num_requests_running", replica="0") == 0
    assert _sample(m, "layerscope_gateway_requests_total", code="499") >= 1


def test_client_disconnect_while_queued_leaves_the_queue(server, model_name):
    long = {"model": model_name, "prompt": "hold a slot", "max_tokens": 450, "ignore_eos": True, "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, trust_env=False, timeout=60) as c:
            holders = [asyncio.ensure_future(c.post("/v1/completions", json=long)) for _ in range(2)]
            await asyncio.sleep(0.3)
            queued = asyncio.ensure_future(c.post("/v1/completions", json={**long, "max_tokens": 5}))
            await asyncio.sleep(0.3)
            waiting = _sample(_metrics(server), "layerscope_gateway_queue_length")
            queued.cancel()  # the client gives up while queued
            await asyncio.sleep(0.3)
            after = _sample(_metrics(server), "layerscope_gateway_queue_length")
            done = await asyncio.gather(*holders)
            return waiting, after, [r.status_code for r in done]

    waiting, after, codes = asyncio.run(main())
    assert waiting == 1 and after == 0 and codes == [200, 200]
    assert _wait_for(lambda: _kv(server) == 0.0, 10)


def test_stop_string_finishes_and_frees_kv(server, client, model_name):
    prompt = "The scheduler batches requests"
    free = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # a plain-ASCII stop string from the middle of the greedy output (the random model emits
    # partial UTF-8 too, which is not a good stop string)
    stop = next(free[i:i + 2] for i in range(3, len(free) - 1) if free[i:i + 2].isascii()
                and free[i:i + 2].strip() == free[i:i + 2] and free[i:i + 2].isprintable())
    cut = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.text == free[: free.index(stop)]
    assert choice.stop_reason == stop and cut.usage.completion_tokens < 24
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                            stop=[stop], stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == choice.text  # the stop string's first characters were held back, never sent
    assert sum(1 for c in chunks if c.choices) == chunks[-1].usage.completion_tokens == cut.usage.completion_tokens
    assert _wait_for(lambda: _kv(server) == 0.0, 10)


def test_metrics_exposition_names(server, client, model_name):
    # one request of its own: the request counters have label sets only once something was served
    client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=2, temperature=0)
    text = httpx.get(server + "/metrics", trust_env=False).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("layerscope_time_to_first_token_seconds", "layerscope_kv_cache_usage_perc",
                 "layerscope_num_requests_running", "layerscope_gateway_requests",
                 "layerscope_router_requests", "layerscope_gateway_queue_time_seconds"):
        assert name in fams, name
    replicas = {s.labels.get("replica") for s in fams["layerscope_time_to_first_token_seconds"].samples}
    assert {"gateway", "0"} <= replicas  # the gateway's view and the engine's
    routed = {s.labels["replica"] for s in fams["layerscope_router_requests"].samples}
    assert routed == {"0"}
    # the serving process's own families, as vLLM's default registry has them: its start time is
    # how an external comparison knows one process served both runs (one value, scrape after scrape)
    started = fams["process_start_time_seconds"].samples[0].value
    assert 0 < time.time() - started < 3600
    again = {f.name: f for f in text_string_to_metric_families(httpx.get(server + "/metrics", trust_env=False).text)}
    assert again["process_start_time_seconds"].samples[0].value == started
    assert fams["process_resident_memory_bytes"].samples[0].value > 10e6
