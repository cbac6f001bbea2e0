"""The gateway core: admission -> router -> replica hand-off, and the way back.

``Gateway`` owns the replica processes, the admission queue, the router and every
request in flight. It runs on one asyncio event loop (the HTTP server's); replica
reader threads hop onto that loop with ``call_soon_threadsafe`` and drop each token
delta into its request's ``asyncio.Queue``. Nothing here parses HTTP: ``server.py``
does, and calls ``tokenize`` / ``submit`` / ``close``.

Every hop is stamped with ``time.monotonic_ns()`` (one clock for every process on the
host) in a ``GatewayRecord``: gateway arrival, admitted, routed (handed to the replica's
queue), engine arrival (stamped by the replica), first token and finish as the HTTP
stream wrote them. Those feed the run bundle's ``gateway.queue`` / ``gateway.route`` /
``engine.output`` layers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from layerscope.engine.config import EngineConfig
from layerscope.engine.faults import Faults
from layerscope.engine.gateway.admission import AdmissionController, QueueFullError
from layerscope.engine.gateway.protocol import APIError
from layerscope.engine.gateway.records import GatewayRecord, RequestStream
from layerscope.engine.gateway.replica import ReplicaClient
from layerscope.engine.gateway.router import Router
from layerscope.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_STATUS = {"stop": "finished_stopped", "length": "finished_length", "abort": "finished_aborted"}


def gen_ai_attributes(rec: GatewayRecord, model_name: str) -> dict[str, Any]:
    """OpenTelemetry GenAI attributes of a request's root span, with vLLM's names for the
    usage and latency fields (seconds), so its traces read like vLLM's."""
    attrs: dict[str, Any] = {"gen_ai.request.id": rec.request_id, "gen_ai.response.model": model_name,
                             "gen_ai.operation.name": "chat" if rec.api == "chat" else "text_completion",
                             "gen_ai.usage.completion_tokens": rec.num_output_tokens,
                             "gen_ai.usage.output_tokens": rec.num_output_tokens}
    if rec.num_prompt_tokens is not None:
        attrs["gen_ai.usage.prompt_tokens"] = attrs["gen_ai.usage.input_tokens"] = rec.num_prompt_tokens
    t0 = rec.gateway_arrival_ns
    # time_in_queue: here the gateway's admission queue (arrival -> admitted)
    for key, ns in (("time_in_queue", rec.gateway_admitted_ns),
                    ("time_to_first_token", rec.gateway_first_token_ns), ("e2e", rec.gateway_finished_ns)):
        if ns:
            attrs[f"gen_ai.latency.{key}"] = (ns - t0) / 1e9
    return attrs


def load_gateway_tokenizer(model_dir: str | Path):
    """The model's fast tokenizer without importing torch (the gateway process never needs it)."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    from layerscope.engine.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


class Gateway:
    """Admission, routing and the replica processes behind one OpenAI-compatible endpoint."""

    def __init__(self, config: EngineConfig, faults: Faults | None = None, num_replicas: int = 1,
                 probes: str = "default", served_model_name: str | None = None, record: bool = True,
                 recorder_kwargs: dict[str, Any] | None = None):
        """``probes``: off | default | full, for the gateway's recorder and every replica's;
        ``record``: keep a GatewayRecord per request in ``records`` (a run; not a long-lived
        server); ``recorder_kwargs``: passed to each ProbeRecorder (profiler/py-spy knobs)."""
        if num_replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
        if config.num_threads == 0 and config.device != "cuda":
            # replicas share the host's cores with each other and with this process (HTTP, and the
            # load generator under `run`): one intra-op thread per core each would oversubscribe
            # them, and torch's spinning threads then stall each other (on 2 cores, TTFT went
            # from ~4 ms to ~1 s). Leave a core to the gateway and split the rest.
            threads = max(1, ((os.cpu_count() or 1) - 1) // (num_replicas * config.tp_size))
            config = EngineConfig.from_overrides(config, num_threads=threads)
        self.config = config
        self.faults = faults or Faults()
        self.probes = probes
        self.model_name = served_model_name or config.model
        self.record = record
        self.tokenizer = load_gateway_tokenizer(config.model)
        self.admission = AdmissionController(config.gateway.max_concurrency, config.gateway.max_queue,
                                             self.faults.gateway_delay_ms / 1000.0, self._update_queue_gauges)
        self.router = Router(config.router_policy, num_replicas, config.block_size, self.faults.router_skew,
                             seed=config.seed)
        self.replicas = [ReplicaClient(i, config, self.faults, probes, self.model_name, recorder_kwargs)
                         for i in range(num_replicas)]
        self.num_in_flight = [0] * num_replicas
        self.records: list[GatewayRecord] = []
        self.replica_families: list[list] = [[] for _ in range(num_replicas)]
        self.replica_stats: list[dict[str, Any]] = [{} for _ in range(num_replicas)]
        self.max_model_len = 0
        self.vocab_size = 0
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._collect: dict[int, concurrent.futures.Future] = {}
        self._started = False
        self._stopping = False
        from layerscope.engine.gateway.replica import make_recorder
        from layerscope.probes.metrics import create_metrics

        # the gateway's own recorder: its spans, its request fields, its metric set. It keeps
        # everything until the run ends, so a long-lived server (record=False) runs without one.
        # "full" adds profiler windows and py-spy, which are about engine steps: the gateway
        # records at "default" (and so never imports torch)
        gw_probes = "off" if not record or probes == "off" else "default"
        self.recorder = make_recorder(gw_probes, "gateway", self.model_name)
        self.recording = self.recorder.enabled
        if self.recording:
            self.recorder.configure(config)
        self.metrics = self.recorder.metrics if self.recording else create_metrics(model_name=self.model_name,
                                                                                     replica="gateway")

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> None:
        """Start every replica process and block until each has loaded its engine."""
        from layerscope.engine.gateway.protocol import warm_up

        for r in self.replicas:
            r.start()
        warm_up(self.tokenizer)  # while the replicas load
        try:
            infos = [r.wait_ready(timeout_s) for r in self.replicas]
        except Exception:
            self.shutdown()
            raise
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.vocab_size = infos[0]["resolved"]["vocab_size"]
        self.resolved = [i["resolved"] for i in infos]
        self.warmup = [i.get("warmup") for i in infos]  # engine/warmup.py, per replica
        for r in self.replicas:
            r.start_reader(self._on_message)
        if self.recording:
            self.recorder.configure(resolved=self.resolved[0])
            self.recorder.start()
        self._started = True

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block (from another thread) until no request is in flight at the gateway: a client can
        see the end of a stream a moment before the gateway closes its record."""
        deadline = time.monotonic() + timeout_s
        while self._streams or self.admission.num_waiting:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the event loop that serves HTTP (deltas are dispatched onto it)."""
        self._loop = loop

    @property
    def is_healthy(self) -> bool:
        return self._started and any(r.alive for r in self.replicas)

    def shutdown(self) -> None:
        """Abort what is in flight, stop the replicas (idempotent)."""
        for s in list(self._streams.values()):
            self._fail(s, APIError(503, "the server is shutting down", type="server_error"))
        self._stopping = True
        for r in self.replicas:
            r.shutdown()
        self._started = False

    # ---- request path -------------------------------------------------------------------------
    def new_record(self, api: str, stream: bool, session_id: str | None = None,
                   traceparent: str | None = None) -> GatewayRecord:
        """``traceparent``: the caller's W3C trace context; the request's root span becomes its child."""
        prefix = "chatcmpl" if api == "chat" else "cmpl"
        rec = GatewayRecord(f"{prefix}-{uuid.uuid4().hex[:24]}", api, stream, time.monotonic_ns(), session_id)
        if self.record:
            self.records.append(rec)
        if self.recording:
            rec.traceparent = self.recorder.gateway_begin(rec.request_id, rec.gateway_arrival_ns, traceparent)
        return rec

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Validate against the context length; returns max_tokens (None -> what fits)."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                f"has {num_prompt_tokens} tokens (it must leave room for at least one output "
                                f"token).", param="messages", code="context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                                f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    async def submit(self, rec: GatewayRecord, token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Admission (may wait; QueueFull -> APIError 429), routing, hand-off to a replica."""
        rec.num_prompt_tokens = len(token_ids)
        try:
            await self.admission.acquire()
        except QueueFullError as e:
            self.metrics.child("layerscope_request_errors_total", "rejected").inc()
            raise APIError(429, str(e), type="rate_limit_exceeded", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.config.gateway.retry_after_s)}) from None
        rec.gateway_admitted_ns = time.monotonic_ns()
        if not self.recording:  # the recorder's gateway_end observes it otherwise
            self.metrics.child("layerscope_gateway_queue_time_seconds").observe(
                (rec.gateway_admitted_ns - rec.gateway_arrival_ns) / 1e9)
        try:
            alive = [r.alive for r in self.replicas]
            if not any(alive):
                raise APIError(503, "no engine replica is running", type="server_error")
            idx = self.router.choose(token_ids, self.num_in_flight, alive)
        except BaseException:
            self.admission.release()
            raise
        stream = RequestStream(rec)
        rec.replica = idx
        self._streams[rec.request_id] = stream
        self.num_in_flight[idx] += 1
        self.metrics.collectors["layerscope_router_requests_total"].labels(self.model_name, str(idx)).inc()
        timeout = self.config.gateway.request_timeout_s
        stream.timer = asyncio.get_running_loop().call_later(timeout, self._timeout, stream, timeout)
        rec.gateway_routed_ns = time.monotonic_ns()
        self.replicas[idx].send(("add", rec.request_id, token_ids, params, rec.traceparent,
                                 {"gateway_arrival_ns": rec.gateway_arrival_ns,
                                  "gateway_admitted_ns": rec.gateway_admitted_ns,
                                  "gateway_routed_ns": rec.gateway_routed_ns}))
        return stream

    def close(self, stream: RequestStream, http_status: int, error: str | None = None) -> None:
        """The HTTP side is done with a request (finished, failed or client gone); idempotent.

        Aborts it in the engine unless the engine already finished it, releases its
        admission slot and completes its record and metrics.
        """
        if stream.closed:
            return
        stream.closed = True
        rec = stream.record
        rec.gateway_finished_ns = time.monotonic_ns()
        rec.http_status = http_status
        if stream.timer is not None:
            stream.timer.cancel()
        if not stream.engine_done and rec.replica is not None:
            replica = self.replicas[rec.replica]
            if replica.alive:
                replica.send(("abort", rec.request_id))
            rec.finish_reason = "abort"
        rec.status = "error" if error and rec.finish_reason != "abort" else _STATUS.get(rec.finish_reason, "error")
        rec.error = error
        self._streams.pop(rec.request_id, None)
        if rec.replica is not None:
            self.num_in_flight[rec.replica] -= 1
        self.admission.release()
        self._observe(rec)

    def reject(self, rec: GatewayRecord, err: APIError) -> None:
        """Record a request refused before it reached an engine (4xx/5xx)."""
        rec.gateway_finished_ns = time.monotonic_ns()
        rec.http_status = err.status
        rec.error = err.message
        if err.status == 499:  # the client left while queued
            rec.status, rec.finish_reason = "finished_aborted", "abort"
        else:
            rec.status = "rejected" if err.status == 429 else "error"
            if err.status != 429:
                kind = "invalid" if err.status < 500 else "error"
                self.metrics.child("layerscope_request_errors_total", kind).inc()
        self._end_record(rec)

    def _end_record(self, rec: GatewayRecord) -> None:
        """Hand the finished record to the gateway recorder (spans, its metrics), else count it."""
        if self.recording:
            self.recorder.gateway_end(
                rec.request_id, status=rec.status, http_status=rec.http_status, error=rec.error,
                attributes=gen_ai_attributes(rec, self.model_name),
                **{k: getattr(rec, k) for k in ("gateway_admitted_ns", "gateway_routed_ns", "gateway_first_token_ns",
                                                "gateway_finished_ns", "replica") if getattr(rec, k) is not None})
        else:
            self.metrics.child("layerscope_gateway_requests_total", str(rec.http_status)).inc()

    def _observe(self, rec: GatewayRecord) -> None:
        self._end_record(rec)
        m = self.metrics
        if rec.ttft_s is not None:
            m.child("layerscope_time_to_first_token_seconds").observe(rec.ttft_s)
            itl = m.child("layerscope_inter_token_latency_seconds")
            for gap in rec.itl_s:
                itl.observe(gap)
            if rec.tpot_s is not None:
                m.child("layerscope_time_per_output_token_seconds").observe(rec.tpot_s)
            if rec.e2e_s is not None and rec.status != "finished_aborted":
                m.child("layerscope_e2e_request_latency_seconds").observe(rec.e2e_s)

    def _update_queue_gauges(self) -> None:
        self.metrics.child("layerscope_gateway_queue_length").set(self.admission.num_waiting)
        self.metrics.child("layerscope_gateway_inflight_requests").set(self.admission.num_active)

    def _timeout(self, stream: RequestStream, timeout_s: float) -> None:
        self.metrics.child("layerscope_request_errors_total", "timeout").inc()
        self._fail(stream, APIError(504, f"the request did not finish within gateway.request_timeout_s="
                                         f"{timeout_s:g} s", type="server_error", code="timeout"))

    def _fail(self, stream: RequestStream, err: APIError) -> None:
        stream.queue.put_nowait(err)

    # ---- replica messages ---------------------------------------------------------------------
    def _on_message(self, idx: int, msg: tuple) -> None:
        """Runs on a replica's reader thread."""
        kind = msg[0]
        if kind == "metrics":
            self.replica_families[idx] = msg[1]
            self.replica_stats[idx] = msg[2]
        elif kind == "records":
            fut = self._collect.pop(idx, None)
            if fut is not None:
                fut.set_result(msg[1])
        elif self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._dispatch, idx, msg)
            except RuntimeError:  # the loop closed meanwhile (shutdown)
                pass
        if kind in ("fatal", "exit"):
            if not self._stopping:
                logger.error("%s", msg[1] if kind == "fatal" else f"replica {idx} exited")
            fut = self._collect.pop(idx, None)
            if fut is not None:
                fut.set_result(None)

    def _dispatch(self, idx: int, msg: tuple) -> None:
        """Runs on the event loop."""
        kind = msg[0]
        if kind == "out":
            streams = self._streams
            for d in msg[1]:
                s = streams.get(d.request_id)
                if s is not None:  # else: aborted meanwhile
                    s.queue.put_nowait(d)
        elif kind == "error":
            s = self._streams.get(msg[1])
            if s is not None:
                s.engine_done = True  # never added
                self._fail(s, APIError(400, msg[2]))
        elif kind in ("fatal", "exit"):
            for s in list(self._streams.values()):
                if s.record.replica == idx:
                    s.engine_done = True
                    self._fail(s, APIError(503, f"engine replica {idx} failed", type="server_error"))

    # ---- records and metrics ------------------------------------------------------------------
    def collect_replica_records(self, timeout_s: float = 60.0) -> list[Any]:
        """Each replica's recorder export (None where probes are off); call from a non-loop thread."""
        futs = {}
        for r in self.replicas:
            if r.alive:
                futs[r.index] = self._collect[r.index] = concurrent.futures.Future()
                r.send(("collect",))
        out: list[Any] = [None] * len(self.replicas)
        for i, fut in futs.items():
            try:
                out[i] = fut.result(timeout_s)
            except concurrent.futures.TimeoutError:
                logger.warning("replica %d sent no records within %.0f s", i, timeout_s)
        return out

    def metrics_text(self) -> bytes:
        """Prometheus exposition: the gateway's own metrics plus every replica's last snapshot."""
        from prometheus_client import CollectorRegistry, generate_latest

        from layerscope.engine.gateway.exposition import MergedCollector

        reg = CollectorRegistry(auto_describe=False)
        reg.register(MergedCollector(self.metrics.registry, self.replica_families))
        return generate_latest(reg)
