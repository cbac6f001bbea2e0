"""The tables of ``python -m layerscope.regressions.aa_check report`` (see aa_check.py).

- A/A with a busy core: each pair's verdict, primary, and which run the machine evidence
  says was busier (``busier`` when significant, else ``leaning``: the slower yardstick);
- quiet-ish A/A: consecutive repetitions of one version (the power runs), compared;
- sensitivity: the run-to-run spread of each metric (SD of log per-run values, pooled over
  the two versions of the power runs) and the MDE it implies for one pair and for 3/5/10
  repetitions a side (stats: z for one pair, Student t with the run as the unit);
- power: detection rate of a real change and false-alarm rate of A/A draws, over random
  subsets of n repetitions a side, with ``regress``'s decision (pooled significantly
  worse + run-level t-test worse), the run-level test unpaired and paired (``regress`` pairs a
  repetition's versions from ``stats.PAIRED_MIN_PAIRS`` on).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np

from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.comparison import compare, slos
from layerscope.diagnose.stats import DEFAULT_RULE, PAIRED_MIN_PAIRS, student_t_ppf, z
from layerscope.regressions.pooled import METRIC_NAMES, compare_versions, headline

POWER_METRICS = ("tpot_p50_s", "output_tokens_per_s")


def _pairs(out: Path, kind: str) -> list[tuple[str, Path, Path, str | None]]:
    res = []
    for p in sorted((out / kind).glob("pair*/done.json")):
        res.append((p.parent.name, p.parent / "a", p.parent / "b", json.loads(p.read_text())["busy"]))
    return res


def _aa_rows(pairs) -> list[dict]:
    rows = []
    for name, a, b, busy in pairs:
        d = compare(a, b).diagnosis
        m = d["machine"]
        truth = {"a": "baseline", "b": "candidate"}.get(busy)
        said = m.get("busier") or m.get("leaning")
        rows.append({"pair": name, "busy_run": truth, "verdict": d["verdict"],
                     "primary": (d["primary"] or {}).get("layer"), "busier": m.get("busier"), "leaning": m.get("leaning"),
                     "named_right": None if truth is None else said == truth,
                     "significant": {k: round(v["delta_pct"], 1) for k, v in d["metrics"].items() if v["significant"]},
                     "machine_range": m.get("machine_range"), "run_wait_share": m.get("run_wait_share")})
    return rows


def _spread(runs: dict[str, list[RunAnalysis]], slo: dict) -> dict[str, dict]:
    out = {}
    for m in METRIC_NAMES:
        ss, df = 0.0, 0
        for an in runs.values():
            v = np.log([x for x in (headline([a], m, slo) for a in an) if x and x > 0 and math.isfinite(x)])
            if len(v) >= 2:
                ss += float(((v - v.mean()) ** 2).sum())
                df += len(v) - 1
        sd = math.sqrt(ss / df) if df else math.nan
        row = {"spread_pct": 100 * sd, "df": df,
               "mde_pair_pct": 100 * math.expm1((z(1 - DEFAULT_RULE.alpha / 2) + z(0.9)) * sd * math.sqrt(2))}
        for k in (3, 5, 10):
            t = student_t_ppf(1 - 0.05 / 2, 2 * k - 2) + student_t_ppf(0.9, 2 * k - 2)
            row[f"mde_{k}_pct"] = 100 * math.expm1(t * sd * math.sqrt(2 / k))
        out[m] = row
    return out


def _decide(base, cand, slo, paired: bool = False) -> dict[str, bool]:
    """regress's decision per power metric for one draw (one pooled comparison for all of them);
    ``paired``: base[k] and cand[k] ran in the same round, as ``regress`` pairs them."""
    c = compare_versions(base, cand, slo, pairs=[(k, k) for k in range(len(base))] if paired else None)
    both = len(base) >= 2 and len(cand) >= 2
    return {m: bool(c[m]["worse"] and (c[m]["run_level"]["worse"] if both else True)) for m in POWER_METRICS}


def _subsets(size: int, n: int, draws: int, rng) -> list[tuple[int, ...]]:
    """Up to ``draws`` distinct n-subsets of range(size), drawn at random (all of them when there
    are no more than ``draws``; never listing C(size, n) of them: C(30, 15) is 155 million)."""
    total = math.comb(size, n)
    if total <= draws:
        return list(itertools.combinations(range(size), n))
    seen: set[tuple[int, ...]] = set()
    while len(seen) < draws:
        seen.add(tuple(sorted(rng.choice(size, n, replace=False).tolist())))
    return sorted(seen)


def _power(runs: dict[str, list[RunAnalysis]], slo: dict, draws: int = 40, seed: int = 0) -> list[dict]:
    """Per n and metric, for the unpaired and the paired run-level test on the same draws: the
    share of n-repetition draws (the same repetitions of both versions: rounds) in which the change
    is gated, and of A/A draws in which one version is gated against itself. An A/A draw is n
    neighbouring repetitions of one version (2m against 2m + 1, each as either side: a pair two
    slots apart, the later one always on one side, so the machine's drift is in it), both versions."""
    rng = np.random.default_rng(seed)
    base, cand = runs["base"], runs["cand"]
    size = min(len(base), len(cand))
    rows = []
    for n in sorted({2, 3, 4, 6, 8, 10, 12, 15, 16, 20, 24, 26, 30, 40, size}):  # up to as many as were recorded
        if n > size:
            continue
        pick = _subsets(size, n, draws, rng)
        aa = _subsets(size // 2, n, draws // 4, rng) if n <= size // 2 else []
        for paired in (False, True):
            if paired and n < PAIRED_MIN_PAIRS:  # too few rounds to pair: regress runs the unpaired test
                rows += [{**r, "paired": True} for r in rows[-len(POWER_METRICS):]]
                continue
            hit = dict.fromkeys(POWER_METRICS, 0)
            fa = dict.fromkeys(POWER_METRICS, 0)
            fa_n = 0
            for s in pick:
                d = _decide([base[i] for i in s], [cand[i] for i in s], slo, paired)
                for m in POWER_METRICS:
                    hit[m] += d[m]
            for s in aa:
                for pool in (base, cand):
                    early, late = [pool[2 * i] for i in s], [pool[2 * i + 1] for i in s]
                    for x, y in ((early, late), (late, early)):
                        d = _decide(x, y, slo, paired)
                        for m in POWER_METRICS:
                            fa[m] += d[m]
                        fa_n += 1
            for m in POWER_METRICS:
                rows.append({"n": n, "metric": m, "paired": paired, "draws": len(pick), "detected": hit[m] / len(pick),
                             "false_alarm": fa[m] / fa_n if fa_n else None, "false_alarm_draws": fa_n})
    return rows


def report(out: Path) -> dict:
    res: dict = {}
    busy = _pairs(out, "busy")
    if busy:
        res["busy"] = _aa_rows(busy)
        print("A/A with one core kept busy during one run of each pair")
        for r in res["busy"]:
            print(f"  {r['pair']}: busy {r['busy_run']:9s} -> {r['verdict']:19s} primary {r['primary']!s:9s} "
                  f"busier {r['busier']!s:9s} leaning {r['leaning']!s:9s} right={r['named_right']} "
                  f"range x{(r['machine_range'] or math.nan):.1f} wait {r['run_wait_share']}")
        bad = [r for r in res["busy"] if r["verdict"] in ("regression", "improvement", "mixed")]
        print(f"  regression/improvement/mixed: {len(bad)} of {len(res['busy'])}; busier run named (significant or "
              f"leaning) right: {sum(bool(r['named_right']) for r in res['busy'])} of {len(res['busy'])}")
    pdir = out / "power"
    runs = {k: [RunAnalysis(p) for p in sorted((pdir / k).glob("rep*")) if (p / "manifest.json").is_file()]
            for k in ("base", "cand")} if pdir.is_dir() else {}
    n = min((len(v) for v in runs.values()), default=0)
    if n >= 2:
        runs = {k: v[:n] for k, v in runs.items()}
        slo = slos(runs["base"][0])
        quiet = [(f"{k}{i}-{i + 1}", runs[k][i].run.path, runs[k][i + 1].run.path, None)
                 for k in ("base", "cand") for i in range(0, n - 1, 2)]
        res["quiet"] = _aa_rows(quiet)
        print("\nquiet-ish A/A (consecutive repetitions of one version; the machine is shared)")
        for r in res["quiet"]:
            print(f"  {r['pair']}: {r['verdict']:19s} primary {r['primary']!s:9s} significant {r['significant']} "
                  f"range x{(r['machine_range'] or math.nan):.1f}")
        res["spread"] = _spread(runs, slo)
        print(f"\nsensitivity from {n} + {n} runs (run-to-run spread = SD of log per-run value, pooled)")
        print(f"  {'metric':24s} {'spread':>7s} {'MDE 1 pair':>10s} {'3 reps':>7s} {'5 reps':>7s} {'10 reps':>7s}")
        for m, r in res["spread"].items():
            print(f"  {m:24s} {r['spread_pct']:6.1f}% {r['mde_pair_pct']:9.0f}% {r['mde_3_pct']:6.0f}% "
                  f"{r['mde_5_pct']:6.0f}% {r['mde_10_pct']:6.0f}%")
        true = compare_versions(runs["base"], runs["cand"], slo)
        res["true_effect"] = {m: true[m]["delta_pct"] for m in POWER_METRICS}
        print(f"\npower: the change (all {n} vs {n}): " + ", ".join(f"{m} {v:+.1f}%" for m, v in
                                                              res["true_effect"].items()))
        res["power"] = _power(runs, slo)
        for r in res["power"]:
            fa = f"{r['false_alarm']:.0%} of {r['false_alarm_draws']}" if r["false_alarm"] is not None else "n/a"
            print(f"  n={r['n']} {r['metric']:22s} {'paired  ' if r['paired'] else 'unpaired'} detected "
                  f"{r['detected']:.0%} of {r['draws']} draws; false alarms {fa}")
    return res
