"""Admission control at the gateway (layer ``gateway.queue``).

At most ``max_concurrency`` requests are admitted to the engines at once; up to
``max_queue`` more wait, first come first served; beyond that the gateway refuses
at once (HTTP 429 with Retry-After) rather than letting a client hang. The
``gateway.delay_ms`` fault (``faults.py`` sets ``delay_s``) is spent inside the wait,
so it shows up where a slow admission path would: between gateway arrival and admission.

Runs on the gateway's event loop only (not thread-safe).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Callable


class QueueFullError(Exception):
    """The admission queue is full; the request must be refused (429)."""


class AdmissionController:
    def __init__(self, max_concurrency: int, max_queue: int, on_change: Callable[[], None] | None = None):
        """``on_change()`` is called whenever ``num_active`` or ``num_waiting`` changed (gauges)."""
        self.max_concurrency = max_concurrency
        self.on_change = on_change or (lambda: None)
        self.max_queue = max_queue
        self.delay_s = 0.0  # time on the admission path before a slot, counted as queued (a fault)
        self.num_active = 0  # admitted and not released
        self.num_delayed = 0  # inside the injected delay; they count as queued
        self.num_rejected = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (the injected delay included)."""
        return len(self._waiters) + self.num_delayed

    def _can_admit_now(self) -> bool:
        return self.num_active < self.max_concurrency and not self._waiters

    async def acquire(self) -> None:
        """Wait for a slot. Raises QueueFullError at once when the queue is full.

        Cancelling the caller (client gone) leaves the queue clean: a slot granted
        in the same instant is handed on.
        """
        if not self._can_admit_now() and self.num_waiting >= self.max_queue:
            self.num_rejected += 1
            raise QueueFullError(
                f"the gateway is at capacity: {self.num_active} requests running (max_concurrency="
                f"{self.max_concurrency}) and {self.num_waiting} waiting (max_queue={self.max_queue})"
            )
        if self.delay_s:
            self.num_delayed += 1
            self.on_change()
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.num_delayed -= 1
        if self._can_admit_now():
            self.num_active += 1
            self.on_change()
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.on_change()
        try:
            await fut  # release() counted us active before resolving
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # admitted in the same instant we were cancelled: hand the slot on
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
                self.on_change()
            raise

    def release(self) -> None:
        """Give a slot back; the oldest live waiter gets it."""
        self.num_active -= 1
        while self._waiters and self.num_active < self.max_concurrency:
            fut = self._waiters.popleft()
            if not fut.done():
                self.num_active += 1
                fut.set_result(None)
        self.on_change()
