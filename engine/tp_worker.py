"""A tensor-parallel worker process (ranks 1..N-1) and the messages it exchanges with the driver.

The driver (rank 0, inside the engine process) starts one worker per rank with the
multiprocessing spawn context and talks to it over one Pipe:

    worker -> driver   WorkerHello        started; about to join the process group
    worker -> driver   WorkerReady        shard loaded, KV cache allocated
    driver -> worker   StepInputs         one step's scheduled requests (what prepare_inputs needs)
    worker -> driver   StepReply          the step's collective timings (arrivals for the skew)
    driver -> worker   Stop               leave the loop, tear the process group down
    worker -> driver   WorkerFailed       an exception, with its traceback, before exiting

Every rank builds the same ModelInputs from the same StepInputs, runs its shard's
forward (collectives included) and discards the logits; only rank 0 samples.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from layerscope.engine.config import EngineConfig
from layerscope.engine.faults import Faults
from layerscope.engine.model_runner import build_model_runner
from layerscope.engine.models.llama import ModelSpec
from layerscope.engine.parallel.comm import Communicator, Timing, new_process_group
from layerscope.engine.parallel.context import ParallelContext
from layerscope.engine.scheduler import ScheduledRequest, SchedulerOutput
from layerscope.engine.warmup import freeze_startup_heap


# ---- messages -------------------------------------------------------------------------
@dataclass
class WorkerHello:
    rank: int
    pid: int


@dataclass
class WorkerReady:
    rank: int


@dataclass
class StepInputs:
    step_id: int
    # per scheduled request, in scheduler order: (token_ids, start_pos, block_ids, do_sample)
    scheduled: list[tuple[list[int], int, list[int], bool]]

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput) -> "StepInputs":
        return cls(out.step_id, [(s.token_ids, s.start_pos, s.block_ids, s.do_sample) for s in out.scheduled])

    def to_scheduler_output(self) -> SchedulerOutput:
        scheduled = [
            ScheduledRequest("", token_ids, start_pos, block_ids, None, do_sample, False, 0)  # type: ignore[arg-type]
            for token_ids, start_pos, block_ids, do_sample in self.scheduled
        ]
        return SchedulerOutput(self.step_id, scheduled, {})


@dataclass
class StepReply:
    rank: int
    step_id: int
    timings: list[Timing]


@dataclass
class Stop:
    pass


@dataclass
class WorkerFailed:
    rank: int
    error: str  # formatted traceback


@dataclass
class WorkerArgs:
    rank: int
    world_size: int
    store_port: int
    config: EngineConfig
    spec: ModelSpec
    dtype: torch.dtype
    device: str  # "cpu" or "cuda:<rank>"
    backend: str  # kernel backend
    num_blocks: int
    max_model_len: int
    faults: Faults  # applied where the rank's runner is assembled (build_model_runner)
    num_threads: int  # CPU intra-op threads for this rank


# ---- the process ------------------------------------------------------------------------------
def worker_main(args: WorkerArgs, conn) -> None:
    """Entry point of a worker process (multiprocessing spawn target)."""
    # Ctrl-C reaches the whole process group; the driver decides when workers stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = args.rank
    pg = None
    try:
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(args.num_threads)
        conn.send(WorkerHello(rank, os.getpid()))
        timeout_s = args.config.tp_timeout_s
        store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size, False,
                              timeout=timedelta(seconds=max(timeout_s, 60.0)))
        pg = new_process_group(store, rank, args.world_size, device, timeout_s)
        comm = Communicator(pg, rank, args.world_size, device, timeout_s)
        pctx = ParallelContext(rank, args.world_size, comm)
        runner = build_model_runner(args.config, args.spec, args.dtype, device, args.backend, args.num_blocks,
                                    args.max_model_len, args.faults, pctx)
        freeze_startup_heap()
        conn.send(WorkerReady(rank))
        while True:
            msg = conn.recv()
            if isinstance(msg, Stop):
                break
            comm.begin_step(msg.step_id)
            runner.forward(runner.prepare_inputs(msg.to_scheduler_output()), None)
            conn.send(StepReply(rank, msg.step_id, comm.take_timings()))
    except (EOFError, BrokenPipeError):
        pass  # the driver is gone; nothing to report to
    except BaseException:
        try:
            conn.send(WorkerFailed(rank, traceback.format_exc()))
        except OSError:
            pass
        sys.exit(1)
    finally:
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass
        conn.close()
