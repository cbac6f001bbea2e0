"""LLMEngine: requests in, one step at a time, RequestOutputs back.

The step: schedule (host) -> execute (prepare inputs, forward, sample) -> update
(advance computed counts, append tokens, finish) -> output (detokenize, stop strings).
Each phase is timed for the recorder; request lifecycle events are drained from the
requests the step touched.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from operator import attrgetter
from typing import Any, Sequence

import torch

from layerscope.contract import FINISH_REASON
from layerscope.engine.block_manager import BlockManager
from layerscope.engine.config import ConfigError, EngineConfig, ResolvedConfig
from layerscope.engine.executor import Executor, create_executor
from layerscope.engine.faults import Faults
from layerscope.engine.host import keep_freed_memory
from layerscope.engine.model_runner import kv_cache_bytes_per_block
from layerscope.engine.models.loader import DTYPES, load_spec
from layerscope.engine.outputs import Logprob, RequestOutput
from layerscope.engine.recorder import Recorder, StepRecord
from layerscope.engine.request import Request, RequestStatus
from layerscope.engine.sampling_params import InvalidRequestError, SamplingParams
from layerscope.engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from layerscope.engine.tokenizer import Detokenizer, load_tokenizer
from layerscope.kernels import resolve_backend

logger = logging.getLogger(__name__)

_REQUEST_ID, _IS_PREFILL = attrgetter("request_id"), attrgetter("is_prefill")
_new_step = tuple.__new__  # StepRecord from the tuple of its fields, in C
_thread_ns, _pread, _ident = time.thread_time_ns, os.pread, threading.get_ident


_NOT_READ = (None, None, None, None)


def work(start, end, fwd_start, fwd_end) -> tuple:
    """(cpu_ns, wait_ns, forward_cpu_ns, forward_wait_ns) from four ``ThreadClock.read()``s."""
    waits = start[1] is not None
    return (end[0] - start[0], end[1] - start[1] if waits else None,
            fwd_end[0] - fwd_start[0], fwd_end[1] - fwd_start[1] if waits else None)


class ThreadClock:
    """The calling thread's CPU time and run-queue wait (2nd field of its /proc schedstat), in ns.

    The step loop reads both at its step's edges and around the model's execution: wall = CPU + wait +
    off-CPU-not-runnable (sleeps, barriers), so the wait is time lost to a busy machine. The schedstat
    fd stays open (one pread a read); it names one thread, so a step on another thread reopens it."""

    __slots__ = ("fd", "ident")

    def __init__(self):
        self.fd, self.ident = -1, None

    def read(self) -> tuple[int, int | None]:
        """This thread's CPU time and run-queue wait so far (the wait None where schedstat is unreadable).
        A wait is counted when the thread is back on a CPU, so the engine reads these inside its wall
        clock's reads: one read between would count a wait whole that does not lie in the wall."""
        if self.ident != _ident():
            self._open()
        return _thread_ns(), (int(_pread(self.fd, 64, 0).split()[1]) if self.fd >= 0 else None)

    def _open(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.ident = _ident()
        try:
            self.fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:  # no schedstat (not Linux, or schedstats disabled)
            self.fd = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _max_model_len(config: EngineConfig, spec, num_blocks: int, block_size: int) -> int:
    max_model_len = config.max_model_len or spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{spec.max_position_embeddings}"
        )
    # one request must always fit the pool on its own, or preemption could livelock
    max_model_len = min(max_model_len, num_blocks * block_size)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be "
            f">= max_model_len ({max_model_len}) so every prefill fits one step"
        )
    return max_model_len


class LLMEngine:
    def __init__(self, config: EngineConfig, recorder: Recorder | None = None, faults: Faults | None = None):
        if not config.model:
            raise ConfigError("model is required (a Hugging Face-format checkpoint directory)")
        self.config = config
        self.recorder = recorder or Recorder()
        self.faults = faults or Faults()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        keep_freed_memory()
        device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if config.device == "auto" else config.device))
        spec = load_spec(config.model)
        self.faults.check(tp_size=config.tp_size, num_layers=spec.num_layers)
        dtype_name = spec.torch_dtype if config.dtype == "auto" else config.dtype
        if dtype_name not in DTYPES:
            dtype_name = "float32"
        dtype = DTYPES[dtype_name]
        backend = resolve_backend(config.kernel_backend, device)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_id = self.tokenizer.eos_token_id

        block_size = config.block_size
        kv_heads_per_rank = spec.num_kv_heads // config.tp_size if spec.num_kv_heads % config.tp_size == 0 else 0
        if not kv_heads_per_rank:
            raise ConfigError(f"tp_size={config.tp_size} does not divide num_key_value_heads={spec.num_kv_heads}")
        per_block = kv_cache_bytes_per_block(spec, block_size, kv_heads_per_rank, dtype)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // per_block)
        max_model_len = _max_model_len(config, spec, num_blocks, block_size)
        self.max_model_len = max_model_len

        self.executor: Executor = create_executor(config, spec, dtype, device, backend, num_blocks, max_model_len,
                                                  self.faults, self.recorder)
        num_params = self.executor.num_parameters

        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            config.enable_chunked_prefill,
        )
        # the step's phases that engine-level faults wrap (faults.py)
        self._schedule = self.faults.wrap_scheduler(self.scheduler.schedule)
        self._process_outputs = self.faults.wrap_output(self._update_and_make_outputs)
        self.resolved = ResolvedConfig(
            architecture=spec.architecture,
            dtype=dtype_name,
            device=str(device),
            kernel_backend=backend,
            max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            block_size=block_size,
            num_layers=spec.num_layers,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            hidden_size=spec.hidden_size,
            vocab_size=spec.vocab_size,
            kv_cache_bytes=per_block * num_blocks * config.tp_size,
            num_parameters=num_params,
        )
        self.spec = spec
        self._detok: dict[str, Detokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self._emitted: dict[str, int] = {}
        self._ids = itertools.count()
        self._clock = ThreadClock()  # the step loop's CPU and run-queue wait (read only when probes record)
        self._work_due = 0  # monotonic ns from which a step reads them

    # ---- requests ----
    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_ns: int | None = None,
    ) -> str:
        """Validate and queue one request; returns its id. Raises InvalidRequestError."""
        params = sampling_params or SamplingParams()
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} outside the vocabulary [0, {self.spec.vocab_size})")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but the maximum context length is {self.max_model_len} "
                f"tokens (prompt plus at least one output token)"
            )
        if params.prompt_logprobs is not None and self.config.tp_size > 1:
            raise InvalidRequestError("prompt_logprobs is not supported with tp_size > 1 (logprobs is)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        req = Request(rid, ids, params, self.eos_token_id, arrival_ns)
        self.scheduler.add_request(req)
        self._detok[rid] = Detokenizer(self.tokenizer, params.stop)
        self._prompts[rid] = text
        self._emitted[rid] = 0
        self.recorder.on_request_events(req, req.take_events())
        return rid

    def abort_request(self, request_id: str) -> bool:
        """Abort wherever the request is; its KV blocks are freed at once."""
        req = self.scheduler.abort_request(request_id)
        if req is None:
            return False
        self.recorder.on_request_events(req, req.take_events())
        self._release(req)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        bm, sched, rec = self.block_manager, self.scheduler, self.recorder
        t0 = time.monotonic_ns()
        # the thread's CPU and wait: read only when probes record, on a step starting work_gap_ns or more
        # after the last read one ended (4 reads, ~40 us in place: every step where steps take longer)
        timed, clock = rec.enabled and t0 >= self._work_due, self._clock
        r0 = clock.read() if timed else None
        q0, h0, p0 = bm.num_prefix_queries, bm.num_prefix_hits, sched.num_preemptions
        out = self._schedule()
        t1 = time.monotonic_ns()
        if out.is_empty:
            return []
        step_id = out.step_id
        time_layers = rec.should_time_layers(step_id)
        r1 = clock.read() if timed else None
        with rec.step_context(step_id, out.scheduled):
            runner_out = self.executor.execute_model(out, time_layers)
        # inside the wall clock's reads: a wait counts once the thread is back on a CPU (ThreadClock)
        r2 = clock.read() if timed else None
        t2 = time.monotonic_ns()
        outputs = self._process_outputs(out, runner_out)
        r3 = clock.read() if timed else None
        t3 = time.monotonic_ns()
        if rec.enabled:  # nothing below runs with probes off
            # per-request columns by C-level calls, the record one tuple (``tuple.__new__``: no Python
            # __init__): this runs every step, and in place (caches cold after the forward) at ~4x its
            # price in a warm loop. The scheduler's {request_id: tokens} is in the order it scheduled.
            nst = out.num_scheduled_tokens
            num_tokens = list(nst.values())
            num_batched = sum(num_tokens)
            request_ids = list(nst)
            if len(outputs) == len(request_ids):
                # every scheduled request sampled (outputs come only from scheduled requests, so equal
                # counts mean equal sets): one list for both (the recorder inverts it once); and a
                # request that sampled computed up to its last token, so it is a decode (is_prefill
                # false) exactly when it computed one token: counted on the list, not by reading every
                # ScheduledRequest again right after the forward (~1.8 us a step there on tiny)
                sampled = request_ids
                num_decode = num_tokens.count(1)
            else:
                sampled = list(map(_REQUEST_ID, outputs))
                num_decode = list(map(_IS_PREFILL, out.scheduled)).count(False)  # a decode computes one token
            # every field by its name, in StepRecord's order (a test reads this tuple against _fields)
            start_ns, end_ns, schedule_ns, output_ns = t0, t3, t1 - t0, t3 - t2
            prepare_ns, forward_ns, sample_ns = runner_out.prepare_ns, runner_out.forward_ns, runner_out.sample_ns
            num_prefill_seqs, num_prefill_tokens = len(num_tokens) - num_decode, num_batched - num_decode
            num_decode_seqs = num_decode_tokens = num_decode
            # the properties' lens, without their calls
            num_running, num_waiting = len(sched.running), len(sched.waiting)
            num_kv_blocks_free = len(bm.free_block_queue)
            num_kv_blocks_total, num_preemptions = bm.num_blocks, sched.num_preemptions - p0
            num_prefix_queries, num_prefix_hits = bm.num_prefix_queries - q0, bm.num_prefix_hits - h0
            request_num_tokens, replica, sampled_ids = num_tokens, 0, sampled
            cpu_ns, wait_ns, forward_cpu_ns, forward_wait_ns = work(r0, r3, r1, r2) if timed else _NOT_READ
            if timed:
                self._work_due = t3 + rec.work_gap_ns
            rec.on_step(
                _new_step(StepRecord, (
                    step_id, start_ns, end_ns, schedule_ns, prepare_ns, forward_ns, sample_ns, output_ns,
                    num_prefill_seqs, num_prefill_tokens, num_decode_seqs, num_decode_tokens,
                    num_running, num_waiting, num_kv_blocks_free, num_kv_blocks_total,
                    num_preemptions, num_prefix_queries, num_prefix_hits,
                    request_ids, request_num_tokens, replica, sampled_ids,
                    cpu_ns, wait_ns, forward_cpu_ns, forward_wait_ns,
                )),
                runner_out.layer_times,
            )
            if runner_out.collectives:
                rec.on_collectives(runner_out.collectives)
            # a request's events stay on it until it is added, aborted or released (the recorder
            # reads them only then): no per-request call on the step
        for o in outputs:
            if o.finished:
                self._release(sched.requests[o.request_id])
        return outputs

    def _update_and_make_outputs(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        """The step's output phase: sampled tokens into the requests (and the logprobs asked for),
        then their outputs."""
        updated = self.scheduler.update_from_output(out, runner_out)
        if runner_out.logprobs or runner_out.prompt_logprobs:
            self._store_logprobs(runner_out)
        return [self._make_output(req) for req in updated]

    def _make_output(self, req: Request) -> RequestOutput:
        rid = req.request_id
        detok = self._detok[rid]
        new_id = req.output_token_ids[-1]
        delta = detok.append(new_id)
        if not req.is_finished:
            cut = detok.find_stop(len(delta))
            if cut is not None:
                stop = next(s for s in req.sampling_params.stop if detok.text.startswith(s, cut))
                detok.text = detok.text[:cut]
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED, stop)
        text = detok.text
        new_text = text[self._emitted[rid] :]
        self._emitted[rid] = len(text)
        finished = req.is_finished
        return RequestOutput(
            request_id=rid,
            prompt=self._prompts[rid],
            prompt_token_ids=req.prompt_token_ids,
            text=text,
            token_ids=list(req.output_token_ids),
            finished=finished,
            finish_reason=FINISH_REASON.get(req.status.value),
            stop_reason=req.stop_reason,
            new_token_ids=[new_id],
            new_text=new_text,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            arrival_ns=req.arrival_ns,
            first_token_ns=req.first_token_ns,
            finished_ns=time.monotonic_ns() if finished else None,
            num_preemptions=req.num_preemptions,
            logprobs=None if req.logprobs is None else list(req.logprobs),
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
        )

    def _store_logprobs(self, runner_out) -> None:
        """Keep the step's logprob rows on their requests, as {token_id: Logprob} (outputs.py)."""
        for rid, row in (runner_out.logprobs or {}).items():
            req = self.scheduler.requests.get(rid)
            if req is not None and len(req.logprobs) < req.num_output_tokens:  # not if aborted mid-step
                req.logprobs.append(self._logprob_dict(row))
        for rid, (first, rows) in (runner_out.prompt_logprobs or {}).items():
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            for pos, row in enumerate(rows, first):
                if pos == len(req.prompt_logprobs):  # a recomputed chunk (preemption) adds nothing
                    req.prompt_logprobs.append(self._logprob_dict(row))

    def _logprob_dict(self, row: tuple[list[int], list[float], int]) -> dict[int, Logprob]:
        ids, lps, rank = row
        decode = self.tokenizer.decode
        out = {ids[0]: Logprob(lps[0], rank, decode([ids[0]]))}
        for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), 1):
            if tid not in out:
                out[tid] = Logprob(lp, r, decode([tid]))
        return out

    def _release(self, req: Request) -> None:
        """Forget a finished request's engine-side state once it has been reported."""
        rid = req.request_id
        self.recorder.on_request_events(req, req.take_events())
        self.recorder.on_request_finished(req)
        self.scheduler.pop_finished(rid)
        self.executor.forget(rid)
        self._detok.pop(rid, None)
        self._prompts.pop(rid, None)
        self._emitted.pop(rid, None)

    # ---- misc ----
    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_kv_blocks_free": bm.num_free_blocks,
            "num_kv_blocks_total": bm.num_blocks,
            "kv_cache_usage": bm.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prefix_queries": bm.num_prefix_queries,
            "num_prefix_hits": bm.num_prefix_hits,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()
        self._clock.close()
