"""The step loop's work and wait (steps.parquet cpu_ns .. forward_wait_ns) and StepRecord's alignment:
the engine's record tuple names every field in StepRecord's order, and a real run's values obey the
arithmetic wall = cpu + wait + off-CPU; a CPU hog on the engine thread's core shows up as wait."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

from layerscope.engine.llm_engine import LLMEngine
from layerscope.engine.recorder import StepRecord
from layerscope.probes import schema
from layerscope.probes.reader import read_bundle
from layerscope.probes.recorder import WORK_GAP_NS

from .conftest import ENGINE, params, prompts


def _record_tuple() -> ast.Tuple:
    tree = ast.parse(textwrap.dedent(inspect.getsource(LLMEngine.step)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "_new_step"]
    assert len(calls) == 1, "LLMEngine.step builds its StepRecord in one _new_step(StepRecord, (...)) call"
    assert isinstance(calls[0].args[0], ast.Name) and calls[0].args[0].id == "StepRecord"
    return calls[0].args[1]


def test_the_engine_names_every_step_field_in_order():
    """A field added to StepRecord (or moved) without the engine's tuple following fails here: the
    tuple holds only names, each the field's own, in ``_fields`` order (tuple.__new__ takes them
    positionally and fills no defaults)."""
    names = [e.id if isinstance(e, ast.Name) else ast.dump(e) for e in _record_tuple().elts]
    assert names == list(StepRecord._fields)


def test_the_misalignment_check_can_fail():
    moved = list(StepRecord._fields)
    moved[1], moved[2] = moved[2], moved[1]
    names = [e.id for e in _record_tuple().elts]
    assert names != moved and len(names) == len(moved)


def test_steps_carry_the_loop_threads_work_and_wait(default_run):
    every = read_bundle(default_run.bundle).table("steps").to_pylist()
    steps = [s for s in every if s["cpu_ns"] is not None]
    assert all(s[c] is not None for s in steps for c in schema.WORK_COLUMNS)
    # default probes: a step WORK_GAP_NS or more after the last measured one's end, and only those
    assert 2 <= len(steps) < len(every)
    for prev, s in zip(steps, steps[1:]):
        assert s["start_ns"] >= prev["end_ns"] + WORK_GAP_NS
        skipped = [u for u in every if prev["end_ns"] <= u["start_ns"] < s["start_ns"]]
        assert all(u["start_ns"] < prev["end_ns"] + WORK_GAP_NS for u in skipped), (prev, s)
    slack = 20_000  # ns: the clocks are read inside the wall clock's reads (one read's cost of slack)
    for s in steps:
        wall = s["end_ns"] - s["start_ns"]
        assert 0 < s["cpu_ns"] and 0 <= s["wait_ns"], s
        assert s["cpu_ns"] + s["wait_ns"] <= wall + slack, s  # wall = cpu + wait + off-CPU not runnable
        assert s["forward_cpu_ns"] <= s["cpu_ns"] and s["forward_wait_ns"] <= s["wait_ns"], s
        execute = wall - (s["schedule_s"] + s["output_s"]) * 1e9  # the executor's call, step_context and all
        assert s["forward_cpu_ns"] + s["forward_wait_ns"] <= execute + slack, s
    # (no lower bound on cpu + wait: the rest is time blocked, not runnable: another of the process's
    # threads holding the GIL, a lock, I/O; measured here up to 8 ms of an 11 ms step on a loaded machine)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs /proc schedstat")
def test_a_hog_on_the_engine_threads_core_is_wait_not_work(tiny_model, tmp_path):
    """The engine thread and a busy process pinned to one core: the scheduler shares it, so the
    thread waits for about as long as it runs, and its CPU time stays the work's. (The machine is
    shared: the run without the hog is not quiet, so it is the work's yardstick, not the wait's.)"""
    from layerscope.engine.config import EngineConfig
    from layerscope.probes.recorder import ProbeRecorder

    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)

    def run() -> tuple[int, int, int]:
        rec = ProbeRecorder()
        rec.work_gap_ns = 0  # every step
        engine = LLMEngine(EngineConfig(model=str(tiny_model), **ENGINE), recorder=rec)
        rec.start()
        for i, p in enumerate(prompts(8)):
            engine.add_request(p, params(16), f"r{i}")
        while engine.has_unfinished_requests():
            engine.step()
        rec.stop()
        steps = rec._steps
        assert all(s.cpu_ns is not None for s in steps)
        engine.shutdown()
        return (sum(s.cpu_ns for s in steps), sum(s.wait_ns for s in steps),
                sum(s.end_ns - s.start_ns for s in steps))

    hog = None
    try:
        os.sched_setaffinity(0, {core})  # this thread only (0: the caller): the engine steps here
        quiet = run()
        hog = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 60\nwhile time.time() < t: pass"],
                               preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        busy = run()
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        os.sched_setaffinity(0, before)
    for cpu, wait, wall in (quiet, busy):
        # one thread (num_threads=1) that never sleeps in a step: its CPU and its wait make up most of
        # the wall (the rest: blocked on the GIL another of the process's threads held, a lock)
        assert 0.75 * wall <= cpu + wait <= wall, (quiet, busy)
    cpu_b, wait_b, wall_b = busy
    assert wait_b > 0.3 * wall_b, (quiet, busy)  # CFS gives the hog about half the core
    assert cpu_b < 2 * quiet[0], (quiet, busy)  # the work did not grow: the wall did
