"""The messages between the gateway and its replica processes (over multiprocessing queues).

    gateway -> replica   AddRequest, AbortRequest, CollectRecords, DrainRecords, Shutdown
    replica -> gateway   Ready, Outputs, RequestError, MetricsSnapshot, Records, Drained, Fatal, Exited

Each is pickled onto the queue; ``Outputs`` carries one ``TokenDelta`` per request the
step advanced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from layerscope.engine.sampling_params import SamplingParams


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


# ---- gateway -> replica ----
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    traceparent: str | None  # the gateway's root span: the replica's spans join its trace
    gateway_fields: dict[str, int] = field(default_factory=dict)  # gateway_arrival_ns, _admitted_ns, _routed_ns


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class CollectRecords:
    """Stop recording and send back the recorder's export (the replica keeps serving)."""


@dataclass
class DrainRecords:
    """Send back what the recorder has done since the last drain (``Recorder.drain``) and drop it."""


@dataclass
class Shutdown:
    pass


# ---- replica -> gateway ----
@dataclass
class Ready:
    replica: int
    pid: int
    resolved: dict[str, Any]  # ResolvedConfig.to_dict()
    max_model_len: int
    warmup: dict[str, Any] | None = None  # engine/warmup.py's report (None: skipped)


@dataclass
class Outputs:
    deltas: list[TokenDelta]


@dataclass
class RequestError:
    """The engine refused the request (never added)."""

    request_id: str
    message: str


@dataclass
class MetricsSnapshot:
    families: list  # Prometheus metric families of the replica's recorder ([] with probes off, or shipping)
    stats: dict[str, Any]  # LLMEngine.stats()
    drain: Any = None  # a shipping replica's recorder drain() (the gateway feeds its metrics); None: none


@dataclass
class Records:
    export: dict[str, Any] | None  # the recorder's export(); None without probes


@dataclass
class Drained:
    export: Any  # the recorder's drain(); None without probes


@dataclass
class Fatal:
    """The replica failed to start or crashed; it exits."""

    message: str


@dataclass
class Exited:
    pass
