"""The load generator: drives any OpenAI-compatible server with a workload, open loop.

Each request is sent at its scheduled time whatever happened to the others (open
loop), except a session's next turn, which waits for the previous one. The HTTP client
is aiohttp (as vLLM's benchmark): its per-request overhead is a fraction of httpx's, and
whatever the client spends is measured as the ``client`` layer. Before the clock starts
the connection pool is opened (one connection per request that can be in flight, up
to 64), so TTFT does not carry TCP connects a long-lived client would not pay. Every request
streams (SSE) so TTFT is observable; the client stamps, on the host's monotonic clock
(``time.monotonic_ns()``, the same clock the server's records use):

- ``client_send_ns``: just before the request is written (after the client-side
  concurrency cap, which is the client's own queue, not the server's);
- one timestamp per output token: a chunk with a choice is one token (our server
  sends exactly one per token; a chat stream's opening role-only chunk is not one);
- ``client_first_token_ns`` (first token chunk) and ``client_done_ns`` (end of stream).

Metrics (DESIGN.md): TTFT = first token - send; TPOT = (E2E - TTFT) / (tokens - 1);
ITL = every gap between consecutive tokens; E2E = done - send; throughput = output
tokens / busy interval; goodput = requests meeting every given SLO / busy interval.
Percentiles p50/p90/p99, each with its sample count.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import aiohttp

from layerscope.contract import RequestTimes, interval_s
from layerscope.contract import percentiles as contract_percentiles
from layerscope.regressions.load.workloads import RequestSpec, WorkloadSpec


@dataclass
class ClientRecord(RequestTimes):
    """One request as the client saw it. Timestamps: ns on the host's monotonic clock. ``tpot_s``/``itl_s``:
    ``RequestTimes``."""

    index: int
    api: str
    session_id: str | None
    scheduled_s: float  # intended send time, seconds after the run's start (dependent turns: when ready)
    max_tokens: int
    request_id: str | None = None  # the server's response id (joins with server-side records)
    client_send_ns: int | None = None
    client_first_token_ns: int | None = None
    client_done_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)
    num_output_tokens: int = 0  # usage.completion_tokens when the server reports it, else token chunks
    num_token_chunks: int = 0
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    status: str = "pending"  # ok | rejected (429) | error
    error: str | None = None
    text: str = ""  # the generated text (vLLM's generated_texts)
    trace_id: str | None = None  # of the W3C traceparent sent: the server's spans join this trace

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        return interval_s(self.client_send_ns, self.client_first_token_ns)

    @property
    def e2e_s(self) -> float | None:
        return interval_s(self.client_send_ns, self.client_done_ns) if self.ok else None

    def to_row(self) -> dict[str, Any]:
        """Client columns of requests.parquet (schema names) plus the join key."""
        return {"request_id": self.request_id, "client_send_ns": self.client_send_ns,
                "client_first_token_ns": self.client_first_token_ns, "client_done_ns": self.client_done_ns,
                "client_ttft_s": self.ttft_s, "client_tpot_s": self.tpot_s, "client_e2e_s": self.e2e_s,
                "http_status": self.http_status, "num_output_tokens": self.num_output_tokens,
                "num_prompt_tokens": self.num_prompt_tokens, "num_cached_tokens": self.num_cached_tokens,
                "finish_reason": self.finish_reason, "error": self.error, "trace_id": self.trace_id}


@dataclass
class LoadResult:
    spec: WorkloadSpec
    records: list[ClientRecord]
    start_ns: int
    end_ns: int
    endpoint: str
    model: str

    def summary(self, slos: dict[str, float] | None = None) -> dict[str, Any]:
        return summarize(self.records, slos if slos is not None else self.spec.slos)


class LoadGenerator:
    """Sends one workload's requests to ``endpoint`` (``http://host:port``, with or without /v1)."""

    def __init__(self, endpoint: str, spec: WorkloadSpec, requests: Sequence[RequestSpec], model: str | None = None,
                 api_key: str | None = None, timeout_s: float = 300.0,
                 on_done: Callable[[ClientRecord], None] | None = None):
        base = endpoint.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.spec = spec
        self.requests = list(requests)
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.on_done = on_done

    async def run(self) -> LoadResult:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, connect=10.0)
        # trust_env=False: a proxy from the environment must never see loopback benchmark traffic
        async with aiohttp.ClientSession(base_url=self.base, connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout, trust_env=False, headers=self.headers) as client:
            model = self.model or await _first_model(client)
            await _open_connections(client, self._num_connections())
            records = [ClientRecord(r.index, r.api, r.session_id, r.arrival_s, r.max_tokens) for r in self.requests]
            done = {r.index: asyncio.Event() for r in self.requests}
            cap = asyncio.Semaphore(self.spec.max_concurrency) if self.spec.max_concurrency > 0 else None
            start_ns = time.monotonic_ns()

            async def one(req: RequestSpec, rec: ClientRecord) -> None:
                try:
                    if req.after is not None:
                        await done[req.after].wait()
                        rec.scheduled_s = (time.monotonic_ns() - start_ns) / 1e9 + req.arrival_s
                    delay = start_ns / 1e9 + rec.scheduled_s - time.monotonic_ns() / 1e9
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if cap is None:
                        await _send(client, model, req, rec, self.spec)
                    else:
                        async with cap:
                            await _send(client, model, req, rec, self.spec)
                finally:
                    done[req.index].set()
                    if self.on_done is not None:
                        self.on_done(rec)

            await asyncio.gather(*(one(r, rec) for r, rec in zip(self.requests, records)))
            end_ns = time.monotonic_ns()
        return LoadResult(self.spec, records, start_ns, end_ns, self.base, model)


    def _num_connections(self) -> int:
        cap = self.spec.max_concurrency or len(self.requests)
        if self.spec.kind == "agentic":  # a session has one request in flight at a time
            cap = min(cap, self.spec.num_sessions)
        return max(1, min(cap, len(self.requests), 64))


async def _first_model(client: aiohttp.ClientSession) -> str:
    async with client.get("/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def _open_connections(client: aiohttp.ClientSession, n: int) -> None:
    """Open ``n`` keep-alive connections (concurrent GETs of /v1/models) into the pool."""

    async def one() -> None:
        try:
            async with client.get("/v1/models") as resp:
                await resp.read()
        except aiohttp.ClientError:
            pass  # the run itself will report the server's problem

    await asyncio.gather(*(one() for _ in range(n)))


def _body(model: str, req: RequestSpec, spec: WorkloadSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": spec.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if spec.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; OpenAI ignores it
    if req.session_id:
        body["user"] = req.session_id
    if req.api == "chat":
        body["messages"] = list(req.messages or ({"role": "user", "content": req.prompt or ""},))
    else:
        body["prompt"] = req.prompt if req.prompt is not None else "\n".join(m["content"] for m in req.messages or ())
    return body


async def _send(client: aiohttp.ClientSession, model: str, req: RequestSpec, rec: ClientRecord,
                spec: WorkloadSpec) -> None:
    path = "/v1/chat/completions" if req.api == "chat" else "/v1/completions"
    headers = {"Content-Type": "application/json"}
    # W3C trace context: the client's span is the parent of the server's root (same trace id)
    rec.trace_id = secrets.token_hex(16)
    headers["traceparent"] = f"00-{rec.trace_id}-{secrets.token_hex(8)}-01"
    if req.session_id:
        headers["X-Session-Id"] = req.session_id
    payload = json.dumps(_body(model, req, spec)).encode()
    usage = None
    rec.client_send_ns = time.monotonic_ns()
    try:
        async with client.post(path, data=payload, headers=headers) as resp:
            rec.http_status = resp.status
            rec.request_id = resp.headers.get("x-request-id")  # our server's; others may not send it
            if resp.status != 200:
                raw = await resp.read()
                rec.client_done_ns = time.monotonic_ns()
                rec.status = "rejected" if resp.status == 429 else "error"
                rec.error = _error_message(raw) or f"HTTP {resp.status}"
                return
            async for raw_line in resp.content:  # SSE: "data: {...}" lines
                if not raw_line.startswith(b"data:"):
                    continue
                data = raw_line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.monotonic_ns()
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.status, rec.error = "error", _error_message(data)
                    continue
                rec.request_id = rec.request_id or chunk.get("id")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta")
                    if delta is not None and "role" in delta and not delta.get("content"):
                        continue  # the chat stream's opening role chunk: no token
                    rec.token_ns.append(now)
                    rec.text += choice.get("text") or (delta or {}).get("content") or ""
                    if rec.client_first_token_ns is None:
                        rec.client_first_token_ns = now
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
            rec.client_done_ns = time.monotonic_ns()
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        rec.client_done_ns = time.monotonic_ns()
        rec.status, rec.error = "error", f"{type(e).__name__}: {e}"
        return
    rec.num_token_chunks = len(rec.token_ns)
    rec.num_output_tokens = rec.num_token_chunks
    if usage:
        rec.num_output_tokens = usage.get("completion_tokens", rec.num_token_chunks)
        rec.num_prompt_tokens = usage.get("prompt_tokens")
        rec.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if rec.status == "pending":
        rec.status = "ok" if rec.client_first_token_ns is not None else "error"
        if rec.status == "error":
            rec.error = "the stream ended without a token"


def _error_message(raw: bytes) -> str | None:
    try:
        data = json.loads(raw)
        return data["error"]["message"] if isinstance(data.get("error"), dict) else str(data.get("message"))
    except (ValueError, KeyError, AttributeError, TypeError):
        return raw[:200].decode(errors="replace") or None


# ---- statistics -------------------------------------------------------------------------------
def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p90/p99 and mean (linear interpolation), with the sample count."""
    xs = [v for v in values if v is not None]
    out: dict[str, float | int | None] = contract_percentiles(xs)
    out["mean"] = sum(xs) / len(xs) if xs else None
    return out


def summarize(records: Sequence[ClientRecord], slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Headline figures of a run as the client saw it (seconds, tokens, requests)."""
    slos = slos or {}
    ok = [r for r in records if r.ok]
    sends = [r.client_send_ns for r in records if r.client_send_ns is not None]
    dones = [r.client_done_ns for r in records if r.client_done_ns is not None]
    duration_s = (max(dones) - min(sends)) / 1e9 if sends and dones else 0.0
    out_tokens = sum(r.num_output_tokens for r in ok)
    good = [r for r in ok if all(getattr(r, k) is not None and getattr(r, k) <= v for k, v in slos.items()
                                  if not (k == "tpot_s" and r.tpot_s is None))]
    per = lambda n: n / duration_s if duration_s > 0 else None  # noqa: E731
    return {
        "requests": len(records),
        "requests_ok": len(ok),
        "requests_rejected": sum(r.status == "rejected" for r in records),
        "requests_error": sum(r.status == "error" for r in records),
        "duration_s": duration_s,
        "input_tokens": sum(r.num_prompt_tokens or 0 for r in ok),
        "output_tokens": out_tokens,
        "output_tokens_per_s": per(out_tokens),
        "requests_per_s": per(len(ok)),
        "goodput_requests_per_s": per(len(good)),
        "slos": dict(slos),
        "ttft_s": percentiles([r.ttft_s for r in ok]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": percentiles([g for r in ok for g in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
    }


def render_summary(summary: dict[str, Any], title: str = "layerscope load"):
    """A rich Table of the summary (latencies in ms, with sample counts)."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("metric", "p50 ms", "p90 ms", "p99 ms", "mean ms", "count"):
        t.add_column(col, justify="right" if col != "metric" else "left")
    ms = lambda v: "-" if v is None else f"{v * 1000:.1f}"  # noqa: E731
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        p = summary[key]
        t.add_row(label, ms(p["p50"]), ms(p["p90"]), ms(p["p99"]), ms(p["mean"]), str(p["count"]))
    rate = lambda v, unit: "-" if v is None else f"{v:.2f} {unit}"  # noqa: E731
    t.caption = (f"{summary['requests_ok']}/{summary['requests']} ok, {summary['requests_rejected']} rejected (429), "
                 f"{summary['requests_error']} errors in {summary['duration_s']:.2f} s; "
                 f"output {rate(summary['output_tokens_per_s'], 'tok/s')}, "
                 f"goodput {rate(summary['goodput_requests_per_s'], 'req/s')}"
                 + (f" (SLOs {summary['slos']})" if summary["slos"] else ""))
    return t


@contextlib.contextmanager
def server_in_process(switch_interval_s: float = 0.0005):
    """Use while the server runs in this process (``layerscope run``, tests): the client and the
    HTTP server then share one GIL, and the default 5 ms switch interval would leave one side's
    wake-up waiting for the other's time slice, inflating the client layer."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_load(endpoint: str, spec: WorkloadSpec, requests: Sequence[RequestSpec] | None = None,
             model: str | None = None, api_key: str | None = None, progress: bool = False,
             timeout_s: float = 300.0, tokenizer=None,
             on_done: Callable[[ClientRecord], None] | None = None) -> LoadResult:
    """Run a workload against ``endpoint`` (blocking); shows a rich progress bar if asked.
    ``on_done(record)``: called (on the load generator's thread) as each request ends."""
    reqs = list(requests) if requests is not None else spec.build(tokenizer)
    if not progress:
        return asyncio.run(LoadGenerator(endpoint, spec, reqs, model, api_key, timeout_s, on_done).run())
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(f"{spec.name} -> {endpoint}", total=len(reqs))
        def done(rec: ClientRecord) -> None:
            bar.advance(task)
            if on_done is not None:
                on_done(rec)

        gen = LoadGenerator(endpoint, spec, reqs, model, api_key, timeout_s, on_done=done)
        return asyncio.run(gen.run())
