"""The engine's seam to probes: a small recorder interface, a no-op by default.

The engine calls these at fixed points; ``layerscope.probes`` implements them. Nothing
here allocates or formats when probes are off (``NullRecorder``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layerscope.engine.request import Request, RequestEvent


@dataclass
class StepRecord:
    """One engine step. Durations in ns, timestamps on the monotonic clock (ns)."""

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
    request_ids: list[str] = field(default_factory=list)  # requests computed in this step
    request_num_tokens: list[int] = field(default_factory=list)  # their tokens this step
    replica: int = 0


@dataclass
class CollectiveRecord:
    op: str  # all_reduce, all_gather, broadcast
    rank: int
    step_id: int
    num_bytes: int
    start_ns: int
    duration_ns: int
    wait_ns: int  # time waiting for the slowest rank (skew)
    name: str = ""  # layer row that issued it


class Recorder:
    """No-op base; probes override what they record."""

    enabled: bool = False

    def should_time_layers(self, step_id: int) -> bool:
        return False

    def on_request_events(self, request: "Request", events: "list[RequestEvent]") -> None:
        pass

    def on_request_finished(self, request: "Request") -> None:
        pass

    def on_step(self, step: StepRecord, layer_times: list[tuple[str, int]] | None) -> None:
        pass

    def on_collectives(self, records: list[CollectiveRecord]) -> None:
        pass

    def step_context(self, step_id: int):
        """A context manager around one step's model execution (profiler windows)."""
        return _NULL_CONTEXT


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL_CONTEXT = _NullContext()
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
