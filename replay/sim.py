"""The replay: the engine's own Scheduler and BlockManager driven on a virtual clock.

Events in time order: a request reaches the gateway (admission: ``max_concurrency`` admitted, up to
``max_queue`` waiting FCFS, the rest refused), reaches its replica after the hand-off, and each
replica runs steps back to back while it has work, each as long as the step-cost model says for
what the real scheduler put in it. No torch and no model: the sampled token is a fixed one per
request (outputs run to their recorded length, as the workloads' ignore_eos). Prompts are built
from the recorded chained block hashes (``HASH_TOKENS`` tokens each), so the real prefix cache sees
the run's sharing whatever the block size.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from layerscope.engine.block_manager import BlockManager
from layerscope.engine.request import Request, RequestStatus
from layerscope.engine.sampling_params import SamplingParams
from layerscope.engine.scheduler import ModelRunnerOutput, Scheduler
from layerscope.replay.cost import CostModel
from layerscope.replay.inputs import HASH_TOKENS, Front, Settings, Workload
from layerscope.replay.metrics import figures

RUNNING = RequestStatus.RUNNING
_GW_ARRIVE, _ENGINE_ARRIVE, _STEP_START, _STEP_END = 0, 1, 2, 3  # same-time order: arrivals before a step


class _Sched:
    """What update_from_output reads of a scheduled request (the runner's inputs are not built)."""

    __slots__ = ("request_id", "num_new_tokens", "do_sample")

    def __init__(self, rid: str, n: int, do_sample: bool):
        self.request_id, self.num_new_tokens, self.do_sample = rid, n, do_sample


class ReplayScheduler(Scheduler):
    """The engine's Scheduler, policy untouched; only the model runner's input description is
    skipped (token slices and block tables a replay has no runner for). It sums the step's cost
    features as it goes (``features``: prefill tokens, decode sequences, context tokens; the caller
    resets them): a second pass over the batch cost ~5 % of a replay."""

    features = (0, 0, 0)

    def _describe(self, req: Request, num_new: int) -> _Sched:  # type: ignore[override]
        start, total = req.num_computed_tokens, len(req.all_token_ids)
        pf, dec, ctx = self.features
        if start < total - 1:  # a prefill chunk (or a recompute after preemption)
            self.features = (pf + num_new, dec, ctx + start + num_new)
        else:
            self.features = (pf, dec + 1, ctx + start + num_new)
        return _Sched(req.request_id, num_new, start + num_new == total)


def prompt_tokens(wl: Workload, i: int) -> list[int]:
    """Request ``i``'s synthetic prompt: one token per recorded hash (then zeros) per ``HASH_TOKENS``
    chunk, the rest unique to the request. Without hashes, its measured cache hits become a prefix
    of one chain shared by every request (an approximation of the run's sharing)."""
    n, own = int(wl.prompt_len[i]), -(i + 1)
    if wl.hashes is not None:
        chunks = wl.hashes[i][: n // HASH_TOKENS]
        pad = [0] * (HASH_TOKENS - 1)
        toks = [t for h in chunks for t in (int(h), *pad)]
    else:
        toks = [t for j in range(int(wl.cached_len[i]) // HASH_TOKENS) for t in (j + 1, *([0] * (HASH_TOKENS - 1)))]
        toks = toks[:n]
    return toks + [own] * (n - len(toks))


@dataclass
class Result:
    figures: dict[str, Any]
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray
    engine_s: np.ndarray | None = None  # engine arrival to first token (the engine's share of TTFT)


class _Draws:
    """Per step, the residual and loop gap of a run's step of the same kind near the same time (one of
    the 5 nearest, seeded), plus the expected CPU wait of its kind at that time (``CostModel.wait_at``:
    a split swaps it apart from the work); past the run's end, its timeline wraps around. ``noise``
    off: the fitted cost alone, the median gap and the mean wait."""

    def __init__(self, cost: CostModel, seed: int, noise: bool):
        self.rng = np.random.default_rng(seed)
        self.noise = noise
        # Python lists: a bisect per step is ~10x cheaper than numpy's scalar searchsorted
        self.kinds = [(cost.t_decode.tolist(), cost.resid_decode.tolist(), cost.gap_decode.tolist()),
                      (cost.t_prefill.tolist(), cost.resid_prefill.tolist(), cost.gap_prefill.tolist())]
        self.median_gap = [float(np.median(cost.gap_decode)), float(np.median(cost.gap_prefill))]
        self.jitter, self.j = self.rng.integers(-2, 3, size=4096).tolist(), 0
        self.waits = [_WaitCurve(cost, False), _WaitCurve(cost, True)]
        self.mean_wait = [float(w.mean()) if len(w) else 0.0 for w in (cost.wait_decode, cost.wait_prefill)]

    def step(self, cost: CostModel, t: float, pf: int, dec: int, ctx: int) -> tuple[float, float]:
        k = 1 if pf else 0  # a prefill step's stalls and gaps are not a decode step's
        if not self.noise:
            return cost.predict(pf, dec, ctx) + self.mean_wait[k], self.median_gap[k]
        times, resid, gap = self.kinds[k]
        span = times[-1] + 1e-3
        i = bisect_left(times, t % span if t > span else t)
        if self.j == 4096:
            self.jitter, self.j = self.rng.integers(-2, 3, size=4096).tolist(), 0
        i = min(max(i + self.jitter[self.j], 0), len(times) - 1)
        self.j += 1
        # the wait joins the residual before predict's floor: with the run's own wait the step's time
        # is its measured wall time again (a floor on the work alone would lift steps that waited less)
        w = self.waits[k].at(t) if self.waits[k].on else 0.0
        return cost.predict(pf, dec, ctx, resid[i] + w), gap[i]


class _WaitCurve:
    """``CostModel.wait_at`` for one kind, per step in Python (numpy per scalar costs ~10x)."""

    def __init__(self, cost: CostModel, prefill: bool):
        tw, w = (cost.t_wait_prefill, cost.wait_prefill) if prefill else (cost.t_wait_decode, cost.wait_decode)
        self.on = bool(len(w))
        self.times, self.n = tw.tolist(), len(w)
        self.cs = np.r_[0.0, np.cumsum(w)].tolist()
        self.span = float(tw[-1]) + 1e-3 if self.on else 0.0

    def at(self, t: float) -> float:
        k = bisect_left(self.times, t % self.span if t > self.span else t)
        lo, hi = min(max(k - 2, 0), self.n - 1), min(max(k + 3, 1), self.n)
        lo = min(lo, hi - 1)
        return (self.cs[hi] - self.cs[lo]) / (hi - lo)


class _Engine:
    def __init__(self, s: Settings, num_kv_blocks: int, hash_memo: dict | None):
        self.bm = BlockManager(num_kv_blocks, s.block_size, s.enable_prefix_caching, hash_memo)
        self.max_len = min(s.max_model_len, num_kv_blocks * s.block_size)
        self.sched = ReplayScheduler(self.bm, s.max_num_seqs, s.max_num_batched_tokens, self.max_len,
                                     s.enable_chunked_prefill)
        self.busy = False


def replay(wl: Workload, s: Settings, num_kv_blocks: int, front: Front, cost: CostModel, seed: int = 0,
           noise: bool = True, hash_memo: dict | None = None) -> Result:
    """Replay ``wl`` under ``s`` with ``cost``; per-request latencies and the run's figures.
    ``hash_memo``: the prefix cache's block hashes, kept across replays of the same prompts (a split)."""
    n = len(wl)
    engines = [_Engine(s, num_kv_blocks, hash_memo) for _ in range(s.replicas)]
    draw = _Draws(cost, seed, noise)
    frng = np.random.default_rng([seed, 1])  # its own stream: the steps' draws stay common across scenarios
    adm_d, route, out_first, out_last = front.samples[frng.integers(0, len(front.samples), size=n)].T
    ev: list[tuple] = [(float(wl.arrival_s[i]), _GW_ARRIVE, i, i) for i in range(n)]
    heapq.heapify(ev)
    seq = n
    first = np.full(n, np.nan)
    e_arr = np.full(n, np.nan)
    fin = np.full(n, np.nan)
    idx = {f"r{i}": i for i in range(n)}
    # one runner output for every step: the fixed token of any request that samples
    runner_out = ModelRunnerOutput(sampled_token_ids=dict.fromkeys(idx, -1))
    active, waiters, rejected = 0, deque(), 0
    waiting_samples: list[int] = []
    push = heapq.heappush

    def admit(i: int, t: float) -> None:
        nonlocal seq
        seq += 1
        t_adm = max(t, wl.arrival_s[i] + adm_d[i])
        push(ev, (t_adm + route[i], _ENGINE_ARRIVE, seq, i))

    while ev:
        t, kind, _, x = heapq.heappop(ev)
        if kind == _GW_ARRIVE:
            if active < s.max_concurrency and not waiters:
                active += 1
                admit(x, t)
            elif len(waiters) >= s.max_queue:
                rejected += 1
            else:
                waiters.append(x)
        elif kind == _ENGINE_ARRIVE:
            e = engines[int(wl.replica[x]) % s.replicas]
            e_arr[x] = t
            if wl.prompt_len[x] >= e.max_len:  # the engine refuses it (InvalidRequestError): over the context
                rejected += 1
                active -= 1
                continue
            e.sched.add_request(_request(wl, x))
            if not e.busy:
                e.busy = True
                seq += 1
                push(ev, (t, _STEP_START, seq, e))
        elif kind == _STEP_START:
            e = x
            out = e.sched.schedule()
            feats, e.sched.features = e.sched.features, (0, 0, 0)
            if not out.scheduled:
                e.busy = False
                continue
            dt, gap = draw.step(cost, t, *feats)
            seq += 1
            push(ev, (t + dt, _STEP_END, seq, (e, out, gap)))
        else:
            e, out, gap = x
            for req in e.sched.update_from_output(out, runner_out):
                if len(req.output_token_ids) == 1:
                    first[idx[req.request_id]] = t
                if req.status is not RUNNING and req.is_finished:  # the first test spares most a property call
                    fin[idx[req.request_id]] = t
                    e.sched.pop_finished(req.request_id)
                    active -= 1
                    while waiters and active < s.max_concurrency:
                        active += 1
                        admit(waiters.popleft(), t)
            waiting_samples.append(len(e.sched.waiting))
            seq += 1
            push(ev, (t + gap, _STEP_START, seq, e))  # the loop's gap: pushing outputs, metrics
    res = _result(wl, engines, first + out_first, np.maximum(fin + out_last, first + out_first), waiting_samples,
                  rejected)
    res.engine_s = first - e_arr
    return res


def _request(wl: Workload, i: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=int(wl.output_len[i]), ignore_eos=True)
    return Request(f"r{i}", prompt_tokens(wl, i), params, None, 0)


def _result(wl, engines, first, fin, waiting, rejected) -> Result:
    ttft = first - wl.arrival_s
    e2e = fin - wl.arrival_s
    n_out = wl.output_len.astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n_out >= 2, (e2e - ttft) / (n_out - 1), np.nan)
    queries = sum(e.bm.num_prefix_queries for e in engines)
    hits = sum(e.bm.num_prefix_hits for e in engines)
    fig = figures(ttft=ttft, tpot=tpot, e2e=e2e, itl=tpot, waiting=np.asarray(waiting, float),
                  preemptions=sum(e.sched.num_preemptions for e in engines),
                  prefix_hit_rate=hits / queries if queries else 0.0, rejected=rejected, num_steps=len(waiting))
    return Result(figures=fig, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e)
