"""What probes cost: the same seeded workload under probes off, default and full (and rolling).

    python -m layerscope.probes.bench_overhead [--model DIR | --preset small] [--reps 5]
        [--levels off,default,rolling] [--drain-every-steps 256]

"rolling" is default probes drained for a rolling bundle every --drain-every-steps steps,
the drains inside the timed region (a serving replica pays them on its engine thread).

One engine; each repetition runs every level once, in an order rotated per
repetition, with a fresh recorder per run (so nothing accumulates across runs), and
levels are compared within a repetition (the ratio of two runs seconds apart), which
cancels most machine noise. Timed: ``generate`` only. Full's py-spy start/stop and
every level's table building (``tables()``, reported as build_s) are outside it.
Greedy sampling with ignore_eos: every run computes exactly the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

LEVELS = ("off", "default", "full", "rolling")  # rolling: default + drain() every --drain-every-steps steps


def _workload(n: int, vocab: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def _run(llm, level: str, prompts, params, trace_dir: Path, interval: int,
         drain_every: int = 256) -> tuple[float, float, float, int]:
    """(generate wall seconds, generate CPU seconds, table-building seconds, engine steps) of one run.

    "rolling": default probes whose recorder is drained every ``drain_every`` steps inside the
    timed region (what a serving replica's engine thread pays for the rolling bundle); the
    bundle parts are written from the drains after it (another process does that when serving)."""
    from layerscope.engine.recorder import Recorder
    from layerscope.probes.recorder import ProbeRecorder

    probes = "default" if level == "rolling" else level
    rec = Recorder() if level == "off" else ProbeRecorder(
        probes, model_name="bench", layer_timing_interval=interval, trace_dir=trace_dir / f"{level}-{time.time_ns()}",
        profile_every_steps=64, profile_num_steps=2)
    drains: list = []
    if level == "rolling":
        on_step = rec.on_step

        def on_step_draining(step, layer_times):
            on_step(step, layer_times)
            if step.step_id % drain_every == 0:
                drains.append(rec.drain())

        rec.on_step = on_step_draining
    engine = llm.engine
    engine.recorder = rec
    if level != "off":
        rec.configure(llm.config, engine.resolved)
        rec.start()
    s0 = engine.scheduler.step_id
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate(prompts, params)
    gen_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    steps = engine.scheduler.step_id - s0
    build_s = 0.0
    if level != "off":
        rec.stop()
        t1 = time.perf_counter()
        if level == "rolling":
            from layerscope.probes.rolling import RollingBundleWriter

            drains.append(rec.drain())
            writer = RollingBundleWriter(trace_dir / f"rolling-{time.time_ns()}", probes="default")
            for d in drains:
                writer.add(None, [d])
            writer.close()
        else:
            rec.tables()
        rec.metrics_text()
        build_s = time.perf_counter() - t1
        rec.shutdown()
    engine.recorder = Recorder()
    return gen_s, cpu_s, build_s, steps


_HOOKS = ("should_time_layers", "step_context", "on_request_events", "on_step", "on_collectives",
          "on_request_finished")


def _hook_time(llm, prompts, params, interval: int) -> tuple[dict[str, float], float, int]:
    """One default-level run with every recorder hook timed: (CPU seconds per hook, generate CPU seconds, steps).

    A direct measure of what the step loop pays the recorder, free of run-to-run noise
    (it leaves out the engine-side cost of building StepRecords and the sampled layer timings)."""
    from layerscope.probes.recorder import ProbeRecorder

    rec = ProbeRecorder("default", model_name="bench", layer_timing_interval=interval)
    spent = dict.fromkeys(_HOOKS, 0)
    calls = dict.fromkeys(_HOOKS, 0)

    def wrap(fn, name):
        def timed(*a, **kw):
            t = time.thread_time_ns()  # CPU time: the OS descheduling us mid-hook is not the hook's cost
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.thread_time_ns() - t
                calls[name] += 1

        return timed

    # what the timing itself costs per call (two clock reads), subtracted below
    probe = wrap(lambda: None, "on_collectives")
    for _ in range(2000):
        probe()
    per_call = spent["on_collectives"] / calls["on_collectives"]
    spent["on_collectives"] = calls["on_collectives"] = 0
    for name in _HOOKS:
        setattr(rec, name, wrap(getattr(rec, name), name))
    engine = llm.engine
    engine.recorder = rec
    rec.configure(llm.config, engine.resolved)
    rec.start()
    s0 = engine.scheduler.step_id
    t0 = time.thread_time()
    llm.generate(prompts, params)
    gen_s = time.thread_time() - t0
    rec.stop()
    rec.shutdown()
    from layerscope.engine.recorder import Recorder

    engine.recorder = Recorder()
    return ({k: max(v - calls[k] * per_call, 0) / 1e9 for k, v in spent.items()}, gen_s - sum(calls.values()) * per_call / 1e9,
            engine.scheduler.step_id - s0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: create --preset in a temp dir)")
    ap.add_argument("--preset", default="small", help="model preset when --model is not given (tiny, small)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", default="16:128", help="MIN:MAX prompt tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--levels", default="off,default,full")
    ap.add_argument("--drain-every-steps", type=int, default=256, help="rolling: drain() every N engine steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--layer-timing-interval", type=int, default=16)
    args = ap.parse_args(argv)
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or "off" not in levels:
        ap.error(f"--levels must include off and only {', '.join(LEVELS)}")

    from layerscope.engine.llm import LLM
    from layerscope.engine.sampling_params import SamplingParams

    tmp = Path(tempfile.mkdtemp(prefix="layerscope-bench-"))
    model = args.model
    if model is None:
        from layerscope.engine.models.create import create_model

        model = str(create_model(tmp / f"model-{args.preset}", preset=args.preset, seed=args.seed))
    llm = LLM(model=model, num_threads=args.num_threads, max_num_seqs=args.max_num_seqs,
              layer_timing_interval=args.layer_timing_interval)
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    prompts = _workload(args.requests, llm.engine.spec.vocab_size, args.seed, lo, hi)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    num_tokens = args.requests * args.max_tokens
    print(f"model {model} ({llm.engine.resolved.num_parameters / 1e6:.1f}M params, {llm.engine.resolved.device}), "
          f"{args.requests} requests x {args.max_tokens} output tokens, prompts {lo}-{hi} tokens, "
          f"{args.reps} reps, threads {args.num_threads}")
    for level in levels:  # warm-up: allocator, kineto, caches
        _run(llm, level, prompts[: max(4, args.requests // 8)], params, tmp, args.layer_timing_interval,
             args.drain_every_steps)

    wall: dict[str, list[float]] = {lv: [] for lv in levels}
    cpu: dict[str, list[float]] = {lv: [] for lv in levels}
    build: dict[str, list[float]] = {lv: [] for lv in levels}
    steps = 0
    for rep in range(args.reps):
        order = levels[rep % len(levels):] + levels[: rep % len(levels)]
        for level in order:
            gen_s, cpu_s, build_s, steps = _run(llm, level, prompts, params, tmp, args.layer_timing_interval,
                                                args.drain_every_steps)
            wall[level].append(num_tokens / gen_s)
            cpu[level].append(num_tokens / cpu_s)
            build[level].append(build_s)
        print(f"rep {rep}: " + "  ".join(f"{lv} {wall[lv][-1]:7.1f} tok/s ({cpu[lv][-1]:7.1f}/cpu-s)"
                                          for lv in levels), flush=True)

    print(f"\n{steps} engine steps per run, {num_tokens} output tokens per run; "
          "cost = 1 - median over reps of (level / off) within the rep")
    print(f"{'level':<8} {'tok/s (median)':>15} {'cost':>8} {'tok/cpu-s (median)':>19} {'cost':>8} "
          f"{'build_s':>8}")
    for level in levels:
        r_wall = statistics.median(t / o for t, o in zip(wall[level], wall["off"]))
        r_cpu = statistics.median(t / o for t, o in zip(cpu[level], cpu["off"]))
        print(f"{level:<8} {statistics.median(wall[level]):15.1f} {(1 - r_wall) * 100:7.2f}% "
              f"{statistics.median(cpu[level]):19.1f} {(1 - r_cpu) * 100:7.2f}% {statistics.median(build[level]):8.3f}")
    hooks, gen_s, steps = _hook_time(llm, prompts, params, args.layer_timing_interval)
    total = sum(hooks.values())
    print(f"\ndefault, hooks timed (thread CPU time): {total * 1e6 / steps:.1f} us per step in recorder hooks = "
          f"{total / gen_s * 100:.2f}% of generate CPU time ({gen_s * 1e3 / steps:.2f} ms per step); per step: "
          + ", ".join(f"{k} {v * 1e6 / steps:.1f} us" for k, v in hooks.items()))
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
