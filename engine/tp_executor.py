"""TPExecutor: the driver (rank 0) of a tensor-parallel engine, and its worker processes.

Rank 0 runs inside the engine process: it prepares the step's inputs, runs its own
shard's forward and samples. Ranks 1..N-1 are worker processes (``tp_worker.py``), started
with the multiprocessing spawn context, one Pipe each.

* Rendezvous: a TCPStore served by the driver on 127.0.0.1, port 0 (the OS picks a
  free port and the store keeps it bound, so two engines on one machine never
  collide); the workers get its port as an argument. Each rank then builds its own
  process group on that store (gloo on CPU, NCCL on CUDA; see ``comm.py``).
* Control channel: per step the driver sends each worker the scheduled requests
  (token ids, start position, block table, do_sample) before its own forward; every
  rank builds identical ModelInputs from them. Each worker answers with its collective
  timings, from which the driver computes the wait for the slowest rank.
* Failure: a dead worker breaks the gloo connection at once; a hung one makes a
  collective or the reply wait time out after ``tp_timeout_s``. Either way the executor
  tears everything down and raises TPWorkerError (a RuntimeError) naming the rank.
  Start-up (spawn, import torch, load the shard) may take max(tp_timeout_s, 60 s).
* Shutdown: Stop message, join, then terminate and kill; also run by a weakref
  finalizer at garbage collection or interpreter exit, so no process outlives the engine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
from torch import nn

from layerscope.engine.config import ConfigError, EngineConfig
from layerscope.engine.faults import Faults
from layerscope.engine.model_runner import build_model_runner
from layerscope.engine.models.llama import ModelSpec
from layerscope.engine.parallel.comm import CollectiveError, Communicator, collective_records, new_process_group
from layerscope.engine.parallel.context import ParallelContext
from layerscope.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from layerscope.engine.recorder import Recorder
from layerscope.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from layerscope.engine.tp_worker import (
    StepInputs,
    StepReply,
    Stop,
    WorkerArgs,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
    worker_main,
)

_START_TIMEOUT_FLOOR_S = 60.0  # spawn + import torch + load a shard
_STOP_JOIN_S = 5.0  # graceful stop before terminate
_POLL_S = 0.01  # liveness check interval while waiting on a pipe


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, failed or did not answer in time; the executor is shut down."""


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection


class _WorkerGroup:
    """What must be released: worker processes, pipes, the driver's process group and store.

    ``close`` is idempotent; it is also the executor's finalizer, so it must not refer
    to the executor."""

    def __init__(self) -> None:
        self.workers: list[_Worker] = []
        self.pg = None
        self.store = None
        self.failed = False
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.failed:
            for w in self.workers:
                try:
                    w.conn.send(Stop())
                except OSError:
                    pass
            deadline = time.monotonic() + _STOP_JOIN_S
            for w in self.workers:
                w.process.join(max(0.0, deadline - time.monotonic()))
        # after a failure a worker may be stopped or stuck in a collective: no time for SIGTERM
        for stop in (BaseProcess.kill,) if self.failed else (BaseProcess.terminate, BaseProcess.kill):
            alive = [w for w in self.workers if w.process.is_alive()]
            for w in alive:
                stop(w.process)
            for w in alive:
                w.process.join(2.0)
        for w in self.workers:
            w.conn.close()
        if self.pg is not None:
            try:
                self.pg.abort() if self.failed else self.pg.shutdown()
            except RuntimeError:
                pass
        self.pg = self.store = None


class TPExecutor:
    """Runs each engine step on all ranks; implements ``executor.Executor``."""

    def __init__(
        self,
        config: EngineConfig,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        backend: str,
        num_blocks: int,
        max_model_len: int,
        faults: Faults,
        recorder: Recorder,
    ):
        world = config.tp_size
        self.world_size = world
        self.timeout_s = config.tp_timeout_s
        self.recorder = recorder
        worker_devices = ["cpu"] * world
        if device.type == "cuda":
            num_gpus = torch.cuda.device_count()
            if num_gpus < world:
                raise ConfigError(f"tp_size={world} needs {world} GPUs, found {num_gpus}")
            first = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", first)
            worker_devices = [f"cuda:{(first + r) % num_gpus}" for r in range(world)]
        self._group = _WorkerGroup()
        self._finalizer = weakref.finalize(self, self._group.close)
        start_timeout_s = max(self.timeout_s, _START_TIMEOUT_FLOOR_S)
        try:
            store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=start_timeout_s),
                                  wait_for_workers=False)
            self._group.store = store
            ctx = mp.get_context("spawn")
            num_threads = config.num_threads or max(1, (os.cpu_count() or 1) // world)
            for rank in range(1, world):
                args = WorkerArgs(rank, world, store.port, config, spec, dtype, worker_devices[rank], backend,
                                  num_blocks, max_model_len, faults, num_threads)
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(args, child), name=f"layerscope-tp-rank{rank}",
                                   daemon=True)
                proc.start()
                child.close()
                self._group.workers.append(_Worker(rank, proc, parent))
            self._expect_all(WorkerHello, "start-up", start_timeout_s)
            pg = new_process_group(store, 0, world, device, self.timeout_s)
            self._group.pg = pg
            self.comm = Communicator(pg, 0, world, device, self.timeout_s, health_check=self._check_workers)
            pctx = ParallelContext(0, world, self.comm)
            self.runner = build_model_runner(config, spec, dtype, device, backend, num_blocks, max_model_len,
                                             faults, pctx)
            self._expect_all(WorkerReady, "start-up", start_timeout_s)
        except BaseException as e:
            err = self._fail(e, "start-up")
            if err is e:
                raise
            raise err from e
        self.num_parameters = full_num_parameters(self.runner.model, world)

    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of each worker process (ranks 1..N-1)."""
        return {w.rank: w.process.pid for w in self._group.workers}

    # ---- one step ----
    def execute_model(self, out: SchedulerOutput, time_layers: bool = False) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0 samples. Collective records only when recording."""
        if self._group.closed:
            raise TPWorkerError("the tensor-parallel executor is shut down")
        where = f"step {out.step_id}"
        try:
            msg = StepInputs.from_scheduler_output(out)
            for w in self._group.workers:
                w.conn.send(msg)  # first, so the workers prepare while the driver does
            self.comm.begin_step(out.step_id)
            result = self.runner.execute_model(out, time_layers)
            deadline = time.monotonic() + self.timeout_s
            timings = [self.comm.take_timings()]
            timings += [self._recv(w, StepReply, where, deadline).timings for w in self._group.workers]
        except BaseException as e:
            err = self._fail(e, where)
            if err is e:
                raise
            raise err from e
        if self.recorder.enabled:
            result.collectives = collective_records(out.step_id, timings)
        return result

    def forget(self, request_id: str) -> None:
        """Drop a finished request's per-request state (rank 0 samples)."""
        self.runner.forget(request_id)

    def shutdown(self) -> None:
        """Stop the workers and release the process group; safe to call more than once."""
        self._finalizer()

    # ---- the control channel ----
    def _expect_all(self, kind: type, where: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for w in self._group.workers:
            self._recv(w, kind, where, deadline)

    def _recv(self, w: _Worker, kind: type, where: str, deadline: float):
        while not w.conn.poll(_POLL_S):
            if not w.process.is_alive():
                raise TPWorkerError(self._death(w, where))
            if time.monotonic() > deadline:
                raise TPWorkerError(
                    f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) did not answer within "
                    f"tp_timeout_s={self.timeout_s:g} s during {where} (hung?)"
                )
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(1.0)
            raise TPWorkerError(self._death(w, where)) from None
        if isinstance(msg, WorkerFailed):
            raise TPWorkerError(f"tensor-parallel worker rank {msg.rank} failed during {where}:\n{msg.error}")
        if not isinstance(msg, kind):
            raise TPWorkerError(f"tensor-parallel worker rank {w.rank}: expected {kind.__name__} during {where}, "
                                f"got {type(msg).__name__}")
        return msg

    def _check_workers(self) -> None:
        for w in self._group.workers:
            if not w.process.is_alive():
                raise TPWorkerError(self._death(w, "a collective"))

    # ---- failures ----
    def _death(self, w: _Worker, where: str) -> str:
        code = w.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        text = f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) died during {where} ({how})"
        try:
            if w.conn.poll(0):
                msg = w.conn.recv()
                if isinstance(msg, WorkerFailed):
                    text += f":\n{msg.error}"
        except (EOFError, OSError):
            pass
        return text

    def _fail(self, e: BaseException, where: str) -> BaseException:
        """Shut everything down after ``e``; return the error to raise (``e`` itself when it is
        already clear or not an Exception)."""
        self._group.failed = True
        err: BaseException = e
        if isinstance(e, Exception) and not isinstance(e, TPWorkerError):
            err = self._diagnose(e, where)
        self.shutdown()
        return err

    def _diagnose(self, e: Exception, where: str) -> TPWorkerError:
        # a worker that died breaks the collective at once; give the OS a moment to reap it
        deadline = time.monotonic() + 1.0
        while True:
            dead = [w for w in self._group.workers if not w.process.is_alive()]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        if dead:
            return TPWorkerError("; ".join(self._death(w, where) for w in dead))
        text = str(e)
        if isinstance(e, CollectiveError) or "timed out" in text.lower() or "timeout" in text.lower():
            # with more than two ranks the one that hangs cannot be told apart from here
            ranks = ", ".join(f"rank {w.rank} (pid {w.process.pid})" for w in self._group.workers)
            return TPWorkerError(
                f"tensor-parallel worker {ranks} did not answer within tp_timeout_s={self.timeout_s:g} s "
                f"during {where}: alive but hung? ({text})"
            )
        return TPWorkerError(f"tensor-parallel {where} failed on rank 0: {type(e).__name__}: {text}")


def full_num_parameters(model: nn.Module, world_size: int) -> int:
    """Parameters of the whole model, counted from rank 0's shard (replicated ones once)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, VocabParallelEmbedding):
                total += module.num_embeddings * p.shape[1]  # without the padding rows
            elif isinstance(module, ColumnParallelLinear) or (isinstance(module, RowParallelLinear)
                                                              and name == "weight"):
                total += p.numel() * world_size
            else:
                total += p.numel()
    return total
