"""The gateway core: admission -> router -> replica hand-off, and the way back.

(Over 400 lines: one object owns the request path and the replica messages, records and
drains included, all on one event loop; HTTP is in server.py, replicas in replica.py.)

``Gateway`` owns the replica processes, the admission queue, the router and every
request in flight. It runs on one asyncio event loop (the HTTP server's); replica
reader threads hop onto that loop with ``call_soon_threadsafe`` and drop each token
delta into its request's ``asyncio.Queue``. Nothing here parses HTTP: ``server.py``
does, and calls ``tokenize`` / ``submit`` / ``close``.

Probes are reached only through the engine's recorder seam: the gateway's own
``GatewayRecorder`` and, in each replica, a ``Recorder``, both made by the
``RecorderFactory`` the caller hands in (no-ops by default: probes off).

Every hop is stamped with ``time.monotonic_ns()`` (one clock for every process on the
host) in a ``GatewayRecord``: gateway arrival, admitted, routed (handed to the replica's
queue), engine arrival (stamped by the replica), first token and finish as the HTTP
stream wrote them. Those feed the run bundle's ``gateway.queue`` / ``gateway.route`` /
``engine.output`` layers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from layerscope.contract import STATUS_OF_FINISH_REASON
from layerscope.engine.config import EngineConfig
from layerscope.engine.faults import Faults
from layerscope.engine.models.checkpoint import check_model_dir
from layerscope.engine.gateway.admission import AdmissionController, QueueFullError
from layerscope.engine.gateway.messages import (
    AbortRequest,
    AddRequest,
    CollectRecords,
    Drained,
    DrainRecords,
    Exited,
    Fatal,
    MetricsSnapshot,
    Outputs,
    Records,
    RequestError,
)
from layerscope.engine.gateway.protocol import APIError
from layerscope.engine.gateway.records import GatewayRecord, RequestStream
from layerscope.engine.gateway.replica import ReplicaClient
from layerscope.engine.gateway.router import Router
from layerscope.engine.recorder import GatewayRequest, NullRecorders, RecorderFactory
from layerscope.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)



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


def num_model_layers(model_dir: str | Path) -> int | None:
    """``num_hidden_layers`` from the checkpoint's config.json, read without torch (None if absent)."""
    path = Path(model_dir) / "config.json"
    try:
        return int(json.loads(path.read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Gateway:
    """Admission, routing and the replica processes behind one OpenAI-compatible endpoint."""

    def __init__(self, config: EngineConfig, faults: Faults | None = None, num_replicas: int = 1,
                 recorders: RecorderFactory | None = None, served_model_name: str | None = None,
                 record: bool = True, rolling: bool = False):
        """``recorders``: makes the gateway's recorder and every replica's (``probes.serving.recorders``;
        None: probes off); ``record``: keep a GatewayRecord per request in ``records`` and every
        request's probes record (a run; not a long-lived server); ``rolling``: record every request
        for a rolling bundle, which takes what is done with ``drain_records()`` (a long-lived server).

        Faults are checked against this run (replicas, TP, the model's rows) before anything starts.
        """
        if num_replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
        check_model_dir(config.model)  # a missing or wrong path says what is there, before anything starts
        self.faults = faults or Faults()
        self.faults.check(tp_size=config.tp_size, num_replicas=num_replicas, num_layers=num_model_layers(config.model))
        if config.num_threads == 0 and config.device != "cuda":
            # replicas share the host's cores with each other and with this process (HTTP, and the
            # load generator under `run`): one intra-op thread per core each would oversubscribe
            # them, and torch's spinning threads then stall each other (on 2 cores, TTFT went
            # from ~4 ms to ~1 s). Leave a core to the gateway and split the rest.
            threads = max(1, ((os.cpu_count() or 1) - 1) // (num_replicas * config.tp_size))
            config = EngineConfig.from_overrides(config, num_threads=threads)
        self.config = config
        recorders = recorders or NullRecorders()
        self.probes = recorders.level
        self.model_name = served_model_name or config.model
        self.record = record
        from prometheus_client import ProcessCollector

        self._process_collector = ProcessCollector(registry=None)  # /metrics' process_* families (made once)
        self.tokenizer = load_gateway_tokenizer(config.model)
        self.admission = self.faults.wrap_admission(
            AdmissionController(config.gateway.max_concurrency, config.gateway.max_queue, self._update_queue_gauges))
        self.router = self.faults.wrap_router(Router(config.router_policy, num_replicas, config.block_size),
                                              seed=config.seed)
        # a server (no whole-run record) with probes: each replica's records leave it with every metrics
        # push, as its recorder's drain(); this process feeds their metrics (its recorder's
        # replica_drained) and keeps the drains for a rolling bundle: the replicas' step loops feed none
        self.ships = recorders.level != "off" and not record
        self._keep_drains = rolling and self.ships
        self._pending_drains: list[list[Any]] = [[] for _ in range(num_replicas)]
        self._drains_lock = threading.Lock()
        self.replicas = [ReplicaClient(i, config, self.faults, recorders, self.model_name, ship_records=self.ships)
                         for i in range(num_replicas)]
        self.num_in_flight = [0] * num_replicas
        self.records: list[GatewayRecord] = []
        self.num_answered = 0  # requests the gateway is done with (answered, failed or refused)
        self.replica_families: list[list] = [[] for _ in range(num_replicas)]
        self.replica_stats: list[dict[str, Any]] = [{} for _ in range(num_replicas)]
        self.max_model_len = 0
        self.vocab_size = 0
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._collect: dict[int, concurrent.futures.Future] = {}
        self._drain: dict[int, concurrent.futures.Future] = {}
        self._started = False
        self._stopping = False
        # the gateway's own recorder: its metrics, and with ``record`` its spans and request fields
        self.recorder = recorders.gateway(self.model_name, keep_requests=record or rolling)
        self.recording = self.recorder.enabled
        self.recorder.configure(config)

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
        self.max_model_len = min(i.max_model_len for i in infos)
        self.vocab_size = infos[0].resolved["vocab_size"]
        self.resolved = [i.resolved for i in infos]
        self.warmup = [i.warmup for i in infos]  # engine/warmup.py, per replica
        for r in self.replicas:
            r.start_reader(self._on_message)
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
        rec.traceparent = self.recorder.request_arrived(rec.request_id, rec.gateway_arrival_ns, traceparent)
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
            self.recorder.request_refused("rejected")
            raise APIError(429, str(e), type="rate_limit_exceeded", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.config.gateway.retry_after_s)}) from None
        rec.gateway_admitted_ns = time.monotonic_ns()
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
        self.recorder.request_routed(idx)
        timeout = self.config.gateway.request_timeout_s
        stream.timer = asyncio.get_running_loop().call_later(timeout, self._timeout, stream, timeout)
        rec.gateway_routed_ns = time.monotonic_ns()
        self.replicas[idx].send(AddRequest(rec.request_id, token_ids, params, rec.traceparent,
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
                replica.send(AbortRequest(rec.request_id))
            rec.finish_reason = "abort"
        rec.status = "error" if error and rec.finish_reason != "abort" else STATUS_OF_FINISH_REASON.get(rec.finish_reason, "error")
        rec.error = error
        self._streams.pop(rec.request_id, None)
        if rec.replica is not None:
            self.num_in_flight[rec.replica] -= 1
        self.admission.release()
        self._end_record(rec, latencies=True)

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
                self.recorder.request_refused("invalid" if err.status < 500 else "error")
        self._end_record(rec, latencies=False)

    def _end_record(self, rec: GatewayRecord, latencies: bool) -> None:
        """Hand the finished record to the gateway recorder (request fields, spans, metrics)."""
        fields = {k: getattr(rec, k) for k in ("status", "http_status", "error", "gateway_arrival_ns",
                                               "gateway_admitted_ns", "gateway_routed_ns", "gateway_first_token_ns",
                                               "gateway_finished_ns", "replica") if getattr(rec, k) is not None}
        self.num_answered += 1
        done = GatewayRequest(rec.request_id, fields, attributes=gen_ai_attributes(rec, self.model_name))
        if latencies and rec.ttft_s is not None:
            done.ttft_s, done.itl_s, done.tpot_s = rec.ttft_s, rec.itl_s, rec.tpot_s
            done.e2e_s = rec.e2e_s if rec.status != "finished_aborted" else None
        self.recorder.request_done(done)

    def _update_queue_gauges(self) -> None:
        self.recorder.queue_changed(self.admission.num_waiting, self.admission.num_active)

    def _timeout(self, stream: RequestStream, timeout_s: float) -> None:
        self.recorder.request_refused("timeout")
        self._fail(stream, APIError(504, f"the request did not finish within gateway.request_timeout_s="
                                         f"{timeout_s:g} s", type="server_error", code="timeout"))

    def _fail(self, stream: RequestStream, err: APIError) -> None:
        stream.queue.put_nowait(err)

    # ---- replica messages ---------------------------------------------------------------------
    def _on_message(self, idx: int, msg: object) -> None:
        """Runs on a replica's reader thread."""
        if isinstance(msg, MetricsSnapshot):
            self.replica_families[idx] = msg.families
            self.replica_stats[idx] = msg.stats
            if msg.drain is not None:  # a replica that ships its records (one that cannot, e.g. exporting
                # OTLP spans itself, pushes its families and answers DrainRecords with its drain)
                try:
                    self.recorder.replica_drained(idx, msg.drain, msg.stats)
                except Exception:  # noqa: BLE001 - a drain the metrics could not take is still kept
                    logger.exception("replica %d: feeding the metrics of its drain failed", idx)
                self._keep_drain(idx, msg.drain)
        elif isinstance(msg, Records):
            fut = self._collect.pop(idx, None)
            if fut is not None:
                fut.set_result(msg.export)
        elif isinstance(msg, Drained):
            if self.ships and msg.export is not None:  # a replica that could not ship answers with its drain;
                self._keep_drain(idx, msg.export)  # a shipping one's came just before, with a push
            fut = self._drain.pop(idx, None)
            if fut is not None:
                fut.set_result(self._take_drains(idx) if self.ships else msg.export)
        elif self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._dispatch, idx, msg)
            except RuntimeError:  # the loop closed meanwhile (shutdown)
                pass
        if isinstance(msg, (Fatal, Exited)):
            if not self._stopping:
                logger.error("%s", msg.message if isinstance(msg, Fatal) else f"replica {idx} exited")
            fut = self._collect.pop(idx, None)
            if fut is not None:
                fut.set_result(None)
            fut = self._drain.pop(idx, None)
            if fut is not None:
                fut.set_result(self._take_drains(idx) if self.ships else None)

    def _dispatch(self, idx: int, msg: object) -> None:
        """Runs on the event loop."""
        if isinstance(msg, Outputs):
            streams = self._streams
            for d in msg.deltas:
                s = streams.get(d.request_id)
                if s is not None:  # else: aborted meanwhile
                    s.queue.put_nowait(d)
        elif isinstance(msg, RequestError):
            s = self._streams.get(msg.request_id)
            if s is not None:
                s.engine_done = True  # never added
                self._fail(s, APIError(400, msg.message))
        elif isinstance(msg, (Fatal, Exited)):
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
                r.send(CollectRecords())
        out: list[Any] = [None] * len(self.replicas)
        for i, fut in futs.items():
            try:
                out[i] = fut.result(timeout_s)
            except concurrent.futures.TimeoutError:
                logger.warning("replica %d sent no records within %.0f s", i, timeout_s)
        return out

    def _keep_drain(self, idx: int, drain: Any) -> None:
        if self._keep_drains:  # for the rolling bundle's next part (drain_records)
            with self._drains_lock:
                self._pending_drains[idx].append(drain)

    def _take_drains(self, idx: int) -> list[Any]:
        with self._drains_lock:
            got, self._pending_drains[idx] = self._pending_drains[idx], []
        return got

    def drain_records(self, timeout_s: float = 60.0) -> tuple[Any, list[Any]]:
        """What every recorder has done since the last drain, dropped from their memory: the gateway
        recorder's ``drain()`` (taken on the event loop, which owns it) and the replicas' drains, in
        order (each replica's ``drain()``, None where probes are off or the replica is gone; where the
        replicas ship their records, every drain they pushed since, the last one asked for now). Call
        from a non-loop thread (the rolling bundle's)."""
        futs = {}
        for r in self.replicas:
            if r.alive:
                futs[r.index] = self._drain[r.index] = concurrent.futures.Future()
                r.send(DrainRecords())
        own: concurrent.futures.Future = concurrent.futures.Future()

        def drain_own() -> None:
            try:
                own.set_result(self.recorder.drain())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                own.set_exception(e)

        loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            loop.call_soon_threadsafe(drain_own)
        else:  # no loop (yet, or any more): nothing else touches the recorder
            drain_own()
        out: list[Any] = [None] * len(self.replicas)
        for i, fut in futs.items():
            try:
                out[i] = fut.result(timeout_s)
            except concurrent.futures.TimeoutError:
                self._drain.pop(i, None)
                logger.warning("replica %d sent no drained records within %.0f s", i, timeout_s)
        if self.ships:  # a list per replica (a gone one's last pushes too): one flat list, each replica's in order
            out = [d for i in range(len(self.replicas)) for d in (out[i] or []) + self._take_drains(i)]
        return own.result(timeout_s), out

    def metrics_text(self) -> bytes:
        """Prometheus exposition: the gateway's own metrics plus every replica's last snapshot, and the
        serving process's ``process_*`` families (its start time, CPU seconds, memory), as vLLM's and
        SGLang's default registries expose them: an external comparison reads the start time to tell
        that one server process served both runs."""
        from prometheus_client import CollectorRegistry, generate_latest

        from layerscope.engine.gateway.exposition import MergedCollector

        reg = CollectorRegistry(auto_describe=False)
        reg.register(MergedCollector(self.recorder.metric_families, self.replica_families))
        reg.register(self._process_collector)
        return generate_latest(reg)
