"""Engine replicas as separate processes, so the HTTP event loop never waits on a forward pass.

Child side (``replica_main``): an ``LLMEngine`` in a loop. Between steps it drains its
inbox (add / abort / collect / shutdown), then runs one step and sends that step's
token deltas back in one message. It pushes a metrics snapshot (the probes registry's
families) at most every ``METRICS_INTERVAL_S`` while busy and whenever it goes idle,
so a scrape at the gateway sees the idle state (KV usage back to its idle value) as
soon as the last request finished or was aborted.

Parent side (``ReplicaClient``): owns the process and its two queues; a reader thread
hands every message to a callback (the gateway dispatches it onto its event loop).
``multiprocessing.Queue.put`` never blocks the caller (a feeder thread writes the pipe).

Messages (tuples, first item the kind):
  parent -> child: ("add", rid, prompt_token_ids, SamplingParams, traceparent | None, gateway fields),
                   ("abort", rid), ("collect",), ("shutdown",)
  child -> parent: ("ready", info), ("out", [TokenDelta, ...]), ("error", rid, message),
                   ("metrics", families, stats), ("records", payload), ("fatal", message), ("exit",)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable, NamedTuple

logger = logging.getLogger(__name__)

METRICS_INTERVAL_S = 0.5


class TokenDelta(NamedTuple):
    """One request's output from one engine step (one token), as sent to the gateway."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    engine_arrival_ns: int
    engine_first_token_ns: int | None
    engine_finished_ns: int | None
    num_preemptions: int
    text: str | None = None  # the whole output text, on the finished delta only (stop strings cut it)
    logprobs: list | None = None  # the new tokens' {token_id: Logprob}, when the request asked for them


# ---- child process ------------------------------------------------------------------------------
def make_recorder(probes: str, replica: int | str, model_name: str, **kwargs: Any):
    """This process's recorder: probes' ProbeRecorder, or the engine's no-op one when probes are off.

    ``kwargs`` go to ProbeRecorder (``pyspy=False``, ``profile_max_windows=0``, ...).
    """
    from layerscope.engine.recorder import Recorder

    if probes == "off":
        return Recorder()
    from layerscope.probes.recorder import ProbeRecorder

    return ProbeRecorder(probes, replica=replica, model_name=model_name, **kwargs)


class _EngineMetrics:
    """Keeps the registry's engine gauges current from ``engine.stats()``; when the recorder
    has no metric set of its own (probes off), also the counters it would keep."""

    def __init__(self, recorder, model_name: str, replica: int):
        from layerscope.probes.metrics import create_metrics

        own = getattr(recorder, "metrics", None)
        # the recorder batches its Prometheus updates: flush before every snapshot
        self._flush = getattr(recorder, "flush_metrics", None) if own is not None else None
        self.owns_counters = own is None
        self.metrics = own if own is not None else create_metrics(model_name=model_name, replica=replica)
        self._last: dict[str, Any] = {}
        self._g = {k: self.metrics.child(k) for k in ("layerscope_num_requests_running",
                                                      "layerscope_num_requests_waiting",
                                                      "layerscope_kv_cache_usage_perc")}

    def snapshot(self, stats: dict[str, Any]) -> list:
        """The registry's families with the recorder's pending updates in and the gauges set
        from ``stats`` (the state now, which may be newer than the last step's)."""
        if self._flush is not None:
            self._flush()
        self.update(stats)
        return list(self.metrics.registry.collect())

    def update(self, stats: dict[str, Any]) -> None:
        self._g["layerscope_num_requests_running"].set(stats["num_running"])
        self._g["layerscope_num_requests_waiting"].set(stats["num_waiting"])
        self._g["layerscope_kv_cache_usage_perc"].set(stats["kv_cache_usage"])
        if self.owns_counters:
            for key, name in (("num_prefix_queries", "layerscope_prefix_cache_queries_total"),
                              ("num_prefix_hits", "layerscope_prefix_cache_hits_total"),
                              ("num_preemptions", "layerscope_num_preemptions_total")):
                delta = stats[key] - self._last.get(key, 0)
                if delta > 0:
                    self.metrics.child(name).inc(delta)
        self._last = dict(stats)

    def on_finished(self, d: TokenDelta) -> None:
        if self.owns_counters and d.finish_reason:
            self.metrics.child("layerscope_request_success_total", d.finish_reason).inc()
            self.metrics.child("layerscope_prompt_tokens_total").inc(d.num_prompt_tokens)

    def on_tokens(self, n: int) -> None:
        if self.owns_counters and n:
            self.metrics.child("layerscope_generation_tokens_total").inc(n)


def _delta(out) -> TokenDelta:
    return TokenDelta(out.request_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason,
                      out.stop_reason, len(out.prompt_token_ids), out.num_cached_tokens, len(out.token_ids),
                      out.arrival_ns, out.first_token_ns, out.finished_ns, out.num_preemptions,
                      out.text if out.finished else None,
                      None if out.logprobs is None else out.logprobs[len(out.logprobs) - len(out.new_token_ids):])


def replica_main(index: int, config, faults, probes: str, model_name: str, recorder_kwargs: dict[str, Any],
                 inbox, outbox) -> None:
    """Entry point of a replica process: load the engine, then serve the inbox until shutdown."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ctrl-C reaches the whole process group: the gateway stops us. SIGTERM (to us or the
    # group) ends the loop cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    from layerscope.engine.llm_engine import LLMEngine
    from layerscope.engine.sampling_params import InvalidRequestError

    try:
        recorder = make_recorder(probes, index, model_name, **recorder_kwargs)
        engine = LLMEngine(config, recorder=recorder, faults=faults)
        if recorder.enabled:
            recorder.configure(engine.config, engine.resolved)
            recorder.start()
        metrics = _EngineMetrics(recorder, model_name, index)
    except Exception as e:  # noqa: BLE001 - reported to the gateway, which refuses to start
        outbox.put(("fatal", f"replica {index} failed to start: {type(e).__name__}: {e}"))
        return
    outbox.put(("ready", {"replica": index, "pid": os.getpid(), "resolved": engine.resolved.to_dict(),
                          "max_model_len": engine.max_model_len}))
    stats = engine.stats()
    outbox.put(("metrics", metrics.snapshot(stats), stats))  # the idle state, before the first request
    parent = mp.parent_process()
    last_push = time.monotonic()
    dirty = False
    try:
        while True:
            busy = engine.has_unfinished_requests()
            msgs = []
            try:
                msgs.append(inbox.get_nowait() if busy else inbox.get(timeout=1.0))
                while True:
                    msgs.append(inbox.get_nowait())
            except queue.Empty:
                pass
            if not msgs and not busy and parent is not None and not parent.is_alive():
                break  # the gateway died without telling us
            stop = False
            for msg in msgs:
                kind = msg[0]
                if kind == "add":
                    _, rid, ids, params, traceparent, outer = msg
                    if recorder.enabled:
                        if traceparent:
                            recorder.set_traceparent(rid, traceparent)
                        recorder.set_request_timestamps(rid, **outer)
                    try:
                        engine.add_request(ids, params, request_id=rid, arrival_ns=time.monotonic_ns())
                    except InvalidRequestError as e:
                        outbox.put(("error", rid, str(e)))
                elif kind == "abort":
                    engine.abort_request(msg[1])
                elif kind == "collect":
                    outbox.put(("records", _export_records(recorder)))
                elif kind == "shutdown":
                    stop = True
                dirty = True
            if stop or terminated:
                break
            if engine.has_unfinished_requests():
                outs = engine.step()
                if outs:
                    deltas = [_delta(o) for o in outs]
                    outbox.put(("out", deltas))
                    metrics.on_tokens(sum(len(d.new_token_ids) for d in deltas))
                    for d in deltas:
                        if d.finished:
                            metrics.on_finished(d)
                    dirty = True
                else:
                    time.sleep(0.001)  # nothing schedulable this instant; don't spin
            now = time.monotonic()
            idle = not engine.has_unfinished_requests()
            if dirty and (idle or now - last_push >= METRICS_INTERVAL_S):
                stats = engine.stats()
                outbox.put(("metrics", metrics.snapshot(stats), stats))
                last_push, dirty = now, False
    except Exception:  # noqa: BLE001 - the engine broke: tell the gateway, then exit
        outbox.put(("fatal", f"replica {index} crashed:\n{traceback.format_exc()}"))
    finally:
        try:
            engine.shutdown()
            if recorder.enabled:
                recorder.shutdown()
        finally:
            outbox.put(("exit",))


def _export_records(recorder) -> Any:
    """What the gateway merges into the run bundle: the recorder's ``export()`` (None without probes).
    Ends the recording window (profiler, py-spy); the replica keeps serving."""
    if not recorder.enabled:
        return None
    recorder.stop()
    return recorder.export()


# ---- parent side --------------------------------------------------------------------------------
class ReplicaError(RuntimeError):
    pass


class ReplicaClient:
    """One replica process, seen from the gateway."""

    def __init__(self, index: int, config, faults, probes: str, model_name: str,
                 recorder_kwargs: dict[str, Any] | None = None):
        ctx = mp.get_context("spawn")
        self.index = index
        self.inbox = ctx.Queue()
        self.outbox = ctx.Queue()
        # not a daemon: a replica with tp_size > 1 starts its own TP worker processes
        self.process = ctx.Process(target=replica_main, name=f"layerscope-replica-{index}",
                                   args=(index, config, faults, probes, model_name, recorder_kwargs or {},
                                         self.inbox, self.outbox))
        self.info: dict[str, Any] = {}
        self.alive = False
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.process.start()

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Block until the engine is loaded; raises ReplicaError if it fails or times out."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.outbox.get(timeout=0.5)
            except queue.Empty:
                if not self.process.is_alive():
                    raise ReplicaError(f"replica {self.index} exited with code {self.process.exitcode} "
                                       "before it was ready") from None
                if time.monotonic() > deadline:
                    raise ReplicaError(f"replica {self.index} not ready after {timeout_s:.0f} s") from None
                continue
            if msg[0] == "ready":
                self.info = msg[1]
                self.alive = True
                return self.info
            if msg[0] == "fatal":
                raise ReplicaError(msg[1])

    def start_reader(self, on_message: Callable[[int, tuple], None]) -> None:
        """Hand every message from the replica to ``on_message(index, msg)`` (on a reader thread)."""

        def loop() -> None:
            while True:
                try:
                    msg = self.outbox.get(timeout=0.5)
                except queue.Empty:
                    if self.process.is_alive():
                        continue
                    msg = ("fatal", f"replica {self.index} died (exit code {self.process.exitcode})")
                except (EOFError, OSError):
                    msg = ("fatal", f"replica {self.index}: connection lost")
                if msg[0] in ("fatal", "exit"):
                    self.alive = False
                on_message(self.index, msg)
                if msg[0] in ("fatal", "exit"):
                    return

        self._reader = threading.Thread(target=loop, name=f"replica-{self.index}-reader", daemon=True)
        self._reader.start()

    def send(self, msg: tuple) -> None:
        self.inbox.put(msg)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.process.is_alive():
            try:
                self.inbox.put(("shutdown",))
            except (OSError, ValueError):
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("replica %d did not stop in %.0f s; terminating it", self.index, timeout_s)
            self.process.terminate()
            self.process.join(5)
        self.alive = False
        if self._reader is not None:
            self._reader.join(2)
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()
            q.close()
