"""A request's state and lifecycle: status enum plus a timestamped event log.

Timestamps are ``time.monotonic_ns()`` (one clock per host). Probes drain the event
log through ``take_events``.
"""

from __future__ import annotations

import enum
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from layerscope.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self._value_.startswith("finished")  # not .value: enum's property descriptor costs ~4x


class RequestEventType(enum.Enum):
    ARRIVAL = "arrival"
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    FIRST_TOKEN = "first_token"
    PREEMPTED = "preempted"
    RESUMED = "resumed"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True)  # no __dict__: ~7 events per request
class RequestEvent:
    type: RequestEventType
    ts_ns: int
    attrs: dict[str, Any] = field(default_factory=dict)

    def __reduce__(self):
        # pickled as (type's value, ts, attrs or None): a rolling bundle's drain ships every finished
        # request's events to the writer process, and a dataclass's __dict__ per event cost twice this
        return event_from_fields, event_fields(self)


# a request event as plain data: (type's value, ts_ns, attrs) (pickling, a rolling drain); attribute
# reads in C (a Python function per event cost the drain ~1 us a step); ``.value`` is a slow descriptor
event_fields: "Callable[[RequestEvent], tuple[str, int, dict[str, Any]]]" = operator.attrgetter(
    "type._value_", "ts_ns", "attrs")


def event_from_fields(value: str, ts_ns: int, attrs: dict[str, Any] | None) -> RequestEvent:
    """The event ``event_fields`` gave."""
    return RequestEvent(RequestEventType(value), ts_ns, attrs if attrs is not None else {})


class Request:
    """One generation request inside the engine (scheduler and block manager view)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_ns: int | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 until then
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # tokens computed again after preemptions
        self.block_ids: list[int] = []  # the block table
        self.block_hashes: list[int] = []  # chained hashes of full blocks, by position
        self.stop_reason: int | str | None = None
        self.arrival_ns = arrival_ns if arrival_ns is not None else time.monotonic_ns()
        self.first_token_ns: int | None = None
        self.first_scheduled_ns: int | None = None  # its SCHEDULED event's time (probes find its first step by it)
        # filled by the engine only when the sampling params ask for them (outputs.py's shapes)
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None else None
        self._events: list[RequestEvent] = []
        self.record_event(RequestEventType.ARRIVAL, self.arrival_ns)

    # ---- sizes ----
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    # ---- event log ----
    def record_event(self, type: RequestEventType, ts_ns: int | None = None, **attrs: Any) -> None:
        self._events.append(RequestEvent(type, ts_ns if ts_ns is not None else time.monotonic_ns(), attrs))

    def take_events(self) -> list[RequestEvent]:
        events, self._events = self._events, []
        return events

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
