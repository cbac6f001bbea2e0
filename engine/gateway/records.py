"""What the gateway keeps per request: its record (timestamps, counts) and its token stream."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from layerscope.contract import RequestTimes, interval_s
from layerscope.engine.gateway.protocol import APIError
from layerscope.engine.gateway.messages import TokenDelta


@dataclass
class GatewayRecord(RequestTimes):
    """One request as the gateway saw it. Timestamps: ns, host monotonic clock. ``tpot_s``/``itl_s``:
    ``RequestTimes``."""

    request_id: str
    api: str  # completions | chat
    stream: bool
    gateway_arrival_ns: int
    session_id: str | None = None
    gateway_admitted_ns: int | None = None
    gateway_routed_ns: int | None = None
    engine_arrival_ns: int | None = None
    engine_first_token_ns: int | None = None
    engine_finished_ns: int | None = None
    gateway_first_token_ns: int | None = None
    gateway_finished_ns: int | None = None
    replica: int | None = None
    status: str = "pending"  # finished_stopped | finished_length | finished_aborted | rejected | error
    finish_reason: str | None = None
    error: str | None = None
    http_status: int | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    num_output_tokens: int = 0
    num_preemptions: int | None = None
    token_ns: list[int] = field(default_factory=list)  # each token handed to the HTTP stream
    traceparent: str | None = None  # of the gateway's root span; the replica's spans join its trace

    @property
    def ttft_s(self) -> float | None:
        return interval_s(self.gateway_arrival_ns, self.gateway_first_token_ns)

    @property
    def e2e_s(self) -> float | None:
        if self.gateway_first_token_ns is None:
            return None
        return interval_s(self.gateway_arrival_ns, self.gateway_finished_ns)

    def to_row(self) -> dict[str, Any]:
        """The requests.parquet columns the gateway owns (schema names)."""
        row = {k: getattr(self, k) for k in (
            "request_id", "replica", "status", "finish_reason", "error", "http_status", "num_prompt_tokens",
            "num_cached_tokens", "num_output_tokens", "num_preemptions", "gateway_arrival_ns",
            "gateway_admitted_ns", "gateway_routed_ns", "engine_arrival_ns", "engine_first_token_ns",
            "engine_finished_ns", "gateway_first_token_ns", "gateway_finished_ns")}
        itl = self.itl_s
        row.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s,
                   itl_mean_s=sum(itl) / len(itl) if itl else None, itl_max_s=max(itl) if itl else None)
        return row


class RequestStream:
    """A request in flight: its token deltas, in order, as they reach the gateway."""

    def __init__(self, record: GatewayRecord):
        self.record = record
        self.queue: asyncio.Queue[TokenDelta | APIError] = asyncio.Queue()
        self.engine_done = False  # the engine finished it (no abort needed)
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None

    async def deltas(self) -> AsyncIterator[TokenDelta]:
        """Yield deltas until the finished one; raises APIError if the request fails."""
        rec = self.record
        while True:
            item = await self.queue.get()
            if isinstance(item, APIError):
                raise item
            now = time.monotonic_ns()
            if rec.gateway_first_token_ns is None:
                rec.gateway_first_token_ns = now
                rec.engine_arrival_ns = item.engine_arrival_ns
                rec.engine_first_token_ns = item.engine_first_token_ns
                rec.num_prompt_tokens = item.num_prompt_tokens
                rec.num_cached_tokens = item.num_cached_tokens
            rec.token_ns.extend([now] * len(item.new_token_ids))
            rec.num_output_tokens = item.num_output_tokens
            if item.finished:
                self.engine_done = True
                rec.engine_finished_ns = item.engine_finished_ns
                rec.finish_reason = item.finish_reason
                rec.num_preemptions = item.num_preemptions
            yield item
            if item.finished:
                return
