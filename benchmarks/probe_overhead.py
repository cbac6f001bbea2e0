"""What probes cost: the same seeded workload under probes off, default, full and rolling.

    python benchmarks/probe_overhead.py [--preset tiny,small | --model DIR] [--requests 480,96]
        [--reps 6] [--levels off,default,rolling] [--push-interval-s 0.5]

Each repetition runs every level once (order rotated), paired overhead ``1 - level / off`` with
its 95 % CI; then one rolling run with every recorder hook timed in place. What each level runs
(a replica's loop and its metrics pushes through a real queue to a child standing for the
gateway) and how the hooks' timing is corrected: benchmarks/README.md.

(Past 450 lines: the paired runs, the replica loop they share and the hooks run are one
measurement, read together.)
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from layerscope.engine.gateway.replica import METRICS_INTERVAL_S
from layerscope.probes.recorder import WORK_GAP_NS

LEVELS = ("off", "default", "full", "rolling", "rolling-every")  # rolling: default probes shipping, drained at
# every push; rolling-every: the same reading the step loop's CPU and wait on every step (work_gap_ns 0, as full
# probes do), against rolling's one step in WORK_GAP_NS: what those reads cost
# two-sided 95% Student t quantiles by degrees of freedom (no scipy here)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def _t95(df: int) -> float:
    return _T95[max(k for k in _T95 if k <= df)] if df < 30 else 1.96 + 2.4 / df


def paired_overhead(level: list[float], off: list[float]) -> tuple[float, float, float, float]:
    """Overhead of ``level`` against ``off`` from paired throughputs (same repetitions):
    (mean, 95% CI half-width, min, max), as fractions (0.01 = 1% fewer tokens/s)."""
    costs = [1 - t / o for t, o in zip(level, off)]
    mean = statistics.fmean(costs)
    half = _t95(len(costs) - 1) * statistics.stdev(costs) / math.sqrt(len(costs)) if len(costs) > 1 else math.nan
    return mean, half, min(costs), max(costs)


def _workload(n: int, vocab: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def _gateway_side(inbox, outbox, trace_dir: str) -> None:
    """A child process standing for the gateway of a serving replica: it receives the replica's drains
    through a ``multiprocessing.Queue`` as the gateway's reader thread does (unpickled here), and on
    ``("end", name)`` does what the gateway then does with them (the replica's Prometheus metrics fed,
    the rolling parts written), timed, and answers (build seconds, drains received)."""
    from prometheus_client import generate_latest

    from layerscope.probes.feed import MetricsFeed
    from layerscope.probes.rolling import RollingBundleWriter

    drains: list = []
    while True:
        msg = inbox.get()
        if msg is None:
            return
        if isinstance(msg, tuple) and msg[0] == "end":
            t = time.perf_counter()
            feed = MetricsFeed(None, "bench", 0, 1, None)
            writer = RollingBundleWriter(Path(trace_dir) / msg[1], probes="default")
            for d in drains:
                feed.feed_drain(d)
                writer.add(None, [d])
            writer.close()
            generate_latest(feed.metrics.registry)
            outbox.put((time.perf_counter() - t, len(drains)))
            drains = []
        elif msg.drain is not None:  # a MetricsSnapshot, as a replica pushes it
            drains.append(msg.drain)


class _Gateway:
    """The gateway side of every level's pushes: a child process fed by a real ``multiprocessing.Queue``,
    the replica's transport (``put`` returns at once; the queue's feeder thread pickles in the
    background, as a replica's outbox does)."""

    def __init__(self, trace_dir: Path):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_gateway_side, args=(self.inbox, self.outbox, str(trace_dir)), daemon=True)
        self.proc.start()
        self.put = self.inbox.put

    def build(self, name: str) -> tuple[float, int]:
        """Every drain put so far fed and written there: (build seconds, drains received)."""
        self.inbox.put(("end", name))
        return self.outbox.get(timeout=600)

    def close(self) -> None:
        self.inbox.put(None)
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def _replica_loop(engine, push_interval_s: float, push) -> None:
    """What a serving replica's loop does after every step, probes on or off (``replica_main``): a
    metrics snapshot pushed to the gateway every ``push_interval_s`` while busy and as the engine goes
    idle (``push()``), on the same check; installed over ``engine.step`` (``del engine.step`` undoes it)."""
    step, busy = type(engine).step.__get__(engine), engine.has_unfinished_requests
    last = [time.monotonic()]

    def stepping():
        outs = step()
        now = time.monotonic()
        if now - last[0] >= push_interval_s or not busy():
            push()
            last[0] = now
        return outs

    engine.step = stepping


def _pusher(gateway: _Gateway, engine, drain=None):
    """A replica's ``snapshot()`` and ``outbox.put``: the engine's stats, with ``drain()`` when the recorder
    ships its records (None: probes off, or an in-process recorder: stats alone)."""
    from layerscope.engine.gateway.messages import MetricsSnapshot

    put, stats = gateway.put, engine.stats
    if drain is None:
        return lambda: put(MetricsSnapshot([], stats()))
    return lambda: put(MetricsSnapshot([], stats(), drain()))


def _run(llm, level: str, prompts, params, trace_dir: Path, interval: int, push_interval_s: float,
         gateway: _Gateway) -> tuple[float, float, float, int, list]:
    """(generate wall s, generate CPU s, table-building s, engine steps, output token ids) of one run."""
    from layerscope.engine.recorder import Recorder
    from layerscope.probes.recorder import ProbeRecorder

    rolling = level.startswith("rolling")
    probes = "default" if rolling else level
    rec = Recorder() if level == "off" else ProbeRecorder(
        probes, model_name="bench", layer_timing_interval=interval, trace_dir=trace_dir / f"{level}-{time.time_ns()}",
        profile_every_steps=64, profile_num_steps=2, ship_records=rolling)
    if level == "rolling-every":
        rec.work_gap_ns = 0
    # rolling: a shipping replica's snapshots carry its drain; off (a replica's recorder has no families
    # then), default and full: the engine's stats alone
    _replica_loop(llm.engine, push_interval_s, _pusher(gateway, llm.engine, rec.drain if rolling else None))
    engine = llm.engine
    engine.recorder = rec
    if level != "off":
        rec.configure(llm.config, engine.resolved)
        rec.start()
    s0 = engine.scheduler.step_id
    gc.collect()  # every run starts from a collected heap (see the note above _HOOKS)
    t0, c0 = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    gen_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    steps = engine.scheduler.step_id - s0
    build_s = 0.0
    if level != "off":
        rec.stop()
        t1 = time.perf_counter()
        if rolling:  # the gateway's side: the replica's metrics fed, the parts written (there)
            build_s, received = gateway.build(f"rolling-{time.time_ns()}")
            if not received:
                raise RuntimeError("rolling: no drain reached the gateway side")
        else:
            rec.tables()
            rec.metrics_text()
            build_s = time.perf_counter() - t1
        rec.shutdown()
    del engine.step
    engine.recorder = Recorder()
    return gen_s, cpu_s, build_s, steps, [o.token_ids for o in outputs]


# Python's full (generation 2) collection scans every object of the process (the model's modules and
# tensors' wrappers included): ~0.3 s on the tiny preset here, i.e. ~10% of a 960-step run, landing in
# whichever run (and hook) allocates when the young generations' counters say so. Each timed run starts
# from gc.collect(), so a full collection is not a matter of the runs' order: measured, a new version's
# hook run met one in 3 of 3 benches and the old one's in 0 of 3, by chance.

_HOOKS = ("should_time_layers", "step_context", "on_request_events", "on_step", "on_collectives",
          "on_request_finished", "drain")


def _time_clock_reads(engine, spent: dict, calls: dict):
    """Time the engine's clock reads (ThreadClock.read) on the thread's CPU clock, into
    spent/calls["clock.read"]; returns the engine's own clock, to put back."""
    clock, spent["clock.read"], calls["clock.read"] = engine._clock, 0, 0

    def cpu_timed_read():
        t = time.thread_time_ns()
        try:
            return clock.read()
        finally:
            spent["clock.read"] += time.thread_time_ns() - t
            calls["clock.read"] += 1

    engine._clock = SimpleNamespace(read=cpu_timed_read)
    return clock


def _hook_time(llm, prompts, params, interval: int, push_interval_s: float,
               gateway: _Gateway) -> tuple[dict[str, float], float, int, float, float, float, float, int]:
    """One rolling run (default probes, drained with every push to the gateway's queue) with every
    recorder hook timed on the wall clock: (seconds per hook and generate seconds, the timing's cost in
    the step loop subtracted; steps; the timing's own cost per call in the step loop and in a loop of
    no-ops (us); the hooks' total with the latter subtracted (s); the engine's StepRecord building (s);
    the engine's clock reads (ThreadClock.read calls)). Free of run-to-run noise; not layer timings, nor GC."""
    from layerscope.engine.recorder import Recorder
    from layerscope.probes.recorder import ProbeRecorder

    rec = ProbeRecorder("default", model_name="bench", layer_timing_interval=interval, ship_records=True)
    spent = dict.fromkeys(_HOOKS, 0)
    calls = dict.fromkeys(_HOOKS, 0)

    def wrap(fn, name):
        def timed(*a, **kw):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter_ns() - t
                calls[name] += 1

        return timed

    # what the timing itself costs per call (two clock reads and the wrapper), subtracted below: a timed
    # no-op called once per step in the step loop, where the hooks run (a loop of them on warm caches
    # measured a fraction of that: the hooks' own figures kept it, up to 3 us a call on a trivial hook)
    spent["timer"] = calls["timer"] = 0
    noop = wrap(lambda: None, "timer")
    for _ in range(2000):
        noop()
    warm_per_call = spent["timer"] / calls["timer"]
    spent["timer"] = calls["timer"] = 0
    for name in _HOOKS:
        setattr(rec, name, wrap(getattr(rec, name), name))
    # the engine's reads of the step loop thread's CPU and wait (ThreadClock.read, four on a step that
    # reads them: one in WORK_GAP_NS), timed on the thread's CPU clock: a read is two syscalls, whose wall
    # time on a loaded machine holds whatever wait lands in them (measured 120 us a read at load 18)
    engine = llm.engine
    clock = _time_clock_reads(engine, spent, calls)
    timed_step = rec.on_step
    # drain() timed; the stats and the queue's put, which a replica makes with probes off too, not
    push = _pusher(gateway, llm.engine, rec.drain)

    built = [0]

    def on_step_draining(step, layer_times):
        # the engine's probe-only work between its step's end (end_ns, on the same monotonic clock) and
        # this call: the per-request columns and the StepRecord itself
        built[0] += time.monotonic_ns() - step.end_ns
        noop()
        timed_step(step, layer_times)

    rec.on_step = on_step_draining
    _replica_loop(engine, push_interval_s, push)
    engine.recorder = rec
    rec.configure(llm.config, engine.resolved)
    rec.start()
    s0 = engine.scheduler.step_id
    gc.collect()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    gen_s = time.perf_counter() - t0
    rec.stop()
    rec.shutdown()
    del engine.step
    engine.recorder, engine._clock = Recorder(), clock
    gateway.build(f"hooks-{time.time_ns()}")
    steps = engine.scheduler.step_id - s0
    per_call = spent.pop("timer") / max(calls.pop("timer"), 1)
    timed_calls = sum(calls.values())
    # the hooks' total with only the warm loop's cost per call subtracted: an upper bound (a hook called
    # outside the step loop, e.g. on_request_events as requests are added, may cost the timing less
    # than the no-op in place did)
    upper = (sum(spent.values()) - timed_calls * warm_per_call) / 1e9
    return ({k: max(v - calls[k] * per_call, 0) / 1e9 for k, v in spent.items()},
            gen_s - (timed_calls + steps) * per_call / 1e9, steps, per_call / 1e3, warm_per_call / 1e3, upper,
            built[0] / 1e9, calls["clock.read"])


def bench_model(model: str, label: str, args, num_requests: int, levels: list[str], tmp: Path) -> None:
    """Run every level ``args.reps`` times on ``model`` (interleaved) and print the figures."""
    from layerscope.engine.llm import LLM
    from layerscope.engine.sampling_params import SamplingParams

    llm = LLM(model=model, num_threads=args.num_threads, max_num_seqs=args.max_num_seqs,
              layer_timing_interval=args.layer_timing_interval)
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    prompts = _workload(num_requests, llm.engine.spec.vocab_size, args.seed, lo, hi)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    num_tokens = num_requests * args.max_tokens
    interval, every = args.layer_timing_interval, args.push_interval_s
    print(f"\n== {label}: {model} ({llm.engine.resolved.num_parameters / 1e6:.1f}M params, "
          f"{llm.engine.resolved.dtype}, {llm.engine.resolved.device}), {num_requests} requests x {args.max_tokens} "
          f"output tokens, prompts {lo}-{hi} tokens, max_num_seqs {args.max_num_seqs}, {args.reps} reps, "
          f"threads {args.num_threads}, layer timing every {interval} steps, a metrics push every {every} s "
          "(rolling: with its drain)",
          flush=True)
    gateway = _Gateway(tmp)  # where every run's metrics pushes go (rolling's with its drains): one child process
    # warm-up: allocator, kineto, caches, and every batch shape the timed runs meet (a warm-up of the
    # first eighth of the prompts left the first timed run 10-15% slower than the rest, whatever its level)
    for level in levels:
        _run(llm, level, prompts, params, tmp, interval, every, gateway)
    from layerscope.engine.warmup import freeze_startup_heap

    # as a serving replica does once warm (engine/warmup.py): the startup heap (torch, the model) out of
    # the full collections' walk, which otherwise land in whichever run allocates at the time (~0.3 s
    # each on tiny, ~10% of a run); every run still starts from a collected heap
    frozen = freeze_startup_heap()
    print(f"startup heap frozen: {frozen} objects", flush=True)

    wall: dict[str, list[float]] = {lv: [] for lv in levels}
    cpu: dict[str, list[float]] = {lv: [] for lv in levels}
    build: dict[str, list[float]] = {lv: [] for lv in levels}
    steps, reference = 0, None
    for rep in range(args.reps):
        order = levels[rep % len(levels):] + levels[: rep % len(levels)]
        for level in order:
            gen_s, cpu_s, build_s, steps, tokens = _run(llm, level, prompts, params, tmp, interval, every, gateway)
            if reference is None:
                reference = tokens
            elif tokens != reference:
                raise RuntimeError(f"{label}: level {level} computed other tokens than the first run (not greedy?)")
            wall[level].append(num_tokens / gen_s)
            cpu[level].append(num_tokens / cpu_s)
            build[level].append(build_s)
        print(f"rep {rep}: " + "  ".join(f"{lv} {wall[lv][-1]:7.1f} tok/s ({cpu[lv][-1]:7.1f}/cpu-s)"
                                          for lv in levels), flush=True)

    _print_levels(levels, wall, cpu, build, steps, num_tokens, args.reps)
    hooks, gen_s, steps, per_call, warm, upper, built, reads = _hook_time(llm, prompts, params, interval, every,
                                                                          gateway)
    _print_hooks(hooks, gen_s, steps, per_call, warm, upper, built, reads)
    gateway.close()
    llm.shutdown()
    gc.unfreeze()  # this process may go on (a test calls main())


def _print_levels(levels, wall: dict, cpu: dict, build: dict, steps: int, num_tokens: int, reps: int) -> None:
    print(f"{steps} engine steps per run, {num_tokens} output tokens per run; overhead = 1 - level/off within "
          f"a rep, mean over {reps} reps ±95% CI (min..max); best = 1 - best level run / best off run")
    print(f"{'level':<13} {'tok/s median':>12} {'overhead (wall)':>28} {'best':>6} {'tok/cpu-s median':>17} "
          f"{'overhead (CPU time)':>28} {'best':>6} {'build_s':>8}")
    for level in levels:
        cells = []
        for series in (wall, cpu):
            if level == "off":
                cells.append(f"{'-':>28} {'-':>6}")
                continue
            m, h, a, b = paired_overhead(series[level], series["off"])
            best = 1 - max(series[level]) / max(series["off"])
            cells.append(f"{m * 100:6.2f}% ±{h * 100:5.2f} ({a * 100:5.1f}..{b * 100:4.1f})".rjust(28)
                         + f" {best * 100:5.1f}%")
        print(f"{level:<13} {statistics.median(wall[level]):12.1f} {cells[0]} {statistics.median(cpu[level]):17.1f} "
              f"{cells[1]} {statistics.median(build[level]):8.3f}", flush=True)
    if "rolling" in levels and "rolling-every" in levels:
        (mw, hw, *_), (mc, hc, *_) = (paired_overhead(series["rolling-every"], series["rolling"])
                                      for series in (wall, cpu))
        print(f"rolling-every against rolling (the step loop's CPU and wait read on every step, not one in "
              f"{WORK_GAP_NS / 1e6:g} ms): {mw * 100:.2f}% ±{hw * 100:.2f} (wall), {mc * 100:.2f}% ±{hc * 100:.2f} "
              "(CPU time)", flush=True)


def _print_hooks(hooks: dict, gen_s: float, steps: int, per_call: float, warm: float, upper: float, built: float,
                 reads: int) -> None:
    total = sum(hooks.values())
    print(f"rolling, hooks timed (wall clock): {total * 1e6 / steps:.1f} us per step in recorder hooks "
          f"(drain included; the snapshot's put, made with probes off too, not) = {total / gen_s * 100:.2f}% of "
          "generate time "
          f"({gen_s * 1e3 / steps:.2f} ms per step); per step: "
          + ", ".join(f"{k} {v * 1e6 / steps:.1f} us" for k, v in hooks.items())
          + f" (clock.read: {hooks['clock.read'] * 1e6 / max(reads, 1):.2f} us of CPU a read, "
          f"{reads / steps:.2f} reads a step)"
          + f"; the timing's own cost subtracted: {per_call:.2f} us a call, measured in the step loop "
          f"(with a loop of no-ops' {warm:.2f} us a call subtracted instead: {upper / gen_s * 100:.2f}%, an upper "
          "bound)", flush=True)
    print(f"rolling, the engine's StepRecord building (its step's end to on_step, probes only): "
          f"{built * 1e6 / steps:.1f} us per step = {built / gen_s * 100:.2f}%; probes on the step loop in all "
          f"(hooks + StepRecord): {(total + built) / gen_s * 100:.2f}% of generate time", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: create each --preset in a temp dir)")
    ap.add_argument("--preset", default="small", help="model preset(s) when --model is not given: tiny, small or "
                    "a comma list (tiny,small), benched one after the other")
    ap.add_argument("--requests", default="48", help="requests per run; a comma list: one per preset")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", default="16:128", help="MIN:MAX prompt tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--levels", default="off,default,full")
    ap.add_argument("--push-interval-s", type=float, default=METRICS_INTERVAL_S,
                    help="every level: a metrics snapshot pushed to the gateway side every S seconds while busy and "
                    "when idle, as a replica does (rolling: with its drain); 0: after every step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--layer-timing-interval", type=int, default=16)
    args = ap.parse_args(argv)
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or "off" not in levels:
        ap.error(f"--levels must include off and only {', '.join(LEVELS)}")
    presets = [None] if args.model else [p.strip() for p in args.preset.split(",") if p.strip()]
    try:
        requests = [int(x) for x in args.requests.split(",")]
    except ValueError:
        ap.error(f"--requests {args.requests!r}: expected an integer or a comma list of integers")
    if len(requests) == 1:
        requests *= len(presets)
    if len(requests) != len(presets):
        ap.error(f"--requests has {len(requests)} values for {len(presets)} presets ({args.preset})")

    from layerscope.engine.models.create import PRESETS, create_model

    tmp = Path(tempfile.mkdtemp(prefix="layerscope-bench-"))
    for preset, n in zip(presets, requests):
        if preset is None:
            bench_model(args.model, Path(args.model).name, args, n, levels, tmp)
            continue
        if preset not in PRESETS:
            ap.error(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        model = str(create_model(tmp / f"model-{preset}", preset=preset, seed=args.seed))
        bench_model(model, preset, args, n, levels, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
