"""The engine's seam to probes: small recorder interfaces, no-ops by default.

``Recorder``: what one engine replica reports (steps, request events, collectives).
``GatewayRecorder``: what the gateway reports (its requests, its queue, its routing).
The engine and the gateway call these at fixed points and import nothing of probes;
``layerscope.probes`` implements them, and whoever assembles a run hands the gateway a
``RecorderFactory`` (picklable: replica processes get it through spawn). Nothing here
allocates or formats when probes are off (``NullRecorder``, ``NullRecorders``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Protocol, Sequence

if TYPE_CHECKING:
    from layerscope.engine.request import Request, RequestEvent


class StepRecord(NamedTuple):
    """One engine step. Durations in ns, timestamps on the monotonic clock (ns).

    A named tuple, not a dataclass: the engine builds one every step, right after the forward pass
    (caches cold), as ``tuple.__new__(StepRecord, fields)`` (one C call, against a Python
    ``__init__`` storing 27 attributes), its fields read by C-level getters, and a drain ships it
    as the plain tuple it is (``tuple(step)``) with nothing to call per step when pickling."""

    step_id: int
    start_ns: int
    end_ns: int
    schedule_ns: int
    prepare_ns: int
    forward_ns: int
    sample_ns: int
    output_ns: int
    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_kv_blocks_free: int
    num_kv_blocks_total: int
    num_preemptions: int  # in this step
    num_prefix_queries: int  # tokens queried against the prefix cache in this step
    num_prefix_hits: int  # tokens found
    request_ids: Sequence[str] = ()  # requests computed in this step
    request_num_tokens: Sequence[int] = ()  # their tokens this step
    replica: int = 0
    sampled_ids: Sequence[str] = ()  # the requests that got a token in this step (the engine passes the
    # request_ids list itself when every request of the step got one: read it, never mutate either)
    # the step loop thread's CPU time (time.thread_time_ns) and run-queue wait (/proc schedstat's 2nd
    # field) over the step, and over the model's execution (prepare, forward, sample: the executor's call);
    # None where not measured (probes off, a step inside Recorder.work_gap_ns, schedstat unreadable)
    cpu_ns: int | None = None
    wait_ns: int | None = None
    forward_cpu_ns: int | None = None
    forward_wait_ns: int | None = None


@dataclass(slots=True)
class CollectiveRecord:
    op: str  # all_reduce, all_gather, broadcast
    rank: int
    step_id: int
    num_bytes: int
    start_ns: int
    duration_ns: int
    wait_ns: int  # time waiting for the slowest rank (skew)
    name: str = ""  # layer row that issued it


class RunRecorder:
    """The run lifecycle both recorders share (no-ops)."""

    enabled: bool = False  # records anything at all

    def configure(self, config=None, resolved=None) -> None:
        """Take the engine's config (``EngineConfig``) and resolved record, for the manifest."""

    def start(self) -> None:
        """Mark the start of the recorded run."""

    def stop(self) -> None:
        """Mark its end (closes profiler windows and the like)."""

    def export(self) -> dict[str, Any] | None:
        """Everything recorded, as plain data another process can merge into a bundle (None: nothing)."""
        return None

    def drain(self) -> Any:
        """What is done since the last drain (finished requests' rows, steps no live request needs,
        layers, collectives, kernels, spans), as picklable data of the implementation's own type (the
        probes': a ``ReplicaDrain``, or a dict like ``export()``), and dropped from memory: a
        long-running server's rolling bundle. None: nothing recorded."""
        return None

    def shutdown(self) -> None:
        """Release what the recorder holds; call after the bundle is written."""


class Recorder(RunRecorder):
    """One engine replica's recorder (no-op base); probes override what they record."""

    # a step reads the step loop thread's CPU and wait (StepRecord.cpu_ns ..) when it starts this long
    # after the last step that read them ended (0: every step)
    work_gap_ns: int = 0

    # ---- engine steps (hot path) ----
    def should_time_layers(self, step_id: int) -> bool:
        return False

    def on_request_events(self, request: "Request", events: "list[RequestEvent]") -> None:
        """The request's events since the last call, in order: when it is added (ARRIVAL, QUEUED),
        aborted, and released when finished (the rest of its log), never per step. ``events`` is a new list
        each call (``Request.take_events``), the recorder's to keep."""

    def on_request_finished(self, request: "Request") -> None:
        pass

    def on_step(self, step: StepRecord, layer_times: list[tuple[str, int]] | None) -> None:
        pass

    def on_collectives(self, records: list[CollectiveRecord]) -> None:
        pass

    def step_context(self, step_id: int, scheduled: list | None = None):
        """A context manager around one step's model execution (profiler windows); ``scheduled`` is
        the step's batch (a profiler window may wait for a step with prompt tokens)."""
        return NULL_CONTEXT

    # ---- requests that came through a gateway ----
    def set_traceparent(self, request_id: str, traceparent: str) -> None:
        """W3C traceparent of ``request_id``: its spans join that trace."""

    def set_request_timestamps(self, request_id: str, **fields: Any) -> None:
        """Gateway columns of ``request_id`` (``gateway_arrival_ns=...``), as the gateway sent them."""

    # ---- metrics ----
    def metric_families(self, stats: Mapping[str, Any]) -> list:
        """This replica's Prometheus families, engine gauges set from ``stats`` (``LLMEngine.stats()``,
        the state now); pushed to the gateway, which exposes them. [] when there are none."""
        return []


@dataclass
class GatewayRequest:
    """One request the gateway is done with, as its recorder gets it."""

    request_id: str
    fields: dict[str, Any]  # requests-table columns the gateway owns: status, http_status, error, gateway_*_ns, replica
    ttft_s: float | None = None  # None: no token reached the client
    itl_s: list[float] = field(default_factory=list)
    tpot_s: float | None = None
    e2e_s: float | None = None  # None for aborted requests
    attributes: dict[str, Any] = field(default_factory=dict)  # its root span's (gen_ai.* semantic conventions)


class GatewayRecorder(RunRecorder):
    """The gateway's recorder (no-op base): its requests, admission queue and routing."""

    def request_arrived(self, request_id: str, arrival_ns: int, traceparent: str | None = None) -> str | None:
        """A request reached the gateway (``traceparent``: the W3C header it came with, which its spans
        join); returns the traceparent its replica's spans join (or None)."""
        return None

    def request_routed(self, replica: int) -> None:
        pass

    def request_refused(self, reason: str) -> None:
        """Counted by reason: rejected (queue full), invalid, timeout, error."""

    def queue_changed(self, num_waiting: int, num_active: int) -> None:
        """The admission queue changed (requests waiting, requests admitted)."""

    def request_done(self, request: GatewayRequest) -> None:
        """The gateway answered the request (finished, failed or refused)."""

    def replica_drained(self, replica: int, drain: Any, stats: Mapping[str, Any]) -> None:
        """A replica that ships its records (``RecorderFactory.engine(ship_records=True)``) sent ``drain``
        (its recorder's ``drain()``; None: nothing recorded) and its engine ``stats`` now: feed that
        replica's metrics here, off its step loop. Drains of one replica come in order."""

    def metric_families(self) -> list:
        """The gateway's own Prometheus families, and those it feeds for replicas that ship their records
        ([] when there are none)."""
        return []


class RecorderFactory(Protocol):
    """Makes a serving run's recorders; picklable (replica processes receive it)."""

    level: str  # off | default | full

    def engine(self, replica: int, model_name: str, ship_records: bool = False) -> Recorder:
        """``ship_records``: the recorder's records leave by ``drain()`` alone, pushed to the gateway, whose
        recorder feeds their metrics (``GatewayRecorder.replica_drained``): a server that keeps no
        whole-run record."""
        ...

    def gateway(self, model_name: str, keep_requests: bool) -> GatewayRecorder:
        """``keep_requests``: record every request for a bundle (a run; or a server's rolling bundle,
        which ``drain()`` empties as it goes)."""
        ...


@dataclass(frozen=True)
class NullRecorders:
    """Probes off: every recorder a no-op."""

    level: str = "off"

    def engine(self, replica: int, model_name: str, ship_records: bool = False) -> Recorder:
        return Recorder()

    def gateway(self, model_name: str, keep_requests: bool) -> GatewayRecorder:
        return GatewayRecorder()


NULL_CONTEXT = contextlib.nullcontext()
NullRecorder = Recorder


class ListRecorder(Recorder):
    """Keeps every step and collective record in lists (benchmarks and tests)."""

    enabled = True

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.layer_times: list[list[tuple[str, int]] | None] = []
        self.collectives: list[CollectiveRecord] = []

    def on_step(self, step: StepRecord, layer_times: list[tuple[str, int]] | None) -> None:
        self.steps.append(step)
        self.layer_times.append(layer_times)

    def on_collectives(self, records: list[CollectiveRecord]) -> None:
        self.collectives.extend(records)
