"""Scheduler: a stateful property test with a fake model, plus deterministic scenarios.

The fake model writes, for every scheduled token, the full token prefix it was computed
under into a KV model of the pool (slot by slot), and samples a token for each request
with ``do_sample``. Every prefix-cache hit the scheduler takes is checked against that
KV model (soundness), and the scheduler's and block manager's bookkeeping is checked
after every operation.

(Over 400 lines: the fake model, the state machine and the scenarios share one KV model
of the pool.)
"""

from __future__ import annotations

import random
from typing import Callable

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from layerscope.engine.block_manager import BlockManager
from layerscope.engine.request import Request, RequestEventType, RequestStatus
from layerscope.engine.sampling_params import SamplingParams
from layerscope.engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput

EOS = 4


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def note(value: str) -> None:
    """hypothesis.event, also usable from the plain (non-hypothesis) scenarios."""
    if currently_in_test_context():
        event(value)


def event_types(req: Request) -> list[RequestEventType]:
    return [e.type for e in req._events]


class Harness:
    """A scheduler + block manager + fake model, checking invariants around every call."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int = 8,
        budget: int = 64,
        max_model_len: int | None = None,
        chunked: bool = True,
        caching: bool = True,
    ):
        self.bs = block_size
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or num_blocks * block_size
        assert self.max_model_len <= num_blocks * block_size  # the engine enforces this
        if not chunked:
            assert budget >= self.max_model_len  # the engine enforces this too
        self.chunked = chunked
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, self.max_model_len, chunked)
        # slot contents: the token prefix (inclusive) whose KV the slot holds
        self.kv: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.all: dict[str, Request] = {}
        self.n = 0
        self.steps = 0
        self.hit_tokens = 0
        self.pending_finished: set[str] = set()  # freed since the last schedule()
        orig = self.bm.get_computed_blocks

        def checked_get_computed_blocks(req: Request):
            hits, n = orig(req)
            self._check_hits(req, hits, n)
            return hits, n

        self.bm.get_computed_blocks = checked_get_computed_blocks

    # ---- requests ----
    def add(
        self,
        prompt: list[int],
        max_tokens: int = 4,
        eos: int | None = None,
        rid: str | None = None,
        **sp,
    ) -> Request:
        rid = rid or f"r{self.n}"
        self.n += 1
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), eos_token_id=eos, arrival_ns=0)
        self.sched.add_request(req)
        self.all[rid] = req
        assert req.status == RequestStatus.WAITING and self.sched.waiting[-1] is req
        self.check_state()
        return req

    def abort(self, rid: str) -> Request | None:
        req = self.all[rid]
        was_finished = req.is_finished
        got = self.sched.abort_request(rid)
        if was_finished:
            assert got is None
        else:
            assert got is req
            assert req.status == RequestStatus.FINISHED_ABORTED
            assert event_types(req)[-1] == RequestEventType.ABORTED
            assert req.block_ids == []
            self.pending_finished.add(rid)
        self.check_state()
        return got

    # ---- checks ----
    def _check_hits(self, req: Request, hits: list[int], n: int) -> None:
        bs = self.bs
        assert n == len(hits) * bs and n < req.num_tokens
        assert len(set(hits)) == len(hits), f"block adopted twice: {hits}"
        if not self.bm.enable_prefix_caching:
            assert hits == []
        for i, block_id in enumerate(hits):
            for s in range(bs):
                pos = i * bs + s
                want = tuple(req.all_token_ids[: pos + 1])
                assert self.kv[block_id][s] == want, (
                    f"unsound hit for {req.request_id}: block {block_id} slot {s} holds "
                    f"{self.kv[block_id][s]}, needs {want}"
                )

    def live(self) -> list[Request]:
        return [r for r in self.all.values() if not r.is_finished]

    def check_state(self, in_flight: dict[str, int] | None = None) -> None:
        """Queue / pool consistency. ``in_flight``: tokens scheduled but not yet computed."""
        in_flight = in_flight or {}
        sched, bm, bs = self.sched, self.bm, self.bs
        running_ids = [r.request_id for r in sched.running]
        waiting_ids = [r.request_id for r in sched.waiting]
        assert len(set(running_ids)) == len(running_ids)
        assert len(set(waiting_ids)) == len(waiting_ids)
        assert not set(running_ids) & set(waiting_ids), "a request both waiting and running"
        assert len(sched.running) <= self.max_num_seqs
        live = self.live()
        assert {r.request_id for r in live} == set(running_ids) | set(waiting_ids)
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            computed = r.num_computed_tokens + in_flight.get(r.request_id, 0)
            assert computed <= r.num_tokens
            assert len(r.block_ids) == ceil_div(computed, bs), r
            if not in_flight.get(r.request_id):
                assert r.num_computed_tokens < r.num_tokens  # always something left to compute
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.block_ids == [] and r.block_hashes == [] and r.num_computed_tokens == 0
        for r in self.all.values():
            if r.is_finished:
                assert r.block_ids == [], f"finished {r} holds blocks"
            sp = r.sampling_params
            assert r.num_output_tokens <= sp.max_tokens
            assert r.num_tokens <= max(self.max_model_len, r.num_prompt_tokens)
        bm.check_invariants(live)
        if not any(r.block_ids for r in live):
            assert bm.num_free_blocks == bm.num_blocks
        if not sched.running:
            assert bm.num_free_blocks == bm.num_blocks

    def _check_schedule(self, out: SchedulerOutput, running_before: list[Request], waiting_before: list[Request]):
        sched = self.sched
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert set(ids) == set(out.num_scheduled_tokens)
        for s in out.scheduled:
            assert out.num_scheduled_tokens[s.request_id] == s.num_new_tokens >= 1
        assert out.total_num_scheduled_tokens <= self.budget, "token budget exceeded"
        assert len(ids) <= self.max_num_seqs, "max_num_seqs exceeded"
        assert set(out.finished_ids) == self.pending_finished
        self.pending_finished = set()

        # preemption: victims are taken from the tail of running, newest first, and go to
        # the front of waiting in their original order
        k = len(out.preempted_ids)
        assert out.preempted_ids == [r.request_id for r in reversed(running_before)][:k]
        if k:
            note("preemption")
            victims = running_before[len(running_before) - k :]
            assert list(sched.waiting)[:k] == victims
            for v in victims:
                assert v.status == RequestStatus.PREEMPTED
                assert v.num_computed_tokens == 0 and v.block_ids == []
                assert event_types(v)[-1] == RequestEventType.PREEMPTED
                assert v.request_id not in ids
            assert set(ids) <= {r.request_id for r in running_before}, "admitted in a step that preempted"
        kept = running_before[: len(running_before) - k]
        a = sum(1 for i in ids if i in {r.request_id for r in running_before})
        assert ids[:a] == [r.request_id for r in kept[:a]], "running requests scheduled out of order"
        if a < len(kept):
            assert out.total_num_scheduled_tokens == self.budget, "a running request skipped with budget left"
        newly = ids[a:]
        assert newly == [r.request_id for r in waiting_before[: len(newly)]], "waiting requests admitted out of FCFS order"
        assert [r.request_id for r in sched.running] == [r.request_id for r in kept] + newly

        for s in out.scheduled:
            req = self.all[s.request_id]
            assert s.start_pos == req.num_computed_tokens
            assert s.token_ids == req.all_token_ids[s.start_pos : s.start_pos + s.num_new_tokens]
            assert s.block_ids == req.block_ids
            assert len(s.block_ids) == ceil_div(s.start_pos + s.num_new_tokens, self.bs)
            assert s.do_sample == (s.start_pos + s.num_new_tokens == req.num_tokens)
            assert s.is_prefill == (s.start_pos < req.num_tokens - 1)
            assert s.num_output_tokens == req.num_output_tokens
            if not self.chunked:
                assert s.do_sample, "with chunked prefill disabled every request computes all it has"
        for rid in newly:
            req = self.all[rid]
            assert req.num_computed_tokens % self.bs == 0
            self.hit_tokens += req.num_computed_tokens
            last = req._events[-1]
            if req.num_preemptions:
                assert last.type == RequestEventType.RESUMED
                note("resumed")
            else:
                assert last.type == RequestEventType.SCHEDULED
                assert req.num_cached_tokens == req.num_computed_tokens
            assert last.attrs["num_cached_tokens"] == req.num_computed_tokens
        # liveness: with work pending, every step schedules something
        if running_before or waiting_before:
            assert out.scheduled, "a step with unfinished requests scheduled nothing"

    # ---- one engine step ----
    def step(self, sample: Callable[[Request], int] = lambda r: 0) -> SchedulerOutput:
        sched = self.sched
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        step_id = sched.step_id
        out = sched.schedule()
        assert out.step_id == step_id + 1
        self.steps += 1
        self._check_schedule(out, running_before, waiting_before)
        self.check_state(in_flight=dict(out.num_scheduled_tokens))

        # the fake model: write KV for every scheduled token, sample where asked
        sampled: dict[str, int] = {}
        for s in out.scheduled:
            req = self.all[s.request_id]
            for j, tok in enumerate(s.token_ids):
                pos = s.start_pos + j
                block_id = s.block_ids[pos // self.bs]
                assert self.bm.blocks[block_id].ref_count == 1, f"write into shared block {block_id}"
                self.kv[block_id][pos % self.bs] = tuple(req.all_token_ids[: pos + 1])
            if s.do_sample:
                sampled[s.request_id] = sample(req)

        before = {
            s.request_id: (self.all[s.request_id].num_computed_tokens, self.all[s.request_id].num_output_tokens)
            for s in out.scheduled
        }
        updated = sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        assert [r.request_id for r in updated] == [s.request_id for s in out.scheduled if s.do_sample]
        for s in out.scheduled:
            req = self.all[s.request_id]
            computed0, outputs0 = before[s.request_id]
            assert req.num_computed_tokens == computed0 + s.num_new_tokens
            if s.do_sample:
                assert req.num_output_tokens == outputs0 + 1
                assert req.output_token_ids[-1] == sampled[s.request_id]
                self._check_stop(req)
        self.check_state()
        return out

    def _check_stop(self, req: Request) -> None:
        sp = req.sampling_params
        tok = req.output_token_ids[-1]
        stops = (tok == req.eos_token_id and not sp.ignore_eos) or tok in sp.stop_token_ids
        stops = stops and req.num_output_tokens >= sp.min_tokens
        length = req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len
        if stops:
            assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == tok
        elif length:
            assert req.status == RequestStatus.FINISHED_LENGTH
        else:
            assert req.status == RequestStatus.RUNNING
        if req.is_finished:
            assert req.block_ids == []
            assert event_types(req)[-1] == RequestEventType.FINISHED
            self.pending_finished.add(req.request_id)

    def drain(self, sample: Callable[[Request], int] = lambda r: 0, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step(sample)
        assert not self.sched.has_unfinished(), "requests never finished"
        assert all(r.is_finished for r in self.all.values())
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked after everything finished"
        assert all(b.ref_count == 0 for b in self.bm.blocks)


# ---------------------------------------------------------------------------------------
# stateful machine: random arrivals, steps, aborts, finishes, preemptions
# ---------------------------------------------------------------------------------------

TOK = st.integers(0, 3)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 8),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 16),
        len_frac=st.floats(0.5, 1.0),
        chunked=st.booleans(),
        caching=st.booleans(),
        prefixes=st.lists(st.lists(TOK, min_size=1, max_size=8), min_size=1, max_size=3),
    )
    def setup(self, block_size, num_blocks, max_num_seqs, budget, len_frac, chunked, caching, prefixes):
        pool = num_blocks * block_size
        max_model_len = max(2, min(pool, round(pool * len_frac)))  # pool >= 2
        if not chunked:
            budget = max(budget, max_model_len)
        self.h = Harness(num_blocks, block_size, max_num_seqs, budget, max_model_len, chunked, caching)
        self.prefixes = prefixes

    @rule(
        which=st.integers(0, 2),
        suffix=st.lists(TOK, max_size=8),
        max_tokens=st.integers(1, 12),
        min_tokens=st.integers(0, 2),
        eos=st.sampled_from([None, EOS]),
        ignore_eos=st.booleans(),
        stop_ids=st.sampled_from([(), (3,)]),
        copies=st.integers(1, 3),
    )
    def arrive(self, which, suffix, max_tokens, min_tokens, eos, ignore_eos, stop_ids, copies):
        prompt = (list(self.prefixes[which % len(self.prefixes)]) + suffix)[: self.h.max_model_len - 1]
        for _ in range(copies):  # bursts of identical prompts: shared prefixes, pool pressure
            self.h.add(
                prompt,
                max_tokens=max_tokens,
                eos=eos,
                min_tokens=min_tokens,
                ignore_eos=ignore_eos,
                stop_token_ids=stop_ids,
            )

    @rule(data=st.data(), n=st.integers(1, 4))
    def step(self, data, n):
        # mostly token 0/1/2; 3 (a stop token for some) and EOS now and then
        token = st.integers(0, 15).map(lambda x: x if x <= EOS else x % 3)
        for _ in range(n):
            if not self.h.sched.has_unfinished():
                return
            self.h.step(lambda r: data.draw(token, label=f"token for {r.request_id}"))

    @precondition(lambda self: self.h.all)
    @rule(data=st.data(), live_only=st.integers(0, 3))
    def abort(self, data, live_only):
        live = sorted(r.request_id for r in self.h.live())
        pool = live if live and live_only else sorted(self.h.all)
        rid = data.draw(st.sampled_from(pool), label="abort")
        req = self.h.all[rid]
        event(f"abort (any) {req.status.name.lower()}")
        self.h.abort(rid)

    @precondition(lambda self: self.h.sched.running)
    @rule(data=st.data())
    def abort_running(self, data):
        rid = data.draw(st.sampled_from([r.request_id for r in self.h.sched.running]), label="abort running")
        event("abort running")
        self.h.abort(rid)

    @precondition(lambda self: any(r.is_finished for r in self.h.sched.requests.values()))
    @rule(data=st.data())
    def pop_finished(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r, q in self.h.sched.requests.items() if q.is_finished)))
        assert self.h.sched.pop_finished(rid) is self.h.all[rid]
        assert rid not in self.h.sched.requests

    @invariant()
    def consistent(self):
        self.h.check_state()

    def teardown(self):
        if hasattr(self, "h"):  # initialize ran
            self.h.drain()
            target(float(self.h.sched.num_preemptions), label="preemptions")
            if self.h.sched.num_preemptions:
                event("ran with preemptions")
            if self.h.hit_tokens:
                event("prefix-cache hits")


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine = SchedulerMachine.TestCase


# ---------------------------------------------------------------------------------------
# deterministic scenarios
# ---------------------------------------------------------------------------------------


def test_random_workloads_preempt_and_drain():
    """Seeded random workloads on tiny pools: preemption does happen, and all drain."""
    rng = random.Random(1234)
    total_preemptions = total_resumes = total_hits = 0
    for trial in range(40):
        bs = rng.choice([1, 2, 4])
        num_blocks = rng.randint(3, 8)
        pool = num_blocks * bs
        chunked = rng.random() < 0.7
        budget = rng.randint(2, 12) if chunked else pool
        h = Harness(num_blocks, bs, max_num_seqs=rng.randint(2, 4), budget=budget, max_model_len=pool, chunked=chunked)
        shared = [rng.randrange(4) for _ in range(rng.randint(1, 2 * bs + 1))]
        for _ in range(rng.randint(3, 8)):
            prompt = (shared + [rng.randrange(4) for _ in range(rng.randint(0, bs + 2))])[: pool - 1]
            h.add(prompt, max_tokens=rng.randint(1, pool), eos=EOS if rng.random() < 0.3 else None)
            for _ in range(rng.randint(0, 2)):
                if h.sched.has_unfinished():
                    h.step(lambda r: rng.randrange(5))
            if rng.random() < 0.1:
                h.abort(rng.choice(sorted(h.all)))
        h.drain(lambda r: rng.randrange(5))
        total_preemptions += h.sched.num_preemptions
        total_resumes += sum(1 for r in h.all.values() for e in r._events if e.type == RequestEventType.RESUMED)
        total_hits += h.hit_tokens
    assert total_preemptions > 0
    assert total_resumes > 0
    assert total_hits > 0


def test_preemption_victim_is_most_recently_scheduled_and_goes_to_front():
    h = Harness(num_blocks=6, block_size=2, max_num_seqs=4, budget=16, max_model_len=12)
    a = h.add([0, 1, 2], max_tokens=3, rid="A")
    b = h.add([1, 1, 1], max_tokens=4, rid="B")
    c = h.add([2, 2, 3], max_tokens=4, rid="C")
    out = h.step()  # all three prefill: 2 blocks each, pool full
    assert [s.request_id for s in out.scheduled] == ["A", "B", "C"]
    assert h.bm.num_free_blocks == 0
    d = h.add([3, 3, 3, 3], max_tokens=1, rid="D")
    out = h.step()  # decodes fit the partial blocks; D cannot get blocks
    assert [s.request_id for s in out.scheduled] == ["A", "B", "C"] and not out.preempted_ids
    assert list(h.sched.waiting) == [d]
    out = h.step()  # A needs a 3rd block: the tail (C) is preempted, B fits in C's other block
    assert out.preempted_ids == ["C"]
    assert [s.request_id for s in out.scheduled] == ["A", "B"]
    assert list(h.sched.waiting) == [c, d]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.block_ids == []
    assert c.num_preemptions == 1 and h.sched.num_preemptions == 1
    assert c.num_recomputed_tokens == 4
    assert event_types(c)[-1] == RequestEventType.PREEMPTED
    assert a.status == RequestStatus.FINISHED_LENGTH  # 3 tokens
    out = h.step()  # A's blocks are free: C resumes before D
    assert "C" in out.num_scheduled_tokens
    assert c.status == RequestStatus.RUNNING
    assert event_types(c).count(RequestEventType.RESUMED) == 1
    assert c.num_cached_tokens == 0  # the first schedule's hit count is kept
    # C recomputes prompt + its two outputs, then samples its third
    sc = next(s for s in out.scheduled if s.request_id == "C")
    assert sc.start_pos + sc.num_new_tokens == 5 and sc.do_sample and sc.is_prefill
    assert c.num_output_tokens == 3
    h.drain()
    assert c.output_token_ids == [0, 0, 0, 0] and b.num_output_tokens == 4


def test_preempted_request_reuses_its_own_cached_blocks_on_resume():
    h = Harness(num_blocks=5, block_size=2, max_num_seqs=4, budget=16, max_model_len=10)
    a = h.add([0, 1, 2], max_tokens=3, rid="A")
    b = h.add([3, 2, 1, 0, 3], max_tokens=4, rid="B")
    h.step()
    h.step()
    b_blocks = list(b.block_ids)
    out = h.step()  # A needs a 3rd block: B preempted, its tail block evicted first
    assert out.preempted_ids == ["B"]
    assert a.is_finished
    out = h.step()
    assert out.scheduled[0].request_id == "B"
    resumed = [e for e in b._events if e.type == RequestEventType.RESUMED]
    assert len(resumed) == 1 and resumed[0].attrs["num_cached_tokens"] == 4
    assert b.block_ids[:2] == b_blocks[:2]  # its own prefix blocks, still cached
    assert out.scheduled[0].start_pos == 4
    h.drain()


def test_abort_waiting_and_running_frees_blocks():
    h = Harness(num_blocks=4, block_size=2, max_num_seqs=4, budget=16)
    a = h.add([0, 1, 2], max_tokens=5, rid="A")
    b = h.add([1, 2, 3, 0, 1, 2], max_tokens=5, rid="B")  # 3 blocks: does not fit next to A
    h.step()
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert h.bm.num_free_blocks == 2
    assert h.abort("B") is b
    assert b not in h.sched.waiting and b.block_ids == []
    assert h.abort("A") is a
    assert a not in h.sched.running and a.block_ids == []
    assert h.bm.num_free_blocks == 4
    assert h.abort("A") is None and h.sched.abort_request("nope") is None
    out = h.sched.schedule()
    assert set(out.finished_ids) == {"A", "B"} and out.is_empty
    assert event_types(a)[-1] == RequestEventType.ABORTED
    assert RequestEventType.FINISHED not in event_types(a)


def test_abort_preempted_request():
    h = Harness(num_blocks=4, block_size=2, max_num_seqs=4, budget=16)
    h.add([0, 1, 2], max_tokens=8, rid="A")
    b = h.add([3, 3, 3], max_tokens=8, rid="B")
    h.step()
    h.step()
    out = h.step()
    assert out.preempted_ids == ["B"] and b.status == RequestStatus.PREEMPTED
    h.abort("B")
    assert b.status == RequestStatus.FINISHED_ABORTED and b not in h.sched.waiting
    h.drain()


def test_abort_between_schedule_and_update_is_ignored():
    h = Harness(num_blocks=8, block_size=2, budget=16)
    a = h.add([0, 1, 2], max_tokens=4, rid="A")
    out = h.sched.schedule()
    h.sched.abort_request("A")
    assert a.block_ids == [] and h.bm.num_free_blocks == 8
    updated = h.sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"A": 1}))
    assert updated == [] and a.output_token_ids == [] and a.num_computed_tokens == 0
    h.bm.check_invariants()
    assert h.bm.num_free_blocks == 8


def test_chunked_prefill_splits_long_prompt_and_mixes_decodes():
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=4, budget=8)
    long = h.add([i % 4 for i in range(20)], max_tokens=2, rid="L")
    out = h.step()
    assert out.num_scheduled_tokens == {"L": 8}
    assert out.scheduled[0].is_prefill and not out.scheduled[0].do_sample
    assert long.num_output_tokens == 0 and long.num_computed_tokens == 8
    h2 = Harness(num_blocks=16, block_size=4, max_num_seqs=4, budget=8)
    d = h2.add([3, 2, 1], max_tokens=10, rid="D")
    h2.step()
    assert d.num_output_tokens == 1
    long = h2.add([i % 4 for i in range(20)], max_tokens=2, rid="L")
    starts = []
    for expected_total in (8, 8, 7):
        out = h2.step()
        assert out.total_num_scheduled_tokens == expected_total
        assert out.num_scheduled_tokens["D"] == 1  # the decode rides along
        sl = next(s for s in out.scheduled if s.request_id == "L")
        starts.append((sl.start_pos, sl.num_new_tokens, sl.do_sample))
        sd = next(s for s in out.scheduled if s.request_id == "D")
        assert not sd.is_prefill and sd.do_sample
    assert starts == [(0, 7, False), (7, 7, False), (14, 6, True)]
    assert long.num_output_tokens == 1
    h2.drain()


def test_without_chunked_prefill_prompt_over_remaining_budget_waits():
    # the engine requires budget >= max_model_len without chunking, so a prompt is at
    # most budget - 1 tokens: two running decodes leave budget - 2
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=4, budget=8, max_model_len=8, chunked=False)
    d1 = h.add([3, 2, 1], max_tokens=3, rid="D1")
    d2 = h.add([1, 2], max_tokens=3, rid="D2")
    h.step()
    p = h.add([0, 1, 2, 3, 0, 1], max_tokens=1, rid="P")  # 6 tokens: fits the 6 left exactly
    q = h.add([1] * 6 + [2], max_tokens=1, rid="Q")  # 7 tokens
    out = h.step()
    assert out.num_scheduled_tokens == {"D1": 1, "D2": 1, "P": 6}
    assert q.status == RequestStatus.WAITING
    out = h.step()
    assert out.num_scheduled_tokens == {"D1": 1, "D2": 1}  # 6 left < 7: Q waits, unchunked
    assert q.status == RequestStatus.WAITING and q.num_computed_tokens == 0 and q.block_ids == []
    assert d1.is_finished and d2.is_finished and p.is_finished
    out = h.step()
    assert out.num_scheduled_tokens == {"Q": 7} and out.scheduled[0].do_sample
    h.drain()
    # the same workload with chunked prefill starts Q at once, in a chunk
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=4, budget=8, max_model_len=8, chunked=True)
    h.add([3, 2, 1], max_tokens=3, rid="D1")
    h.add([1, 2], max_tokens=3, rid="D2")
    h.step()
    h.add([1] * 6 + [2], max_tokens=1, rid="Q")
    out = h.step()
    assert out.num_scheduled_tokens == {"D1": 1, "D2": 1, "Q": 6}
    h.drain()


def test_without_chunked_prefill_waiting_head_blocks_later_requests():
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=4, budget=8, max_model_len=8, chunked=False)
    h.add([3, 2, 1], max_tokens=5, rid="D1")
    h.add([1, 2], max_tokens=5, rid="D2")
    h.step()
    h.add([1] * 7, max_tokens=1, rid="BIG")
    h.add([2], max_tokens=1, rid="SMALL")
    out = h.step()
    assert out.num_scheduled_tokens == {"D1": 1, "D2": 1}  # FCFS: SMALL does not overtake BIG
    h.drain()


def test_max_num_seqs_limits_running():
    h = Harness(num_blocks=16, block_size=2, max_num_seqs=2, budget=64)
    reqs = [h.add([i, i], max_tokens=2, rid=f"R{i}") for i in range(3)]
    out = h.step()
    assert [s.request_id for s in out.scheduled] == ["R0", "R1"]
    assert reqs[2].status == RequestStatus.WAITING
    out = h.step()  # R0/R1 finish this step; R2 is still waiting during it
    assert [s.request_id for s in out.scheduled] == ["R0", "R1"]
    out = h.step()
    assert [s.request_id for s in out.scheduled] == ["R2"]
    h.drain()


def test_prefix_hit_in_scheduler_and_cached_count():
    h = Harness(num_blocks=16, block_size=4, budget=64)
    prompt = [0, 1, 2, 3, 3, 2, 1, 0, 1]
    a = h.add(prompt, max_tokens=1, rid="A")
    h.drain()
    assert a.num_cached_tokens == 0
    b = h.add(prompt, max_tokens=1, rid="B")
    out = h.step()
    assert b.num_cached_tokens == 8
    assert out.scheduled[0].start_pos == 8 and out.scheduled[0].token_ids == [1]
    c = h.add(prompt[:4] + [0, 0, 0, 0, 1], max_tokens=1, rid="C")
    h.step()
    assert c.num_cached_tokens == 4
    h.drain()


def test_stop_conditions():
    h = Harness(num_blocks=16, block_size=2, budget=64, max_model_len=10)
    e = h.add([0, 1], max_tokens=5, eos=EOS, rid="E")
    m = h.add([0, 1], max_tokens=5, eos=EOS, min_tokens=2, rid="M")
    i = h.add([0, 1], max_tokens=2, eos=EOS, ignore_eos=True, rid="I")
    s = h.add([0, 1], max_tokens=5, stop_token_ids=(2,), rid="S")
    L = h.add([0] * 8, max_tokens=16, rid="L")  # hits max_model_len
    h.step(lambda r: EOS if r.request_id != "S" else 2)
    assert e.status == RequestStatus.FINISHED_STOPPED and e.stop_reason == EOS
    assert s.status == RequestStatus.FINISHED_STOPPED and s.stop_reason == 2
    assert m.status == RequestStatus.RUNNING  # min_tokens not reached
    assert i.status == RequestStatus.RUNNING
    h.step(lambda r: EOS)
    assert m.status == RequestStatus.FINISHED_STOPPED
    assert i.status == RequestStatus.FINISHED_LENGTH and i.output_token_ids == [EOS, EOS]
    assert L.status == RequestStatus.FINISHED_LENGTH and L.num_tokens == 10
    h.drain()


def test_duplicate_request_id_rejected():
    h = Harness(num_blocks=4, block_size=2)
    h.add([1], rid="X")
    with pytest.raises(ValueError, match="duplicate"):
        h.sched.add_request(Request("X", [2], SamplingParams(), arrival_ns=0))


def test_pop_finished_forgets_only_finished():
    h = Harness(num_blocks=4, block_size=2)
    r = h.add([1, 2], max_tokens=1, rid="X")
    assert h.sched.pop_finished("X") is r and "X" in h.sched.requests
    h.drain()
    assert h.sched.pop_finished("X") is r and "X" not in h.sched.requests


def test_blocked_waiting_request_counts_prefix_lookup_once():
    from layerscope.engine.block_manager import BlockManager
    from layerscope.engine.request import Request
    from layerscope.engine.sampling_params import SamplingParams
    from layerscope.engine.scheduler import ModelRunnerOutput, Scheduler

    bm = BlockManager(4, 2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=8)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    sched.add_request(Request("a", [1, 2, 3, 4, 5], sp))  # takes 3 of 4 blocks
    sched.add_request(Request("b", [1, 2, 9, 9, 9, 9], sp))  # needs 3: waits
    for _ in range(3):
        out = sched.schedule()
        sampled = {s.request_id: 7 for s in out.scheduled if s.do_sample}
        sched.update_from_output(out, ModelRunnerOutput(sampled))
        if "b" in out.num_scheduled_tokens:
            break
    # "a" counted once at admission; "b" once when finally admitted (or not yet)
    assert bm.num_prefix_queries in (5, 5 + 6)
