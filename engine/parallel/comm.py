"""The Communicator: every tensor-parallel collective goes through here, timed.

One Communicator per rank wraps a process group built directly on a store (gloo on
CPU, NCCL on CUDA) -- not torch.distributed's process-global default group, so two
engines in one process never share or collide on one.

Timing (perf_counter_ns, reported on the monotonic clock of the bundle):

* ``start_ns`` is this rank's *arrival*: the moment its own work before the collective
  is done (on CUDA after waiting for the stream to drain up to it);
* ``duration_ns`` runs from arrival to completion, so it includes the wait for the
  other ranks;
* ``wait_ns``, the wait for the slowest rank (skew), cannot be seen from one rank. It is
  computed after the step from every rank's arrivals (``collective_records``): the k-th
  collective of a step is the same on all ranks, and its wait on rank r is
  ``max over ranks of arrival_k - arrival_k on r``, at most its duration. The ranks run
  on one host, so their CLOCK_MONOTONIC readings are comparable. The arrivals travel to
  the driver with each worker's step reply, so measuring skew costs no extra collective.

The injected fault ``collective.delay_ms`` wraps rank 1's communicator so that it
arrives late (``faults.py``); the other ranks see it as wait.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from layerscope.engine.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from layerscope.engine.recorder import CollectiveRecord

# (op, name, num_bytes, start_ns, duration_ns): one collective as this rank saw it
Timing = tuple[str, str, int, int, int]


class CollectiveError(RuntimeError):
    """A collective did not complete (a peer died, or none answered within the timeout)."""


def new_process_group(store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float):
    """A process group of its own (not the global default one) over ``store``."""
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        # our own deadline (Communicator._drain_stream) must fire first: NCCL's watchdog
        # may take the whole process down when its timeout expires
        opts._timeout = timedelta(seconds=2 * timeout_s + 30)
        opts.is_high_priority_stream = False
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout_s)
        # all ranks are local processes: loopback, no hostname lookup
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
    pg._set_sequence_number_for_group()  # as torch.distributed does for the groups it makes
    return pg


class Communicator:
    """all_reduce / all_gather for one rank, each timed into this step's list of timings."""

    def __init__(
        self,
        pg,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        health_check: Callable[[], None] | None = None,
    ):
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.health_check = health_check  # raises when a peer is known dead (driver side)
        self.step_id = -1
        self._timings: list[Timing] = []
        self._is_cuda = device.type == "cuda"
        # perf_counter_ns -> monotonic_ns (the same clock on Linux; kept exact elsewhere)
        self._clock_offset_ns = time.monotonic_ns() - time.perf_counter_ns()

    def begin_step(self, step_id: int) -> None:
        self.step_id = step_id
        self._timings = []

    def take_timings(self) -> list[Timing]:
        out, self._timings = self._timings, []
        return out

    def all_reduce(self, x: torch.Tensor, name: str = "") -> torch.Tensor:
        """Sum ``x`` over ranks (in place when contiguous); returns the sum."""
        x = x.contiguous()
        t0 = self._arrive()
        self.pg.allreduce([x]).wait()
        t1 = self._complete()
        self._timings.append(("all_reduce", name, x.numel() * x.element_size(), t0 + self._clock_offset_ns, t1 - t0))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1, name: str = "") -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (rank order). num_bytes is the output's."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        t0 = self._arrive()
        self.pg.allgather([parts], [x]).wait()
        t1 = self._complete()
        nbytes = x.numel() * x.element_size() * self.world_size
        self._timings.append(("all_gather", name, nbytes, t0 + self._clock_offset_ns, t1 - t0))
        return torch.cat(parts, dim=dim)

    # ---- clocks ----
    def _arrive(self) -> int:
        if self._is_cuda:
            self._drain_stream()
        return time.perf_counter_ns()

    def _complete(self) -> int:
        if self._is_cuda:
            self._drain_stream()
        return time.perf_counter_ns()

    def _drain_stream(self) -> None:
        """Wait for the current CUDA stream, polling (not blocking) so that a dead peer or
        a hang becomes an error instead of a stuck synchronize."""
        event = torch.cuda.Event()
        event.record()
        deadline = time.monotonic() + self.timeout_s
        next_check = time.monotonic() + 0.01
        while not event.query():
            now = time.monotonic()
            if now > next_check:
                if self.health_check is not None:
                    self.health_check()
                if now > deadline:
                    raise CollectiveError(
                        f"rank {self.rank}: collective did not complete within {self.timeout_s:g} s"
                    )
                next_check = now + 0.01
            time.sleep(0)


def collective_records(step_id: int, timings_by_rank: list[list[Timing]]) -> list[CollectiveRecord]:
    """CollectiveRecords of one step for all ranks, with the wait for the slowest rank.

    ``timings_by_rank[r]`` are rank r's timings in issue order; every rank issues the
    same collectives in the same order, so the k-th entries describe one collective.
    """
    counts = {len(t) for t in timings_by_rank}
    if len(counts) > 1:
        raise CollectiveError(f"step {step_id}: ranks issued different numbers of collectives: "
                              f"{[len(t) for t in timings_by_rank]}")
    latest = [max(col) for col in zip(*([t[3] for t in timings] for timings in timings_by_rank))]
    return [
        CollectiveRecord(op, rank, step_id, nbytes, start, dur, min(dur, max(0, latest[k] - start)), name)
        for rank, timings in enumerate(timings_by_rank)
        for k, (op, name, nbytes, start, dur) in enumerate(timings)
    ]


_ROWS = [
    (re.compile(r"^model\.embed_tokens$"), "embed"),
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.o_proj$"), r"layers.\1.attn"),
    (re.compile(r"^model\.layers\.(\d+)\.mlp\.down_proj$"), r"layers.\1.mlp"),
    (re.compile(r"^lm_head$"), "lm_head"),
]


def name_collectives(model: nn.Module) -> None:
    """Tell each collective-issuing layer its row name (``embed``, ``layers.{i}.attn``,
    ``layers.{i}.mlp``, ``lm_head``), the names per-layer timings use."""
    for path, module in model.named_modules():
        if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
            name = path
            for pattern, row in _ROWS:
                if pattern.match(path):
                    name = pattern.sub(row, path)
                    break
            module.collective_name = name
