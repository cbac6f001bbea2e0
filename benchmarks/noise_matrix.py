"""The noise matrix (issue 36): is a known slowdown named when another process keeps a core busy?

For each layer of LAYERS, a known slowdown (regressions/fault_matrix.py's faults) at two sizes: one a
quiet pair can see ("visible": about VISIBLE_X times the quiet pair's minimum detectable effect on
the metric it moves) and one in the middle band (MIDDLE_X of that: between half of it and it). Each
size runs under three noise conditions: a CPU hog (a busy-looping process started and stopped here,
pinned to one core) during the baseline run, during the candidate run, or neither; ``--reps`` pairs a
cell, each pair a fresh baseline then its candidate. Same-code A/A pairs run under the same three
conditions. Prints each pair's verdict and primary layer, per cell whether the slowed layer was named,
and the totals against the acceptance rates:

- visible: the slowed layer named (verdict regression or mixed, primary that layer) in >= 90 % of pairs;
- middle band: named, or ``inconclusive`` with that layer first, in every pair (never ``no_change``,
  never ``hardware`` alone);
- A/A: no software regression (regression/mixed naming a software layer) in >= 95 % of pairs.

    python benchmarks/noise_matrix.py [--model DIR] [--out DIR] [--layers a,b] [--sizes visible,middle]
        [--noise none,baseline,candidate] [--reps 3] [--aa-reps 3] [--json FILE]

The sizes come from a quiet A/A calibration pair run first (it counts as an A/A pair of the
"none" condition): the baseline's TPOT p50 and TTFT p50 and their minimum detectable effects.
Sized for the tiny model on two cores: a run is ~15 s, a pair ~30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from layerscope.regressions import fault_matrix as fm

NOISE = ("none", "baseline", "candidate")  # which run of a pair the hog runs beside
SIZES = ("visible", "middle")
VISIBLE_X = 2.0  # the visible size: this many times the quiet pair's MDE on the moved metric
MIDDLE_X = 0.7  # the middle band's size, as a share of the visible size (between half and all of it)
WORKLOAD = {"num_requests": 24, "rate": 4.0}
SOFTWARE_VERDICTS = ("regression", "mixed")
NOT_SOFTWARE = ("hardware", "workload", None)


@dataclass(frozen=True)
class Slowdown:
    layer: str  # the layer a correct diagnosis names
    fault: str  # the fault of engine/faults.py
    metric: str  # the metric it moves: its quiet MDE sizes the fault
    per_unit: float | str = 1.0  # the metric's change per fault unit (ms is ms), divided out when sizing;
    # "collectives": the collectives a step runs, counted in the calibration's baseline run
    baseline: dict[str, Any] = field(default_factory=dict)  # run arguments of both runs (tp, profile)
    row: str = ""  # model.layer_delay's row


# Every per-step delay adds about its length to each request's time per output token (a decode
# step gives every running request one token); the gateway's delay adds its length to TTFT; a
# collective delay is paid at each of a forward's all-reduces (two a layer: attention and MLP).
LAYERS: tuple[Slowdown, ...] = (
    Slowdown("gateway.queue", "gateway.delay_ms", "ttft_p50_s"),
    Slowdown("engine.schedule", "engine.step_overhead_ms", "tpot_p50_s"),
    Slowdown("model.forward", "model.layer_delay", "tpot_p50_s", row="layers.1.mlp"),
    Slowdown("engine.output", "output.delay_ms", "tpot_p50_s"),
    Slowdown("parallel.collective", "collective.delay_ms", "tpot_p50_s", per_unit="collectives", baseline={"tp": 2}),
)
# Each distinct ``baseline`` is calibrated by a quiet pair of its own: a TP-2 step on two cores runs six
# gloo all-reduces (~10 ms a token against TP-1's 0.7 ms), so TP-1's MDE would size a collective delay far
# below what a TP-2 pair can see.


@dataclass
class Pair:
    kind: str  # a layer id, or "A/A"
    size: str  # visible | middle | aa
    noise: str
    rep: int
    fault: str = ""
    verdict: str | None = None
    primary: str | None = None
    ok: bool = False
    outcome: str = ""  # named | inconclusive | missed: <verdict>/<layer> | sw-regression | clean
    delta_pct: float | None = None  # the moved metric's change
    mde_pct: float | None = None
    others_cpus: float = 0.0
    seconds: float = 0.0
    error: str = ""


def score(pair: Pair, d: dict, metric: str | None) -> Pair:
    """Fill ``pair`` from diagnosis ``d`` (``diagnose --json``) by the acceptance's rules."""
    pair.verdict = d["verdict"]
    pair.primary = (d.get("primary") or {}).get("layer")
    m = d["metrics"].get(metric) if metric else None
    if m:
        pair.delta_pct, pair.mde_pct = m.get("delta_pct"), m.get("mde_pct")
    if pair.kind == "A/A":
        bad = pair.verdict in SOFTWARE_VERDICTS and pair.primary not in NOT_SOFTWARE
        pair.ok, pair.outcome = not bad, ("sw-regression" if bad else "clean")
        return pair
    named = pair.verdict in SOFTWARE_VERDICTS and pair.primary == pair.kind
    unsure = pair.verdict == "inconclusive" and pair.primary == pair.kind
    pair.outcome = "named" if named else "inconclusive" if unsure else f"missed: {pair.verdict}/{pair.primary}"
    pair.ok = named or (unsure and pair.size == "middle")
    return pair


class Hog:
    """A busy-looping process pinned to one core, for at most ``limit_s`` (killed on exit)."""

    def __init__(self, limit_s: float = 600.0):
        self.limit_s, self.proc = limit_s, None

    def __enter__(self) -> "Hog":
        core = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        code = f"import time\nend = time.monotonic() + {self.limit_s}\nwhile time.monotonic() < end: pass"
        pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
        self.proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=pin)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def _run(st: fm.Settings, out: Path, kwargs: dict[str, Any], hog: bool) -> tuple[Path, float]:
    if hog:
        with Hog():
            time.sleep(0.5)  # the hog at full speed before the run's before-yardstick
            return fm._run(st, out, kwargs, fresh=True)
    return fm._run(st, out, kwargs, fresh=True)


def run_pair(st: fm.Settings, pair: Pair, base_kw: dict, cand_kw: dict, metric: str | None) -> Pair:
    t0 = time.monotonic()
    tag = f"{pair.kind}-{pair.size}-{pair.noise}-{pair.rep}".replace("/", "")
    try:
        a, oa = _run(st, st.out / f"{tag}-base", base_kw, pair.noise == "baseline")
        b, ob = _run(st, st.out / f"{tag}-cand", cand_kw, pair.noise == "candidate")
        pair.others_cpus = max(oa, ob)
        score(pair, fm._diagnose(a, b), metric)
    except RuntimeError as e:
        pair.error = str(e)
    pair.seconds = time.monotonic() - t0
    return pair


def kwargs(slow: Slowdown | None, amount_ms: float | None) -> dict[str, Any]:
    """``layerscope.run`` arguments: the chat workload, the slowdown's shared arguments, its fault."""
    kw: dict[str, Any] = {"workload": "chat", "workload_params": {**WORKLOAD, "seed": 0}}
    if slow is None:
        return kw
    kw.update(slow.baseline)
    if amount_ms is not None:
        value = f"{slow.row}:{amount_ms:.3g}" if slow.row else round(amount_ms, 3)
        kw["faults"] = {**kw.get("faults", {}), slow.fault: value}
    return kw


def calibrate(st: fm.Settings, baseline: dict | None = None) -> tuple[dict[str, Any], Pair]:
    """A quiet A/A pair of the runs ``baseline`` (Slowdown.baseline: {} is the plain run): {metric:
    (baseline value s, MDE %)} for TPOT and TTFT p50, ``collectives_per_step``, and the pair."""
    from layerscope.diagnose.analysis import RunAnalysis
    from layerscope.diagnose.comparison import compare

    tag = "".join(f"-{k}{v}" for k, v in sorted((baseline or {}).items()))
    pair = Pair("A/A", "aa" + tag, "none", 0)
    run_pair(st, pair, {**kwargs(None, None), **(baseline or {})}, {**kwargs(None, None), **(baseline or {})},
             "tpot_p50_s")
    if pair.error:
        raise SystemExit(f"calibration failed: {pair.error}")
    name = f"AA-aa{tag}-none-0"
    d = compare(st.out / f"{name}-base", st.out / f"{name}-cand").diagnosis
    cal: dict[str, Any] = {}
    for metric in ("tpot_p50_s", "ttft_p50_s"):
        m = d["metrics"][metric]
        cal[metric] = (m["baseline"], m["mde_pct"])
    a = RunAnalysis(st.out / f"{name}-base")
    cr = a.collective_ranks
    steps = len(a.run.steps)
    cal["collectives_per_step"] = (float(cr["num_collectives"].iloc[0]) / steps
                                   if cr is not None and len(cr) and steps else None)
    return cal, pair


def size_ms(slow: Slowdown, size: str, cal: dict[str, Any]) -> float:
    """The fault's amount (ms) that moves ``slow.metric`` by VISIBLE_X (x MIDDLE_X) its quiet MDE,
    ``cal`` being the calibration of the slowdown's own baseline runs."""
    base_s, mde_pct = cal[slow.metric]
    per_unit = cal["collectives_per_step"] if slow.per_unit == "collectives" else slow.per_unit
    if not per_unit:
        raise SystemExit(f"{slow.layer}: the calibration counted no {slow.per_unit} a step")
    visible = VISIBLE_X * mde_pct / 100 * base_s * 1e3 / per_unit
    return visible if size == "visible" else MIDDLE_X * visible


def cells(pairs: list[Pair]) -> dict[tuple[str, str, str], list[Pair]]:
    out: dict[tuple[str, str, str], list[Pair]] = {}
    for p in pairs:
        out.setdefault((p.kind, p.size, p.noise), []).append(p)
    return out


def report(pairs: list[Pair], file=sys.stdout, header: bool = True) -> dict[str, tuple[int, int]]:
    """Per cell: the pairs' outcomes; then (``header``) the totals against the acceptance rates."""
    if header:
        print(f"{'layer':20s} {'size':8s} {'noise':10s} {'fault':26s} {'named':>6s}  outcomes", file=file)
    for (kind, size, noise), ps in cells(pairs).items():
        done = [p for p in ps if not p.error]
        outs = "; ".join(f"{p.outcome} ({p.delta_pct:+.0f}% mde {p.mde_pct:.0f}%)" if p.delta_pct is not None
                         and p.mde_pct is not None else (p.outcome or f"ERR {p.error[:40]}") for p in ps)
        print(f"{kind:20s} {size:8s} {noise:10s} {ps[0].fault:26s} {sum(p.ok for p in done)}/{len(done):<4d}  {outs}",
              file=file)
    totals: dict[str, tuple[int, int]] = {}
    if not header:
        return totals
    for label, want, sel in (("visible named", 0.90, lambda p: p.size == "visible"),
                             ("middle named or inconclusive-first", 1.0, lambda p: p.size == "middle"),
                             ("A/A no software regression", 0.95, lambda p: p.kind == "A/A")):
        done = [p for p in pairs if sel(p) and not p.error]
        ok = sum(p.ok for p in done)
        totals[label] = (ok, len(done))
        rate = f"{100 * ok / len(done):.0f}%" if done else "-"
        verdict = "holds" if done and ok / len(done) >= want else "fails" if done else "not run"
        print(f"{label}: {ok}/{len(done)} ({rate}; target >= {100 * want:.0f}%): {verdict}", file=file)
    return totals


def rescore(saved: Path, out: Path, json_out: str | None = None) -> int:
    """Score the pairs of ``saved`` (a --json file) again from their bundles under ``out``: a diagnose
    change measured on the same runs. Prints the old outcome beside the new where they differ."""
    if not saved.is_file():
        raise SystemExit(f"no such file: {saved}")
    data = json.loads(saved.read_text())
    metric = {s.layer: s.metric for s in LAYERS}
    pairs, moved = [], []
    for d in data["pairs"]:
        old = Pair(**d)
        p = Pair(old.kind, old.size, old.noise, old.rep, fault=old.fault, others_cpus=old.others_cpus,
                 seconds=old.seconds, error=old.error)
        tag = f"{p.kind}-{p.size}-{p.noise}-{p.rep}".replace("/", "")
        if not p.error:
            try:
                score(p, fm._diagnose(out / f"{tag}-base", out / f"{tag}-cand"), metric.get(p.kind, "tpot_p50_s"))
            except RuntimeError as e:
                p.error = str(e)
        if p.outcome != old.outcome:
            moved.append(f"{tag}: {old.outcome} -> {p.outcome}")
        pairs.append(p)
    totals = report(pairs)
    print(f"{len(moved)} of {len(pairs)} pairs scored differently from {saved.name}" + "".join(f"\n  {m}" for m in moved))
    if json_out:
        Path(json_out).write_text(json.dumps({"calibration": data.get("calibration"), "pairs": [asdict(p) for p in pairs]},
                                             indent=1))
    return 0 if all(ok == n for ok, n in totals.values()) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: a tiny llama made under --out)")
    ap.add_argument("--out", default="noise-matrix", help="where runs are written")
    ap.add_argument("--layers", default=",".join(s.layer for s in LAYERS))
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--noise", default=",".join(NOISE))
    ap.add_argument("--reps", type=int, default=3, help="pairs a cell")
    ap.add_argument("--aa-reps", type=int, default=3, help="A/A pairs a noise condition (the calibration counts)")
    ap.add_argument("--json", help="also write the pairs to this JSON file")
    ap.add_argument("--rescore", metavar="JSON", help="no runs: diagnose the bundles a earlier --json run kept "
                    "under --out again, with this checkout's diagnose, and score them")
    args = ap.parse_args(argv)
    if args.rescore:
        return rescore(Path(args.rescore), Path(args.out), args.json)
    known = {s.layer: s for s in LAYERS}
    layers, sizes, noise = args.layers.split(","), args.sizes.split(","), args.noise.split(",")
    for got, allowed, what in ((layers, known, "layers"), (sizes, SIZES, "sizes"), (noise, NOISE, "noise")):
        if set(got) - set(allowed):
            ap.error(f"unknown {what}: {', '.join(sorted(set(got) - set(allowed)))} (known: {', '.join(allowed)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # no waiting for a quiet machine, no rerun of a disturbed run: the noise is what is measured
    st = fm.Settings(fm.ensure_model(args.model, out), out, max_busy=1.0, quiet_timeout_s=0, retries=0)
    cals: dict[str, dict[str, Any]] = {}
    pairs: list[Pair] = []
    # the baselines to calibrate, the plain runs' first: their calibration is the "none" condition's first A/A
    bases = [{}] * (args.aa_reps > 0) + [known[x].baseline for x in layers]
    for base in bases:
        key = json.dumps(base, sort_keys=True)
        if key in cals:
            continue
        cals[key], first = calibrate(st, base)
        if not base:
            pairs.append(first)
        print(f"calibration {base or 'plain'} (quiet A/A): " + ", ".join(
            f"{k} {v[0] * 1e3:.1f} ms, MDE {v[1]:.0f}%" for k, v in cals[key].items() if isinstance(v, tuple))
            + f", {cals[key]['collectives_per_step']} collectives a step", file=sys.stderr)
    for rep in range(args.reps):
        for nz in noise:
            for layer in layers:
                slow = known[layer]
                for size in sizes:
                    ms = size_ms(slow, size, cals[json.dumps(slow.baseline, sort_keys=True)])
                    p = Pair(layer, size, nz, rep, fault=f"{slow.fault}={ms:.2f}ms")
                    pairs.append(run_pair(st, p, kwargs(slow, None), kwargs(slow, ms), slow.metric))
                    report(pairs[-1:], sys.stderr, header=False)
            if rep < args.aa_reps and not (nz == "none" and rep == 0):  # the calibration was rep 0's
                pairs.append(run_pair(st, Pair("A/A", "aa", nz, rep), kwargs(None, None), kwargs(None, None),
                                      "tpot_p50_s"))
                report(pairs[-1:], sys.stderr, header=False)
    totals = report(pairs)
    if args.json:
        Path(args.json).write_text(json.dumps({"calibration": cals, "pairs": [asdict(p) for p in pairs]}, indent=1))
    return 0 if all(ok == n for ok, n in totals.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
