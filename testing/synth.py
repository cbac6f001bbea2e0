"""Synthetic run bundles: a small continuous-batching simulator with one knob per layer.

It writes bundles in the probes schema (manifest.json + Parquet tables) so diagnose
can be tested and benchmarked without the engine: each knob moves time in exactly one
layer (``gateway_delay_s`` -> gateway.queue, ``step_overhead_s`` -> engine.schedule,
``layer_delay_s`` -> model.forward rows, ``kernel_slowdown`` -> kernel.compute,
``launch_gap_s`` -> kernel.launch_gap, ``collective_delay_s`` -> parallel.collective,
``output_delay_s`` -> engine.output, ``router_skew`` -> gateway.route, small
``num_kv_blocks`` -> engine.kv), and the workload knobs move the offered load.

The scheduler mirrors the engine's: running requests first (decodes and prefill
chunks, preempting the newest on KV exhaustion), then waiting ones FCFS within
``max_num_seqs``, the token budget and free KV blocks. Durations in seconds.

Requests carry every stored component (schema version 2), computed by
``probes/breakdown.request_breakdown`` over the simulated tables as the bundle writer does. Scale:
the simulator is a per-step Python loop (~1 s per 1,000 requests here), so a bundle of more than
``segment_requests`` requests simulates one segment of that many and writes the bundle in the
rolling layout (DESIGN.md, "The run bundle"): part k is the segment shifted in time by k segment
spans (request ids, step ids and timestamps renumbered; kernels only in part 1), so 1M requests
take about a minute. The segment's traffic repeats; its components are exact for every copy.

(Over 400 lines: the simulator and the writer of its tables are kept together so one
file shows exactly what each column of a synthetic bundle means.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from layerscope.diagnose.config_diff import CONFIG_DEFAULTS
from layerscope.probes import schema
from layerscope.probes.breakdown import STORED_COLUMNS, memberships, request_breakdown
from layerscope.probes.reader import PART_NAME, frame

ORIGIN_NS = 10**12


@dataclass
class SynthSpec:
    num_requests: int = 200
    seed: int = 0  # the workload (arrivals, lengths)
    noise_seed: int | None = None  # the timing noise; None: same as seed
    # workload
    arrival_rate_per_s: float = 50.0
    burstiness_cv: float = 1.0  # coefficient of variation of inter-arrival times (1 = Poisson)
    prompt_tokens_mean: float = 200.0
    prompt_tokens_cv: float = 0.5
    output_tokens_mean: float = 32.0
    output_tokens_cv: float = 0.5
    prefix_share: float = 0.0  # fraction of requests whose prompt starts with a shared prefix
    prefix_tokens: int = 0
    record_workload_spec: bool = True
    # front end
    gateway: bool = True
    client_net_s: float = 0.0005
    gateway_base_s: float = 0.0002
    gateway_delay_s: float = 0.0  # knob: gateway.queue
    route_s: float = 0.0003
    replicas: int = 1
    router_skew: float = 0.0  # knob: share of traffic sent to replica 0 on top of round robin
    router_policy: str = "round_robin"  # what the manifest's config says (the skew knob routes either way)
    stream_s: float = 0.0002
    # engine config
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int = 4096
    block_size: int = 16
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    tp_size: int = 1
    # step costs
    schedule_base_s: float = 0.0002
    schedule_per_seq_s: float = 0.00001
    step_overhead_s: float = 0.0  # knob: engine.schedule
    prepare_per_token_s: float = 0.000001
    forward_base_s: float = 0.002
    forward_per_token_s: float = 0.00002
    num_layers: int = 4
    layer_delay_s: dict[str, float] = field(default_factory=dict)  # knob: model.forward rows
    kernel_slowdown: float = 1.0  # knob: kernel.compute
    base_gap_s: float = 0.000005
    launch_gap_s: float = 0.0  # knob: kernel.launch_gap (per op)
    hardware_slowdown: float = 1.0
    collective_base_s: float = 0.00005
    collective_delay_s: float = 0.0  # knob: parallel.collective (rank 1's collectives only)
    sample_base_s: float = 0.0001
    sample_per_seq_s: float = 0.000005
    output_base_s: float = 0.0001
    output_per_seq_s: float = 0.00001
    output_delay_s: float = 0.0  # knob: engine.output
    loop_gap_s: float = 0.00005
    # noise
    noise: float = 0.05  # lognormal sigma per phase and step
    run_noise: float = 0.0  # lognormal sigma of one factor on every duration (a busier machine)
    machine_slowdown: float = 1.0  # knob: hardware (every step phase this many times slower)
    # machine evidence (probes/machine.py): None writes none (an older bundle)
    outside_cpu_cores: float | None = None  # other processes' CPU use while the run was recorded
    yardstick_s: float = 0.1  # the fixed yardstick's time (a slower machine: larger)
    yardstick_spike: float = 1.0  # the first timing after the load this many times slower (a slow spell)
    front_wait_share: float | None = None  # the gateway/client process's CPU wait share (None: unmeasured)
    # per-step CPU and run-queue wait of the step loop (steps' cpu_ns, wait_ns, forward_cpu_ns,
    # forward_wait_ns): False writes them null (an older bundle). A busier machine (``machine_slowdown``)
    # shows as wait, more work (every other knob) as CPU time: the knob that tells them apart.
    work_columns: bool = False
    wait_share: float = 0.03  # the step loop's run-queue wait / wall on an unloaded machine
    # probes
    layer_timing_interval: int = 16
    profile_windows: int = 2  # kernel profiler windows of 4 steps each (0: none)
    hardware_name: str = "synthetic-cpu"
    # scale: more requests than this are written as parts, copies of one simulated segment
    segment_requests: int = 25_000


def generate(spec: SynthSpec, out: str | Path, run_id: str | None = None) -> Path:
    """Simulate ``spec`` and write a run bundle at ``out``; returns the path. More than
    ``spec.segment_requests`` requests: one segment simulated, written as parts (module docstring)."""
    if spec.num_requests > spec.segment_requests > 0:
        seg = dataclasses.replace(spec, num_requests=spec.segment_requests)
        return _tile(spec, _simulate_all(seg), out, run_id or f"synth-{spec.seed}")
    return _write(spec, out, run_id or f"synth-{spec.seed}", *_simulate_all(spec))


def _simulate_all(spec: SynthSpec) -> tuple:
    reqs = _make_requests(spec, np.random.default_rng(spec.seed))
    rng = np.random.default_rng(spec.seed if spec.noise_seed is None else spec.noise_seed + 7919)
    run_factor = float(np.exp(rng.normal(0, spec.run_noise))) if spec.run_noise else 1.0
    run_factor *= spec.machine_slowdown
    steps: list[dict[str, Any]] = []
    layer_rows: list[tuple] = []
    kernel_rows: list[tuple] = []
    coll_rows: list[tuple] = []
    step_counter = [0]
    for replica in range(spec.replicas):
        mine = [r for r in reqs if r["replica"] == replica]
        mine.sort(key=lambda r: r["engine_arrival"])
        _simulate(spec, mine, replica, rng, run_factor, steps, layer_rows, kernel_rows, coll_rows, step_counter)
    return reqs, steps, layer_rows, kernel_rows, coll_rows


# ---- workload + front end ------------------------------------------------------------
def _lognormal(rng, mean: float, cv: float, n: int) -> np.ndarray:
    if cv <= 0:
        return np.full(n, mean)
    sigma = math.sqrt(math.log(1 + cv * cv))
    return rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, n)


def _make_requests(spec: SynthSpec, rng) -> list[dict[str, Any]]:
    n = spec.num_requests
    cv = max(spec.burstiness_cv, 1e-3)
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (spec.arrival_rate_per_s * shape), n)
    send = np.cumsum(gaps) - gaps[0]
    prompt = np.maximum(2, np.round(_lognormal(rng, spec.prompt_tokens_mean, spec.prompt_tokens_cv, n))).astype(int)
    output = np.maximum(1, np.round(_lognormal(rng, spec.output_tokens_mean, spec.output_tokens_cv, n))).astype(int)
    shared = rng.random(n) < spec.prefix_share
    reqs = []
    rr = 0
    for i in range(n):
        if spec.replicas > 1 and rng.random() < spec.router_skew:
            replica = 0
        else:
            replica, rr = rr % spec.replicas, rr + 1
        p = int(prompt[i]) + (spec.prefix_tokens if shared[i] else 0)
        if not spec.enable_chunked_prefill:  # the engine refuses prompts longer than one step's budget
            p = min(p, spec.max_num_batched_tokens - int(output[i]) - 1)
        gw_arr = send[i] + spec.client_net_s
        admitted = gw_arr + spec.gateway_base_s + spec.gateway_delay_s if spec.gateway else gw_arr
        arr = admitted + spec.route_s if spec.gateway else gw_arr
        reqs.append(dict(request_id=f"req-{i}", replica=replica, prompt=p, out=int(output[i]), shared=bool(shared[i]),
                         send=send[i], gw_arrival=gw_arr, admitted=admitted, routed=admitted + spec.route_s / 2,
                         engine_arrival=arr, computed=0, generated=0, blocks=0, cached=None, first_sched=None,
                         first_token=None, finished=None, preempted_at=None, preempted_s=0.0, num_preemptions=0,
                         recomputed=0, num_steps=0, chunks=0, preempted=[]))
    return reqs


# ---- engine ----------------------------------------------------------------------------
def _simulate(spec, reqs, replica, rng, run_factor, steps, layer_rows, kernel_rows, coll_rows, counter) -> None:
    # the queues and the free KV blocks, shared by the scheduling helpers below
    q = SimpleNamespace(pending=deque(reqs), waiting=deque(), running=[], free=spec.num_kv_blocks,
                        seen_prefix=False)
    t = reqs[0]["engine_arrival"] if reqs else 0.0
    while q.pending or q.waiting or q.running:
        while q.pending and q.pending[0]["engine_arrival"] <= t:
            q.waiting.append(q.pending.popleft())
        if not q.waiting and not q.running:
            t = q.pending[0]["engine_arrival"]
            continue
        budget = spec.max_num_batched_tokens
        sched, preempted, budget = _schedule_running(spec, q, t, budget)
        q_tokens = hit_tokens = 0
        if not preempted:
            q_tokens, hit_tokens = _admit_waiting(spec, q, t, budget, sched)
        if not sched:
            # nothing runnable (everything waits on KV or the budget): idle until the next arrival
            t = q.pending[0]["engine_arrival"] if q.pending else t + spec.loop_gap_s
            if not q.pending and not q.running:
                raise RuntimeError("synth: a request can never be scheduled (num_kv_blocks too small)")
            continue
        d = _step_timing(spec, sched, rng, run_factor)
        step_id = counter[0]
        counter[0] += 1
        _advance(sched, q, t, t + d.schedule_s + d.prepare_s + d.forward_s + d.sample_s)
        steps.append(_step_row(spec, q, d, sched, step_id, replica, t, preempted, q_tokens, hit_tokens))
        _emit_rows(spec, d, step_id, replica, t, layer_rows, kernel_rows, coll_rows)
        t = t + d.step_s + spec.loop_gap_s


def _schedule_running(spec, q, t: float, budget: int) -> tuple[list, int, int]:
    """The running requests' decodes and prefill chunks, preempting the newest on KV exhaustion:
    (scheduled (request, tokens, is_prefill), preemptions, budget left)."""
    bs = spec.block_size
    sched: list[tuple[dict, int, bool]] = []
    preempted = 0
    for r in list(q.running):
        if r not in q.running:
            continue
        target = r["prompt"] + r["generated"]
        remaining = target - r["computed"]
        is_decode = remaining == 1 and r["generated"] > 0
        n = min(remaining, budget) if (spec.enable_chunked_prefill or remaining <= budget) else 0
        if n <= 0:
            continue
        need = math.ceil((r["computed"] + n) / bs) - r["blocks"]
        while need > q.free and q.running:
            victim = q.running.pop()
            q.free += victim["blocks"]
            victim.update(blocks=0, recomputed=victim["recomputed"] + victim["computed"], computed=0,
                          preempted_at=t, num_preemptions=victim["num_preemptions"] + 1)
            q.waiting.appendleft(victim)
            preempted += 1
            if victim is r:
                break
        if r not in q.running:
            continue
        q.free -= need
        r["blocks"] += need
        budget -= n
        sched.append((r, n, not is_decode))
    return sched, preempted, budget


def _admit_waiting(spec, q, t: float, budget: int, sched: list) -> tuple[int, int]:
    """Waiting requests FCFS within max_num_seqs, the token budget and free KV blocks, appended to
    ``sched``: (prefix-cache query tokens, hit tokens)."""
    bs = spec.block_size
    q_tokens = hit_tokens = 0
    while q.waiting and len(q.running) < spec.max_num_seqs and budget > 0:
        r = q.waiting[0]
        if r["cached"] is None:
            cached = 0
            if spec.enable_prefix_caching and r["shared"]:
                if q.seen_prefix:
                    cached = (min(spec.prefix_tokens, r["prompt"] - 1) // bs) * bs
                q.seen_prefix = True
            start = cached
        else:
            cached, start = r["cached"], 0
        target = r["prompt"] + r["generated"]
        remaining = target - start
        if not spec.enable_chunked_prefill and remaining > budget:
            break
        n = min(remaining, budget)
        need = math.ceil((start + n) / bs)
        if need > q.free:
            break
        q.waiting.popleft()
        if r["cached"] is None:
            q_tokens += r["prompt"]
            hit_tokens += cached
            r["cached"] = cached
        if r["preempted_at"] is not None:
            r["preempted_s"] += t - r["preempted_at"]
            r["preempted"].append((r["preempted_at"], t))
            r["preempted_at"] = None
        r["computed"] = start
        q.free -= need
        r["blocks"] = need
        budget -= n
        q.running.append(r)
        sched.append((r, n, True))
    return q_tokens, hit_tokens


def _step_timing(spec, sched: list, rng, run_factor: float) -> SimpleNamespace:
    """One step's phase durations; the noise draws from ``rng`` stay in this order (a bundle of a
    given seed is the same bytes)."""
    nl = spec.num_layers

    def jit() -> float:
        return run_factor * (float(np.exp(rng.normal(0, spec.noise))) if spec.noise else 1.0)

    d = SimpleNamespace(n_ops=10 * nl + 3, n_seqs=len(sched), tokens=sum(n for _, n, _ in sched))
    d.p_seqs = sum(1 for _, _, p in sched if p)
    d.p_tokens = sum(n for _, n, p in sched if p)
    d.schedule_s = (spec.schedule_base_s + spec.schedule_per_seq_s * d.n_seqs) * jit() + spec.step_overhead_s
    d.prepare_s = spec.prepare_per_token_s * d.tokens * jit()
    d.compute_s = ((spec.forward_base_s + spec.forward_per_token_s * d.tokens) * spec.hardware_slowdown
                   * spec.kernel_slowdown * jit())
    d.gaps_s = (d.n_ops - 1) * (spec.base_gap_s * jit() + spec.launch_gap_s)
    delay_s = sum(spec.layer_delay_s.values())
    d.coll_one = spec.collective_base_s * jit()
    d.collective_s = 2 * nl * (d.coll_one + spec.collective_delay_s) if spec.tp_size > 1 else 0.0
    d.forward_s = d.compute_s + d.gaps_s + delay_s + d.collective_s
    d.sample_s = (spec.sample_base_s + spec.sample_per_seq_s * d.n_seqs) * jit()
    d.output_s = (spec.output_base_s + spec.output_per_seq_s * d.n_seqs) * jit() + spec.output_delay_s
    d.step_s = d.schedule_s + d.prepare_s + d.forward_s + d.sample_s + d.output_s
    return d


def _advance(sched: list, q, t: float, t_sample: float) -> None:
    """The scheduled requests' progress after the step: tokens computed, first and last tokens,
    finished requests leave the batch and free their blocks."""
    for r, n, is_prefill in sched:
        r["computed"] += n
        r["num_steps"] += 1
        r["chunks"] += 1 if is_prefill and r["first_token"] is None else 0
        if r["first_sched"] is None:
            r["first_sched"] = t
        if r["computed"] == r["prompt"] + r["generated"]:
            r["generated"] += 1
            if r["first_token"] is None:
                r["first_token"] = t_sample
            if r["generated"] >= r["out"]:
                r["finished"] = t_sample
                q.running.remove(r)
                q.free += r["blocks"]
                r["blocks"] = 0


def _step_row(spec, q, d, sched, step_id, replica, t, preempted, q_tokens, hit_tokens) -> dict[str, Any]:
    # a busier machine stretches the step by waiting for a CPU: x machine_slowdown from the quiet share
    # (no draw from ``rng``: the columns must not move any other timing of a bundle)
    waited = max(0.0, 1 - (1 - spec.wait_share) / spec.machine_slowdown)
    return dict(step_id=step_id, replica=replica, start=t, end=t + d.step_s, schedule_s=d.schedule_s,
                wait_s=waited * d.step_s, forward_wait_s=waited * d.forward_s,
                prepare_s=d.prepare_s, forward_s=d.forward_s, sample_s=d.sample_s, output_s=d.output_s,
                step_s=d.step_s, num_prefill_seqs=d.p_seqs, num_prefill_tokens=d.p_tokens,
                num_decode_seqs=d.n_seqs - d.p_seqs, num_decode_tokens=d.tokens - d.p_tokens,
                num_batched_tokens=d.tokens, num_running=len(q.running), num_waiting=len(q.waiting),
                num_kv_blocks_free=q.free, num_kv_blocks_total=spec.num_kv_blocks,
                num_preemptions=preempted, num_prefix_queries=q_tokens, num_prefix_hits=hit_tokens,
                collective_s=d.collective_s if spec.tp_size > 1 else None,
                request_ids=[r["request_id"] for r, _, _ in sched],
                request_num_tokens=[n for _, n, _ in sched])


def _emit_rows(spec, d, step_id, replica, t, layer_rows, kernel_rows, coll_rows) -> None:
    """The step's sampled layer rows, its kernels inside a profiler window and its collectives."""
    nl = spec.num_layers
    base = d.compute_s + d.gaps_s
    if spec.layer_timing_interval and step_id % spec.layer_timing_interval == 0:
        rows = [("embed", 0.02 * base)]
        for i in range(nl):
            coll = d.coll_one + spec.collective_delay_s if spec.tp_size > 1 else 0.0
            rows.append((f"layers.{i}.attn", 0.45 / nl * base + coll))
            rows.append((f"layers.{i}.mlp", 0.45 / nl * base + coll))
        rows += [("norm", 0.01 * base), ("lm_head", 0.07 * base)]
        rows = [(name, x + spec.layer_delay_s.get(name, 0.0)) for name, x in rows] + [("sampler", d.sample_s)]
        layer_rows += [(step_id, replica, name, x) for name, x in rows]
    if spec.profile_windows and step_id % 50 < 4 and step_id // 50 < spec.profile_windows:
        _kernels(spec, step_id, replica, t + d.schedule_s + d.prepare_s, d.compute_s, d.gaps_s, d.n_ops, kernel_rows)
    if spec.tp_size > 1:
        t_c = t + d.schedule_s + d.prepare_s
        for i in range(nl):
            for op_name in (f"layers.{i}.attn", f"layers.{i}.mlp"):
                for rank in range(spec.tp_size):
                    wait = spec.collective_delay_s if rank == 0 else 0.0
                    coll_rows.append((step_id, replica, rank, "all_reduce", op_name, d.tokens * 4096,
                                      int(round(t_c * 1e9)), d.coll_one + wait, wait))


_OPS = ("rms_norm", "qkv_proj", "rotary", "kv_write", "paged_attention", "o_proj", "rms_norm", "gate_up_proj",
        "silu_mul", "down_proj")
_OP_WEIGHTS = (0.02, 0.2, 0.02, 0.02, 0.2, 0.1, 0.02, 0.25, 0.02, 0.15)


def _kernels(spec, step_id, replica, t0, compute_s, gaps_s, n_ops, rows) -> None:
    names = ["embedding"] + [f"{op}" for _ in range(spec.num_layers) for op in _OPS] + ["rms_norm", "lm_head"]
    w = np.array([0.02] + list(_OP_WEIGHTS) * spec.num_layers + [0.01, 0.07])
    dur = compute_s * w / w.sum()
    gap = gaps_s / (n_ops - 1)
    # an injected layer delay sleeps after the row's last op: the device idles before the next one
    extra = np.zeros(len(names) + 1)
    for row, delay in spec.layer_delay_s.items():
        last = {"embed": 0, "norm": len(names) - 2, "lm_head": len(names) - 1}.get(row)
        if row.startswith("layers."):
            _, i, kind = row.split(".")
            last = 1 + 10 * int(i) + (5 if kind == "attn" else 9)
        if last is not None:
            extra[min(last + 1, len(names) - 1)] += delay
    t = t0
    for i, name in enumerate(names):
        g = None if i == 0 else gap + extra[i]
        t += g or 0.0
        cat = "memory" if name in ("kv_write", "embedding") else "compute"
        rows.append((step_id // 50, step_id, replica, name, cat, int(round(t * 1e9)), float(dur[i]), g))
        t += dur[i]


# ---- writing -----------------------------------------------------------------------------
def _ns(x: float | None) -> int | None:
    return None if x is None else ORIGIN_NS + int(round(x * 1e9))


def _write(spec, out, run_id, reqs, steps, layer_rows, kernel_rows, coll_rows) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, table in _tables(spec, reqs, steps, layer_rows, kernel_rows, coll_rows).items():
        pq.write_table(table, out / f"{name}.parquet")
    ends = [r["finished"] for r in reqs if r["finished"] is not None]
    _write_manifest(spec, out, run_id, len(reqs), _ns(max(ends) if ends else 0.0))
    return out


def _tables(spec, reqs, steps, layer_rows, kernel_rows, coll_rows) -> dict[str, pa.Table]:
    gw = spec.gateway
    rq: dict[str, list] = {f.name: [] for f in schema.REQUESTS}
    for r in reqs:
        stream = spec.stream_s if gw else 0.0
        first = r["first_token"] + stream if r["first_token"] is not None else None
        done = r["finished"] + stream if r["finished"] is not None else None
        start = r["gw_arrival"] if gw else r["engine_arrival"]
        ttft = first - start
        e2e = done - start
        vals = dict(
            request_id=r["request_id"], replica=r["replica"], status="finished_length", finish_reason="length",
            error=None, http_status=200 if gw else None, num_prompt_tokens=r["prompt"],
            num_cached_tokens=r["cached"] or 0, num_output_tokens=r["generated"],
            num_preemptions=r["num_preemptions"], num_recomputed_tokens=r["recomputed"], num_steps=r["num_steps"],
            num_prefill_chunks=r["chunks"], client_send_ns=_ns(r["send"]) if gw else None,
            gateway_arrival_ns=_ns(r["gw_arrival"]) if gw else None, gateway_admitted_ns=_ns(r["admitted"]) if gw else None,
            gateway_routed_ns=_ns(r["routed"]) if gw else None, engine_arrival_ns=_ns(r["engine_arrival"]),
            engine_scheduled_ns=_ns(r["first_sched"]), engine_first_token_ns=_ns(r["first_token"]),
            engine_finished_ns=_ns(r["finished"]), gateway_first_token_ns=_ns(first) if gw else None,
            gateway_finished_ns=_ns(done) if gw else None,
            client_first_token_ns=_ns(first + spec.client_net_s) if gw else None,
            client_done_ns=_ns(done + spec.client_net_s) if gw else None,
            ttft_s=ttft, tpot_s=(e2e - ttft) / (r["generated"] - 1) if r["generated"] > 1 else None, e2e_s=e2e,
            itl_mean_s=(e2e - ttft) / (r["generated"] - 1) if r["generated"] > 1 else None, itl_max_s=None,
            client_ttft_s=ttft + 2 * spec.client_net_s if gw else None,
            client_tpot_s=(e2e - ttft) / (r["generated"] - 1) if gw and r["generated"] > 1 else None,
            client_e2e_s=e2e + 2 * spec.client_net_s if gw else None,
            preempted_s=r["preempted_s"], trace_id=None)
        for f in schema.REQUESTS:
            rq[f.name].append(vals.get(f.name))
    requests = pa.Table.from_pydict(rq, schema=schema.REQUESTS)
    st = {f.name: [s.get(f.name) for s in steps] for f in schema.STEPS}
    st["start_ns"] = [_ns(s["start"]) for s in steps]
    st["end_ns"] = [_ns(s["end"]) for s in steps]
    steps_t = pa.Table.from_pydict(st, schema=schema.STEPS)
    steps_t = _with_work(spec, steps, steps_t)
    kernel_rows = [(w, s, rep, n, c, ORIGIN_NS + t, d, g) for (w, s, rep, n, c, t, d, g) in kernel_rows]
    coll_rows = [(s, rep, rank, op, n, b, ORIGIN_NS + t, d, w) for (s, rep, rank, op, n, b, t, d, w) in coll_rows]
    spans = [(None, f"kv-{r['request_id']}-{i}", None, "preempted", "engine.kv", r["request_id"], _ns(p0), _ns(p1),
              "{}") for r in reqs for i, (p0, p1) in enumerate(r["preempted"])]
    spans_t = _rows_table(schema.SPANS, spans)
    return {"requests": _with_components(requests, steps_t, spans_t), "steps": steps_t,
            "layers": _rows_table(schema.LAYER_TIMES, layer_rows), "kernels": _rows_table(schema.KERNELS, kernel_rows),
            "collectives": _rows_table(schema.COLLECTIVES, coll_rows), "spans": spans_t}


WORK_COLUMNS = ("cpu_ns", "wait_ns", "forward_cpu_ns", "forward_wait_ns")


def _with_work(spec: SynthSpec, steps: list[dict], table: pa.Table) -> pa.Table:
    """``table`` with the step loop's CPU and wait columns (int64 ns; null unless ``spec.work_columns``),
    set where the schema has them, appended where it does not yet."""
    def ns(key: str, minus: str | None = None) -> pa.Array:
        if not spec.work_columns:
            return pa.nulls(len(steps), pa.int64())
        vals = [s[key] - (s[minus] if minus else 0.0) for s in steps]
        return pa.array([int(round(v * 1e9)) for v in vals], pa.int64())

    cols = {"cpu_ns": ns("step_s", "wait_s"), "wait_ns": ns("wait_s"),
            "forward_cpu_ns": ns("forward_s", "forward_wait_s"), "forward_wait_ns": ns("forward_wait_s")}
    for name, arr in cols.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, arr) if i >= 0 else table.append_column(name, arr)
    return table


def _with_components(requests: pa.Table, steps: pa.Table, spans: pa.Table) -> pa.Table:
    """``requests`` with every stored component (STORED_COLUMNS), as the bundle writer computes them."""
    rq = frame(requests)
    tables = SimpleNamespace(requests=rq, steps=frame(steps, skip=("request_ids", "request_num_tokens")),
                             spans=frame(spans), memberships=memberships(steps, rq["request_id"].to_numpy()))
    bd = request_breakdown(tables)
    for c in STORED_COLUMNS:
        f = schema.REQUESTS.field(c)
        requests = requests.set_column(requests.schema.get_field_index(c), f,
                                       pa.array(bd[c].to_numpy(), type=f.type, from_pandas=True))
    return requests


def _write_manifest(spec, out: Path, run_id: str, num_requests: int, end_ns: int, **extra: Any) -> None:
    config = dict(CONFIG_DEFAULTS, max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                  num_kv_blocks=spec.num_kv_blocks, block_size=spec.block_size,
                  enable_chunked_prefill=spec.enable_chunked_prefill,
                  enable_prefix_caching=spec.enable_prefix_caching, tp_size=spec.tp_size,
                  layer_timing_interval=spec.layer_timing_interval, router_policy=spec.router_policy,
                  model="synthetic")
    nested = {k: v for k, v in config.items() if not k.startswith("gateway.")}
    nested["gateway"] = {k.split(".", 1)[1]: v for k, v in config.items() if k.startswith("gateway.")}
    argv = ["layerscope", "run", "--model", "synthetic", "--workload", "synth", "--out", str(out)]
    for k, v in config.items():
        if v != CONFIG_DEFAULTS[k] and k not in ("model", "tp_size"):
            argv += ["--set", f"{k}={v}"]
    if spec.tp_size > 1:
        argv += ["--tp", str(spec.tp_size)]
    workload = {"name": "synth", "seed": spec.seed, "num_requests": spec.num_requests,
                "arrival_rate_per_s": spec.arrival_rate_per_s, "burstiness_cv": spec.burstiness_cv,
                "prompt_tokens_mean": spec.prompt_tokens_mean, "output_tokens_mean": spec.output_tokens_mean,
                "prefix_share": spec.prefix_share, "prefix_tokens": spec.prefix_tokens} if spec.record_workload_spec else {}
    manifest = {
        "format": schema.BUNDLE_FORMAT, "schema_version": schema.SCHEMA_VERSION, "run_id": run_id, "command": argv,
        "config": nested,
        "resolved": {"architecture": "LlamaForCausalLM", "dtype": "float32", "device": "cpu",
                     "kernel_backend": "torch", "num_kv_blocks": spec.num_kv_blocks, "block_size": spec.block_size,
                     "num_layers": spec.num_layers},
        "workload": workload,
        # what the simulator was told; diagnose must never read it
        "faults": {"synth": {k: v for k, v in dataclasses.asdict(spec).items() if k.endswith(("_delay_s", "_skew",
                                                                                          "slowdown", "_gap_s"))}},
        "versions": {"layerscope": "0.1.0", "git_rev": "synthetic", "python": "3.11", "torch": None},
        "hardware": {"cpu": spec.hardware_name, "cores": 2, "gpu": None},
        "probes": "default",
        "start_ns": ORIGIN_NS, "end_ns": end_ns, "start_time": "1970-01-01T00:00:00+00:00",
        "summary": {"requests": num_requests}, **extra,
    }
    (out / "metrics.prom").write_text("")
    (out / "traces").mkdir(exist_ok=True)
    if spec.outside_cpu_cores is not None:
        manifest["machine"] = _machine(spec, out, manifest["end_ns"] - ORIGIN_NS)
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")


def _machine(spec: SynthSpec, out: Path, duration_ns: int) -> dict[str, Any]:
    """machine.parquet samples (every 0.25 s) and the manifest's machine section, from the knobs."""
    rng = np.random.default_rng((spec.noise_seed if spec.noise_seed is not None else spec.seed) + 31)
    n = max(int(duration_ns / 0.25e9), 8)
    outside = np.clip(spec.outside_cpu_cores + rng.normal(0, 0.08, n), 0, 2)
    run = np.clip(0.8 + rng.normal(0, 0.1, n), 0, 2)
    cols = {"t_ns": ORIGIN_NS + (np.arange(n) + 1) * 250_000_000, "interval_s": np.full(n, 0.25),
            "cpu_busy_cores": outside + run, "run_cpu_cores": run, "outside_cpu_cores": outside,
            "run_wait_cores": np.clip(0.5 * outside * run + rng.normal(0, 0.02, n), 0, None),
            "steal_cores": np.zeros(n), "load_1m": outside + run, "cpu_freq_mhz": np.full(n, 2600.0)}
    for c in ("gpu_util_pct", "gpu_other_procs", "gpu_other_memory_bytes"):
        cols[c] = np.full(n, np.nan)
    front = spec.front_wait_share
    cols["front_cpu_cores"] = np.full(n, 0.3)
    cols["front_wait_cores"] = np.full(n, np.nan if front is None else 0.3 * front / (1 - front))
    pq.write_table(pa.Table.from_pydict(cols, schema=schema.MACHINE), out / "machine.parquet")
    ys = (spec.yardstick_s * np.exp(rng.normal(0, 0.02, 6))).tolist()
    ys[3] *= spec.yardstick_spike
    return {"sample_interval_s": 0.25, "num_samples": n, "cpus_usable": 2,
            "yardstick": {"work": "synthetic", "before_s": ys[:3], "after_s": ys[3:], "median_s": float(np.median(ys))},
            "outside_cpu_cores_mean": float(outside.mean()), "outside_cpu_cores_p90": float(np.quantile(outside, 0.9)),
            "run_cpu_cores_mean": float(run.mean()), "steal_cores_mean": 0.0, "load_1m_mean": float((outside + run).mean()),
            "cpu_freq_mhz_mean": 2600.0, "gpu_util_pct_mean": None, "gpu_other_procs_max": None,
            "front_wait_share": front}


def _rows_table(sch: pa.Schema, rows: list[tuple]) -> pa.Table:
    cols = list(zip(*rows)) if rows else [[] for _ in sch]
    return pa.Table.from_arrays([pa.array(list(c), type=f.type) for c, f in zip(cols, sch)], schema=sch)


# ---- tiling: a large bundle as parts, copies of one simulated segment ---------------------------------
_NS_COLS = {name: [f.name for f in sch if f.name.endswith("_ns")] for name, sch in schema.TABLES.items()}


def write_part(out: Path, name: str, index: int, table: pa.Table) -> None:
    """Part ``index`` of table ``name`` in the rolling layout (temp file, then renamed)."""
    d = out / f"{name}.parquet"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{PART_NAME.format(index)}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, d / PART_NAME.format(index))


def _tile(spec: SynthSpec, sim: tuple, out, run_id: str) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tables = _tables(spec, *sim)
    req = tables["requests"]
    n_seg = req.num_rows
    ends = [c for c in ("client_done_ns", "gateway_finished_ns", "engine_finished_ns") if req.column(c).null_count < n_seg]
    span = int(pc.max(req.column(ends[0])).as_py()) - ORIGIN_NS + 10**6
    n_steps = tables["steps"].num_rows
    seg_ids = req.column("request_id").to_pylist()
    seg_pos = {r: i for i, r in enumerate(seg_ids)}
    flat = tables["steps"].column("request_ids").combine_chunks()
    flat_pos = np.array([seg_pos[x] for x in flat.flatten().to_pylist()], np.int64)
    span_pos = np.array([seg_pos.get(x, 0) for x in tables["spans"].column("request_id").to_pylist()], np.int64)
    parts = math.ceil(spec.num_requests / n_seg)
    end_ns = ORIGIN_NS
    for k in range(parts):
        keep = min(n_seg, spec.num_requests - k * n_seg)
        ids = pa.array([f"req-{i}" for i in range(k * n_seg, k * n_seg + n_seg)], pa.string())
        for name, t in tables.items():
            if name == "kernels" and k:
                continue  # the profiler's windows are at the start of the run
            t = _shift(t, name, k * span, k * n_steps)
            if name == "requests":
                t = t.set_column(0, "request_id", ids).slice(0, keep)
                end_ns = max(end_ns, max(int(pc.max(t.column(c)).as_py() or 0) for c in ends))
            elif name == "steps":
                lists = pa.ListArray.from_arrays(flat.offsets, ids.take(pa.array(flat_pos)))
                t = t.set_column(t.schema.get_field_index("request_ids"), "request_ids", lists)
            elif name == "spans" and t.num_rows:
                t = t.set_column(t.schema.get_field_index("request_id"), "request_id", ids.take(pa.array(span_pos)))
            write_part(out, name, k + 1, t)
        _write_manifest(spec, out, run_id, min((k + 1) * n_seg, spec.num_requests), end_ns, parts=k + 1,
                        complete=k + 1 == parts)
    return out


def _shift(t: pa.Table, name: str, dt_ns: int, dstep: int) -> pa.Table:
    if not dt_ns and not dstep:
        return t
    for c in _NS_COLS[name] + (["step_id"] if dstep and "step_id" in t.column_names else []):
        i = t.schema.get_field_index(c)
        t = t.set_column(i, t.schema.field(i), pc.add(t.column(i), dt_ns if c != "step_id" else dstep))
    return t
