"""Engine replicas as separate processes, so the HTTP event loop never waits on a forward pass.

Child side (``replica_main``): an ``LLMEngine`` in a loop. Between steps it drains its
inbox (add / abort / collect / drain / shutdown), then runs one step and sends that step's
token deltas back in one message. It pushes a metrics snapshot (the probes registry's
families) at most every ``METRICS_INTERVAL_S`` while busy and whenever it goes idle,
so a scrape at the gateway sees the idle state (KV usage back to its idle value) as
soon as the last request finished or was aborted.

Parent side (``ReplicaClient``): owns the process and its two queues; a reader thread
hands every message to a callback (the gateway dispatches it onto its event loop).
``multiprocessing.Queue.put`` never blocks the caller (a feeder thread writes the pipe).

Messages: the dataclasses of ``messages.py``. The replica makes its recorder from the
run's ``RecorderFactory`` and talks to it only through the engine's recorder seam.
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
from typing import Any, Callable

from layerscope.engine.faults import Faults
from layerscope.engine.gateway.messages import (AbortRequest, AddRequest, CollectRecords, Drained, DrainRecords, Exited,
                                                Fatal, MetricsSnapshot, Outputs, Ready, Records, RequestError, Shutdown,
                                                TokenDelta)
from layerscope.engine.recorder import Recorder, RecorderFactory
from layerscope.engine.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

METRICS_INTERVAL_S = 0.5


# ---- child process ------------------------------------------------------------------------------
def _delta(out) -> TokenDelta:
    return TokenDelta(out.request_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason,
                      out.stop_reason, len(out.prompt_token_ids), out.num_cached_tokens, len(out.token_ids),
                      out.arrival_ns, out.first_token_ns, out.finished_ns, out.num_preemptions,
                      out.text if out.finished else None,
                      None if out.logprobs is None else out.logprobs[len(out.logprobs) - len(out.new_token_ids):])


def replica_main(index: int, config, faults: Faults, recorders: RecorderFactory, model_name: str,
                 inbox, outbox, ship_records: bool = False) -> None:
    """Entry point of a replica process: load the engine, then serve the inbox until shutdown.
    ``ship_records``: every metrics push carries the recorder's ``drain()`` (the gateway feeds the
    metrics from it and keeps it for a rolling bundle) instead of the recorder's metric families."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ctrl-C reaches the whole process group: the gateway stops us. SIGTERM (to us or the
    # group) ends the loop cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminated: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    from layerscope.engine.llm_engine import LLMEngine

    try:
        recorder: Recorder = recorders.engine(index, model_name, ship_records=ship_records)
        engine = LLMEngine(config, recorder=recorder, faults=faults)
        from layerscope.engine.warmup import freeze_startup_heap, warm_up

        warmup = warm_up(engine)  # before "ready": /health is ok only once the engine is warm
        recorder.configure(engine.config, engine.resolved)
        recorder.start()
        warmup["gc_frozen_objects"] = freeze_startup_heap()
    except Exception as e:  # noqa: BLE001 - reported to the gateway, which refuses to start
        outbox.put(Fatal(f"replica {index} failed to start: {type(e).__name__}: {e}"))
        return
    outbox.put(Ready(index, os.getpid(), engine.resolved.to_dict(), engine.max_model_len, warmup))
    replica = _Replica(index, engine, recorder, outbox)
    try:
        replica.serve(inbox, terminated)
    except Exception:  # noqa: BLE001 - the engine broke: tell the gateway, then exit
        outbox.put(Fatal(f"replica {index} crashed:\n{traceback.format_exc()}"))
    finally:
        try:
            engine.shutdown()
            recorder.shutdown()
        finally:
            outbox.put(Exited())


class _Replica:
    """The loop of a started replica: the inbox between steps, a step, a metrics push when due."""

    def __init__(self, index: int, engine, recorder: Recorder, outbox) -> None:
        self.index, self.engine, self.recorder, self.outbox = index, engine, recorder, outbox
        self.ships = bool(getattr(recorder, "ships", False))
        self.last_push = time.monotonic()
        self.dirty = False  # something changed since the last metrics push

    def drain(self) -> Any:
        """The recorder's ``drain()``; a broken drain loses its records, not the replica."""
        try:
            return self.recorder.drain()
        except Exception:  # noqa: BLE001
            logger.exception("replica %d: drain() failed", self.index)
            return None

    def snapshot(self) -> MetricsSnapshot:
        stats = self.engine.stats()
        if self.ships:
            return MetricsSnapshot([], stats, self.drain())
        return MetricsSnapshot(self.recorder.metric_families(stats), stats)

    def serve(self, inbox, terminated: list[bool]) -> None:
        engine, outbox = self.engine, self.outbox
        outbox.put(self.snapshot())  # the idle state, before the first request
        parent = mp.parent_process()
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
                return  # the gateway died without telling us
            stop = False
            for msg in msgs:
                stop = self.handle(msg) or stop
            if stop or terminated:
                return
            if engine.has_unfinished_requests():
                outs = engine.step()
                if outs:
                    outbox.put(Outputs([_delta(o) for o in outs]))
                    self.dirty = True
                else:
                    time.sleep(0.001)  # nothing schedulable this instant; don't spin
            now = time.monotonic()
            idle = not engine.has_unfinished_requests()
            if self.dirty and (idle or now - self.last_push >= METRICS_INTERVAL_S):
                outbox.put(self.snapshot())
                self.last_push, self.dirty = now, False

    def handle(self, msg) -> bool:
        """Act on one inbox message; True for Shutdown."""
        engine, recorder, outbox = self.engine, self.recorder, self.outbox
        if isinstance(msg, AddRequest):
            rid = msg.request_id
            if msg.traceparent:
                recorder.set_traceparent(rid, msg.traceparent)
            recorder.set_request_timestamps(rid, **msg.gateway_fields)
            try:
                engine.add_request(msg.prompt_token_ids, msg.params, request_id=rid, arrival_ns=time.monotonic_ns())
            except InvalidRequestError as e:
                outbox.put(RequestError(rid, str(e)))
        elif isinstance(msg, AbortRequest):
            engine.abort_request(msg.request_id)
        elif isinstance(msg, CollectRecords):
            recorder.stop()  # ends the recording window (profiler, py-spy); the replica keeps serving
            outbox.put(Records(recorder.export()))
        elif isinstance(msg, DrainRecords):
            if self.ships:  # the drain goes with a push, which the gateway answers the request with
                outbox.put(self.snapshot())
                outbox.put(Drained(None))
                self.last_push = time.monotonic()
                return False
            outbox.put(Drained(self.drain()))
        elif isinstance(msg, Shutdown):
            self.dirty = True
            return True
        else:
            raise TypeError(f"replica {self.index}: unknown message {type(msg).__name__}")
        self.dirty = True
        return False


# ---- parent side --------------------------------------------------------------------------------
class ReplicaError(RuntimeError):
    pass


class ReplicaClient:
    """One replica process, seen from the gateway."""

    def __init__(self, index: int, config, faults: Faults, recorders: RecorderFactory, model_name: str,
                 ship_records: bool = False):
        ctx = mp.get_context("spawn")
        self.index = index
        self.inbox = ctx.Queue()
        self.outbox = ctx.Queue()
        # not a daemon: a replica with tp_size > 1 starts its own TP worker processes
        self.process = ctx.Process(target=replica_main, name=f"layerscope-replica-{index}",
                                   args=(index, config, faults, recorders, model_name, self.inbox, self.outbox,
                                         ship_records))
        self.info: Ready | None = None
        self.alive = False
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.process.start()

    def wait_ready(self, timeout_s: float) -> Ready:
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
            if isinstance(msg, Ready):
                self.info = msg
                self.alive = True
                return msg
            if isinstance(msg, Fatal):
                raise ReplicaError(msg.message)

    def start_reader(self, on_message: Callable[[int, object], None]) -> None:
        """Hand every message from the replica to ``on_message(index, msg)`` (on a reader thread)."""

        def loop() -> None:
            while True:
                try:
                    msg = self.outbox.get(timeout=0.5)
                except queue.Empty:
                    if self.process.is_alive():
                        continue
                    msg = Fatal(f"replica {self.index} died (exit code {self.process.exitcode})")
                except (EOFError, OSError):
                    msg = Fatal(f"replica {self.index}: connection lost")
                ended = isinstance(msg, (Fatal, Exited))
                if ended:
                    self.alive = False
                on_message(self.index, msg)
                if ended:
                    return

        self._reader = threading.Thread(target=loop, name=f"replica-{self.index}-reader", daemon=True)
        self._reader.start()

    def send(self, msg: AddRequest | AbortRequest | CollectRecords | DrainRecords | Shutdown) -> None:
        self.inbox.put(msg)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.process.is_alive():
            try:
                self.inbox.put(Shutdown())
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
