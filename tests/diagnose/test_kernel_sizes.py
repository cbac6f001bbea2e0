"""Kernel ops compared at two sizes (diagnose/model.py's kernel_op_deltas), and the profiler's
windows that give it both (probes/profiler.py).

A fixed extra time per call and a common factor predict the same per-op deltas when every
profiled op is of about one size (batch-1 decodes): diagnose then says it cannot tell. Ops
profiled in a prefill step too are tens of times larger; compared at the baseline's sizes,
the two models separate.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from layerscope.diagnose import model
from layerscope.diagnose.attribution import _cannot_tell
from layerscope.diagnose.load import Run

# per-token and fixed parts of each op's time (s): at one token the ops are of about one size (a
# Python-bound tiny model's decode ops, 50-120 us each), per token they differ tens of times
OPS = {"aten::mm": (4e-6, 9e-5), "aten::bmm": (1e-6, 8e-5), "aten::mul": (1e-7, 7e-5),
       "aten::add": (8e-8, 7e-5), "aten::silu": (1.5e-7, 8e-5), "aten::softmax": (5e-7, 1e-4)}


def _run(steps: list[tuple[int, int, int]], factor: float = 1.0, extra_s: float = 0.0, seed: int = 0,
         scatter: float = 0.05) -> Run:
    """A run profiled on ``steps`` = (step_id, batch tokens, prompt tokens); every op's time is
    ``factor`` x (fixed + per_token x tokens) + ``extra_s``, with a little scatter."""
    rng = np.random.default_rng(seed)
    srows, krows = [], []
    for sid, tokens, prompt in steps:
        srows.append({"step_id": sid, "replica": 0, "num_batched_tokens": tokens, "num_prefill_tokens": prompt})
        for name, (per_tok, fixed) in OPS.items():
            for _ in range(4):  # four calls per step (layers)
                d = (factor * (fixed + per_tok * tokens) + extra_s) * float(np.exp(rng.normal(0, scatter)))
                krows.append({"window": 0, "step_id": sid, "replica": 0, "name": name, "category": "compute",
                              "start_ns": 0, "duration_s": d, "gap_before_s": 0.0})
    return Run("synthetic", {"run_id": f"r{seed}"}, frames={"steps": pd.DataFrame(srows),
                                                            "kernels": pd.DataFrame(krows)})


DECODES = [(2, 1, 0), (3, 1, 0), (66, 1, 0), (67, 1, 0)]


def test_decodes_alone_cannot_tell_a_factor_from_a_fixed_time():
    base = _run(DECODES, scatter=0.25)
    d = model.kernel_op_deltas(base, _run(DECODES, factor=4.0, seed=1, scatter=0.25))
    assert set(d["name"]) == set(OPS)  # one row per op name: one kind of step, one size
    ops = model.op_change_kind(d)
    assert ops["kind"] is not None
    assert _cannot_tell(ops), ops


@pytest.mark.parametrize("change,kind", [({"factor": 4.0}, "multiplicative"), ({"extra_s": 2.5e-4}, "additive")])
def test_a_prefill_in_the_windows_tells_them_apart(change, kind):
    # the runs' prefills are of different lengths (a slower candidate saw other arrivals): compared
    # at the baseline's sizes, not as measured
    base = _run(DECODES + [(130, 420, 419), (131, 1, 0)], scatter=0.25)
    cand = _run(DECODES + [(140, 810, 809), (141, 2, 0)], seed=1, scatter=0.25, **change)
    d = model.kernel_op_deltas(base, cand)
    assert {n.rsplit(" @", 1)[1] for n in d["name"]} == {"1 tok", "420 tok"}
    ops = model.op_change_kind(d)
    assert ops["kind"] == kind
    assert not _cannot_tell(ops), ops
    if kind == "multiplicative":
        assert ops["factor"] == pytest.approx(4.0, rel=0.1)
    else:
        assert ops["per_op_s"] == pytest.approx(2.5e-4, rel=0.15)


def test_read_at_the_baselines_size_not_the_candidates():
    base = _run(DECODES + [(130, 400, 399)])
    cand = _run(DECODES + [(130, 800, 799)], seed=1)  # the same software: only the prefill was longer
    d = model.kernel_op_deltas(base, cand).set_index("name")
    mm = d.loc["aten::mm @400 tok"]
    assert mm["ratio"] == pytest.approx(1.0, abs=0.08)  # as measured it would be ~1.9x
    assert mm["baseline_s"] == pytest.approx(9e-5 + 4e-6 * 400, rel=0.1)


class _Sched:
    def __init__(self, is_prefill: bool):
        self.is_prefill = is_prefill


def test_profiler_windows_take_both_kinds_of_step(tmp_path):
    from layerscope.probes.profiler import ProfilerWindows

    pw = ProfilerWindows(tmp_path, every_steps=8, num_steps=1, max_windows=4)
    opened = []
    decode, prefill = [_Sched(False)], [_Sched(False), _Sched(True)]
    for step_id in range(1, 80):
        batch = prefill if step_id % 10 == 0 else decode
        ctx = pw.step_context(step_id, batch)
        if pw._prof is not None:
            opened.append((step_id, batch is prefill))
        with ctx:
            pass
    kinds = [p for _, p in opened]
    assert len(opened) == 4
    assert kinds.count(True) == 2 and kinds.count(False) == 2, opened
    # the first window opens at once; one that waits for a prefill waits for the next one
    assert opened[0][0] == 2
    assert opened[1] == (10, True) and opened[3] == (30, True)


def test_profiler_windows_do_not_wait_past_their_patience(tmp_path):
    from layerscope.probes.profiler import ProfilerWindows

    pw = ProfilerWindows(tmp_path, every_steps=8, num_steps=1, max_windows=3)
    opened = []
    for step_id in range(1, 100):
        ctx = pw.step_context(step_id, [_Sched(False)])  # never a prefill
        if pw._prof is not None:
            opened.append(step_id)
        with ctx:
            pass
    # at once, then each after 4 x 8 steps of patience
    assert opened == [2, 42, 82], opened
