"""Did the machine differ between two runs? Contention and speed, from the bundles' machine evidence.

probes/machine.py records, with every ``layerscope run``, what other processes did
(``outside_cpu_cores`` every 0.25 s, plus hypervisor steal and GPU processes) and a
fixed yardstick's time before and after the load. ``machine_diff`` compares them:

- **contention**: the runs' samples of other processes' CPU use (outside + steal,
  cores) differ by a rank test (Mann-Whitney p < 0.01) and by a material amount:
  at least a quarter of a core, and at least 10% of the usable CPUs (one busy core on a
  64-core machine is no contention); or, on a saturated machine where the CPUs are busy
  either way, the share of the time the run's threads were runnable that they spent
  waiting for a CPU (schedstat) differs by a rank test (p < 0.01) and by >= 10 points;
- **speed**: the yardstick's timings (3 before + 3 after the load in each run) differ
  by a rank test (p < 0.05) and the medians by >= 10% (one core's speed: frequency, a
  VM neighbour, thermal limits);
- **GPU**: processes that are not the run's on its GPUs in one run and not the other;
- **instability**: the yardstick is a fixed workload, so the range of its 12 timings
  (slowest over fastest, both runs pooled: ``machine_range``) is how much the machine's
  speed for this run varied while the two runs were recorded. On a quiet machine it is a
  few percent; on an oversubscribed one it can be 10x, and then no step phase's change
  within that factor can be told from the machine's (``comparison``). Latencies that
  include queueing move by more than the machine's factor (a queue amplifies a slower
  server), so the comparison tests the per-step phases against the range, not the
  latencies.

The run with more contention or the slower yardstick is the one "on the busier
machine"; the comparison (``comparison.compare``) uses that to say ``environment_changed``
instead of blaming a software layer. Bundles without machine evidence give
``recorded: False`` and change nothing.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from layerscope.diagnose.stats import mann_whitney_p

MIN_CORES = 0.25  # a material contention difference: at least this many cores ...
MIN_CPU_SHARE = 0.10  # ... and this share of the usable CPUs
MIN_WAIT_SHARE = 0.10  # or the run's CPU wait share differs by this (a saturated machine)
CONTENTION_P = 0.01
SPEED_RATIO = 1.10
UNSTABLE_RANGE = 1.25  # the yardstick's slowest/fastest over both runs: the machine's speed varied
SPEED_P = 0.05


def _contention(df) -> np.ndarray:
    if df is None or not len(df):
        return np.zeros(0)
    out = df["outside_cpu_cores"].to_numpy(np.float64)
    steal = np.nan_to_num(df["steal_cores"].to_numpy(np.float64)) if "steal_cores" in df else 0.0
    v = out + steal
    return v[~np.isnan(v)]


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _wait_share(df) -> np.ndarray:
    """Per sample: run-queue wait / (wait + CPU) of the run's threads (0..1)."""
    if df is None or not len(df) or "run_wait_cores" not in df:
        return np.zeros(0)
    w = df["run_wait_cores"].to_numpy(np.float64)
    c = df["run_cpu_cores"].to_numpy(np.float64)
    tot = w + c
    ok = ~np.isnan(tot) & (tot > 0.02)  # samples where the run wanted a CPU at all
    return w[ok] / tot[ok]


def _yardstick(section: dict | None) -> list[float]:
    y = (section or {}).get("yardstick") or {}
    return [float(x) for x in (y.get("before_s") or []) + (y.get("after_s") or []) if x is not None]


def machine_diff(a, b) -> dict[str, Any]:
    """Compare the machine evidence of two RunAnalysis objects (module doc).

    Returns recorded, changed, busier ("baseline" | "candidate" | None: the run whose
    machine was busier or slower; None when neither or they disagree), contention_changed,
    speed_changed, outside_cpu_cores [baseline, candidate] (means), contention_p_value,
    yardstick_s [medians], yardstick_ratio, yardstick_p_value, load_1m, gpu_other_procs,
    evidence (sentences)."""
    (da, sa), (db, sb) = a.machine, b.machine
    out: dict[str, Any] = {"recorded": sa is not None and sb is not None, "changed": False, "busier": None,
                           "contention_changed": False, "speed_changed": False, "evidence": []}
    for key in ("outside_cpu_cores_mean", "load_1m_mean", "gpu_other_procs_max"):
        out[key.replace("_mean", "").replace("_max", "")] = [(sa or {}).get(key), (sb or {}).get(key)]
    if not out["recorded"]:
        out["evidence"].append("no machine evidence recorded in " + " and ".join(
            n for n, s in (("the baseline", sa), ("the candidate", sb)) if s is None))
        return out
    votes: list[str] = []
    ca, cb = _contention(da), _contention(db)
    if len(ca) >= 4 and len(cb) >= 4:
        ma, mb = float(ca.mean()), float(cb.mean())
        cpus = max(int(sa.get("cpus_usable") or 1), int(sb.get("cpus_usable") or 1))
        p = mann_whitney_p(ca, cb)
        out.update(outside_cpu_cores=[ma, mb], contention_p_value=p)
        material = abs(mb - ma) >= max(MIN_CORES, MIN_CPU_SHARE * cpus)
        if material and p < CONTENTION_P:
            out["contention_changed"] = True
            busier = "candidate" if mb > ma else "baseline"
            votes.append(busier)
            out["evidence"].append(f"other processes used {ma:.2f} -> {mb:.2f} cores of {cpus} while the runs were "
                                   f"recorded (Mann-Whitney p={p:.2g} over {len(ca)}/{len(cb)} samples): the "
                                   f"{busier} ran on the busier machine")
        else:
            out["evidence"].append(f"other processes used {ma:.2f} -> {mb:.2f} cores of {cpus} "
                                   f"(p={p:.2g}): {'not a material difference' if not material else 'not significant'}")
    wa, wb = _wait_share(da), _wait_share(db)
    if len(wa) >= 4 and len(wb) >= 4:
        ma, mb = float(wa.mean()), float(wb.mean())
        p = mann_whitney_p(wa, wb)
        out.update(run_wait_share=[ma, mb], run_wait_p_value=p)
        if abs(mb - ma) >= MIN_WAIT_SHARE and p < CONTENTION_P:
            out["contention_changed"] = True
            busier = "candidate" if mb > ma else "baseline"
            votes.append(busier)
            out["evidence"].append(f"the run's threads waited for a CPU {ma:.0%} -> {mb:.0%} of the time they were "
                                   f"runnable (Mann-Whitney p={p:.2g}): the {busier} ran on the busier machine")
        else:
            out["evidence"].append(f"the run's threads waited for a CPU {ma:.0%} -> {mb:.0%} of the time they were "
                                   f"runnable (p={p:.2g}): {'not significant' if abs(mb - ma) >= MIN_WAIT_SHARE else 'not a material difference'}")
    ya, yb = _yardstick(sa), _yardstick(sb)
    if len(ya) >= 2 and len(yb) >= 2:
        ra, rb = float(np.median(ya)), float(np.median(yb))
        ratio = rb / ra if ra > 0 else math.nan
        p = mann_whitney_p(np.array(ya), np.array(yb))
        out.update(yardstick_s=[ra, rb], yardstick_ratio=ratio, yardstick_p_value=p)
        if (ratio >= SPEED_RATIO or ratio <= 1 / SPEED_RATIO) and p < SPEED_P:
            out["speed_changed"] = True
            slower = "candidate" if ratio > 1 else "baseline"
            votes.append(slower)
            out["evidence"].append(f"the fixed yardstick took {_ms(ra)} -> {_ms(rb)} (x{ratio:.2f}, "
                                   f"p={p:.2g}): the {slower} ran on the slower machine")
        else:
            same = abs(math.log(ratio)) < math.log(SPEED_RATIO) if ratio > 0 else True
            out["evidence"].append(f"the fixed yardstick took {_ms(ra)} -> {_ms(rb)} (x{ratio:.2f}, p={p:.2g}): "
                                   + ("same speed" if same else "not a significant difference"))
    ga, gb = out["gpu_other_procs"]
    if ga is not None and gb is not None and (ga > 0) != (gb > 0):
        busier = "candidate" if gb > ga else "baseline"
        votes.append(busier)
        out["evidence"].append(f"other processes on the GPU {ga:.0f} -> {gb:.0f}: the {busier} shared its GPU")
    pooled = ya + yb
    if len(ya) >= 2 and len(yb) >= 2:
        lo, hi = min(pooled), max(pooled)
        out["machine_range"] = float(hi / lo) if lo > 0 else math.nan
        if out["machine_range"] >= UNSTABLE_RANGE:
            out["evidence"].append(f"the yardstick's timings ranged x{out['machine_range']:.2f} (slowest/fastest over "
                                   f"both runs): the machine's speed varied that much while the runs were recorded")
    out["changed"] = bool(votes)
    out["busier"] = votes[0] if votes and all(v == votes[0] for v in votes) else None
    if out["busier"] is None and not votes and "yardstick_ratio" in out and abs(math.log(out["yardstick_ratio"])) > 0:
        out["leaning"] = "candidate" if out["yardstick_ratio"] > 1 else "baseline"  # not significant
    return out


def machine_explains(metric: dict, higher_is_worse: bool, env: dict[str, Any]) -> bool:
    """Whether the machine can explain a significant change of one metric: its speed varied
    while the runs were recorded (``machine_range`` >= 1.25: then in either direction), or
    the runs' machines differed significantly and the change goes the way that predicts
    (the run on the busier machine is the slower one; either way when the evidence points
    both ways)."""
    d = metric.get("delta_pct")
    if d is None or (isinstance(d, float) and math.isnan(d)):
        return False
    if unstable(env):
        return True
    if not env.get("changed"):
        return False
    if env.get("busier") is None:
        return True
    cand_worse = (d > 0) == higher_is_worse
    return cand_worse == (env["busier"] == "candidate")


def unstable(env: dict[str, Any]) -> bool:
    rng = env.get("machine_range")
    return rng is not None and not math.isnan(rng) and rng >= UNSTABLE_RANGE


def machine_relevant(env: dict[str, Any]) -> bool:
    """The machine differed between the runs, or its speed varied while they ran."""
    return bool(env.get("changed") or unstable(env))
