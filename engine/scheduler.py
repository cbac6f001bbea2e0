"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption.

No torch here. One ``schedule()`` call per engine step produces a ``SchedulerOutput``;
``update_from_output`` applies the model runner's answer and closes the loop.

Policy (vLLM v1's shape):
- running requests first, in order, each taking min(its remaining tokens, the token
  budget) — a decode takes 1, a prefill chunk takes what the budget allows;
- when the pool cannot fit a running request's new slots, the victim is the most
  recently scheduled running request (the tail of ``running``: the least work lost
  and FCFS order kept). Preemption is by recompute: the victim's blocks are freed and
  it goes to the front of the waiting queue; when it runs again, it prefills prompt +
  outputs so far (prefix-cache hits on its own freed blocks make that cheap);
- then waiting requests in FCFS order while the budget, ``max_num_seqs`` and the pool
  allow; none are admitted in a step that preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from layerscope.engine.block_manager import BlockManager
from layerscope.engine.request import Request, RequestEventType, RequestStatus
from layerscope.engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """What the model runner needs for one request in one step."""

    request_id: str
    token_ids: list[int]  # the new tokens to compute this step
    start_pos: int  # position of token_ids[0] == num_computed_tokens before the step
    block_ids: list[int]  # the whole block table
    sampling_params: SamplingParams
    do_sample: bool  # this chunk reaches the end of the known tokens: sample one
    is_prefill: bool  # still computing prompt (or recomputing after preemption)
    num_output_tokens: int  # outputs so far (for per-request sampling state)
    # prompt_logprobs only: the prompt tokens that this chunk's positions predict (position
    # start_pos + i predicts prompt_logprob_targets[i]); empty otherwise
    prompt_logprob_targets: list[int] = field(default_factory=list)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: dict[str, int]
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step (aborts)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]  # request id -> token, for requests with do_sample
    prepare_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    layer_times: list[tuple[str, int]] | None = None
    collectives: list = field(default_factory=list)  # CollectiveRecord of this step (TP)
    # only for requests that ask (sampler.compute_logprobs' rows): request id -> the sampled
    # token's row; request id -> (first prompt position, one row per predicted prompt token)
    logprobs: dict[str, tuple[list[int], list[float], int]] | None = None
    prompt_logprobs: dict[str, tuple[int, list[tuple[list[int], list[float], int]]]] | None = None


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_id = 0
        self.num_preemptions = 0  # total, for metrics
        self._finished_since_last_step: list[str] = []

    # ---- queue management ----
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        request.record_event(RequestEventType.QUEUED)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a request wherever it is; its blocks return to the pool at once."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        req.record_event(RequestEventType.ABORTED)
        return req

    def finish_request(self, request_id: str, status: RequestStatus, reason: int | str | None = None) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            req.stop_reason = reason
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.block_manager.free(req)
        self._finished_since_last_step.append(req.request_id)
        if status != RequestStatus.FINISHED_ABORTED:
            req.record_event(RequestEventType.FINISHED, reason=status.value)

    def pop_finished(self, request_id: str) -> Request | None:
        """Forget a finished request (the engine calls this once it has reported it)."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
        return req

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        num_scheduled: dict[str, int] = {}
        preempted: list[Request] = []
        scheduled_running: list[Request] = []

        # this loop runs once per running request per step (the replay's hot path: ~10^6 a split),
        # hence the local names and len() over the num_tokens property
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = len(req.all_token_ids) - req.num_computed_tokens
            if num_new > budget:
                num_new = budget
            while bm.allocate_slots(req, num_new) is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            num_scheduled[req.request_id] = num_new
            scheduled_running.append(req)
            budget -= num_new
            i += 1

        newly_running: list[Request] = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_cached = bm.get_computed_blocks(req)
            if req.prompt_logprobs is not None and not req.num_output_tokens:
                hits, num_cached = [], 0  # prompt logprobs need every prompt position computed (as vLLM)
            num_new = req.num_tokens - num_cached
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if bm.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.popleft()
            bm.record_prefix_lookup(req.num_tokens, num_cached)
            resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            now = time.monotonic_ns()
            if resumed:
                req.record_event(RequestEventType.RESUMED, now, num_cached_tokens=num_cached)
            else:
                req.first_scheduled_ns = now
                req.record_event(RequestEventType.SCHEDULED, now, num_cached_tokens=num_cached)
            self.running.append(req)
            newly_running.append(req)
            num_scheduled[req.request_id] = num_new
            budget -= num_new

        scheduled = [self._describe(r, num_scheduled[r.request_id]) for r in scheduled_running + newly_running]
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(
            step_id=self.step_id,
            scheduled=scheduled,
            num_scheduled_tokens=num_scheduled,
            preempted_ids=[r.request_id for r in preempted],
            finished_ids=finished,
        )

    def _describe(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        targets = []
        if req.prompt_logprobs is not None and not req.num_output_tokens:
            targets = req.prompt_token_ids[start + 1 : start + num_new + 1]
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start : start + num_new],
            start_pos=start,
            block_ids=list(req.block_ids),
            sampling_params=req.sampling_params,
            do_sample=start + num_new == req.num_tokens,
            is_prefill=start < req.num_tokens - 1,
            num_output_tokens=req.num_output_tokens,
            prompt_logprob_targets=targets,
        )

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.record_event(RequestEventType.PREEMPTED, num_blocks_free=self.block_manager.num_free_blocks)
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what stopped.

        Returns the requests that got a new token this step (finished ones included).
        """
        updated: list[Request] = []
        requests, bm, sampled, running = self.requests, self.block_manager, runner_out.sampled_token_ids, \
            RequestStatus.RUNNING  # locals: once per scheduled request per step
        for sched in out.scheduled:
            req = requests.get(sched.request_id)
            if req is None or req.status is not running:
                continue  # aborted while the step ran
            req.num_computed_tokens += sched.num_new_tokens
            bm.cache_blocks(req, req.num_computed_tokens)  # returns at once when no block filled
            if not sched.do_sample:
                continue
            token = sampled[sched.request_id]
            req.append_output_token(token)
            if req.first_token_ns is None:
                req.first_token_ns = time.monotonic_ns()
                req.record_event(RequestEventType.FIRST_TOKEN, req.first_token_ns)
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status)
            updated.append(req)
        return updated

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        num_out = len(req.output_token_ids)
        if num_out >= sp.min_tokens:
            if not sp.ignore_eos and token == req.eos_token_id:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and num_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
