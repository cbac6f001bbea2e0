"""Run-to-run priors from a recorded A/A set, kept apart from the tests that use them.

``diagnose/priors.toml`` holds, per metric, the prior relative SD between identical runs that one pair
of runs is held to (``stats.Rule``'s ``run_spread``), with where it was measured and on how many runs.
``estimate`` re-measures them from A/A pairs (``aa_check record quiet|busy`` directories): per pair the
log ratio of each metric, the spread sqrt(mean(d**2) / 2) over the pairs (identical runs: d has mean 0),
and the step time at equal batch size (``Causes.step_ratio``, the prior ``contention`` holds a step's
change to). ``python -m layerscope.diagnose.priors DIR... [--json FILE]`` prints them with the verdict
of every A/A comparison both ways (the false alarms of the whole diagnosis).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path

PRIORS = Path(__file__).with_name("priors.toml")
METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "output_tokens_per_s",
           "goodput_requests_per_s")
FALSE_ALARMS = ("regression", "improvement", "mixed")
# the rows a comparison adds where the runs measured them -> their prior's name in priors.toml
ROWS = {"step_work_s": "step_own_s", "gateway_queue_s": "gateway_queue_s"}


def load(path: Path = PRIORS) -> dict[str, dict]:
    """{table: {metric: {spread, n_runs, source}}} from priors.toml."""
    with open(path, "rb") as f:
        return tomllib.load(f)


def spreads(table: str, path: Path = PRIORS) -> dict[str, float]:
    """{metric or kind: spread} of one table of priors.toml (``chat``, ``saturated``, ``external``)."""
    return {k: float(v["spread"]) for k, v in load(path)[table].items()}


def pairs(dirs: list[Path]) -> list[tuple[Path, Path, str]]:
    """(a, b, kind) of every complete pair under ``dirs`` (aa_check's ``pairNN/{a,b}``, ``done.json``)."""
    out = []
    for d in dirs:
        for p in sorted(Path(d).glob("**/pair*")):
            done = p / "done.json"
            if done.is_file() and (p / "a").is_dir() and (p / "b").is_dir():
                out.append((p / "a", p / "b", "busy" if json.loads(done.read_text()).get("busy") else "quiet"))
    return out


def estimate(dirs: list[Path]) -> dict:
    """Per-pair log ratios, the spreads they give, and the verdicts of compare() both ways."""
    from layerscope.diagnose.analysis import RunAnalysis
    from layerscope.diagnose.comparison import compare

    rows, verdicts = [], []
    for a, b, kind in pairs(dirs):
        ra, rb = RunAnalysis(a), RunAnalysis(b)
        c = compare(ra, rb)
        d = c.diagnosis
        row = {"pair": f"{a.parent.parent.name}/{a.parent.name}", "kind": kind}
        for m in (*METRICS, *ROWS):
            x, y = ((d["metrics"].get(m) or {}).get(k) for k in ("baseline", "candidate"))
            row[ROWS.get(m, m)] = math.log(y / x) if x and y and x > 0 and y > 0 else None
        from layerscope.diagnose.attribution import Causes

        sr = Causes(ra, rb, set(), False, False, same_machine=True).step_ratio()
        row["step_s"] = math.log(sr) if sr > 0 else None
        rows.append(row)
        for x, y, label in ((a, b, "a->b"), (b, a, "b->a")):
            v = compare(x, y).diagnosis if label == "b->a" else d
            verdicts.append({"pair": row["pair"], "kind": kind, "direction": label, "verdict": v["verdict"],
                             "primary": v["primary"]})
    out = {"pairs": rows, "verdicts": verdicts, "spread": {}}
    for kind in ("quiet", "busy", "all"):
        sel = [r for r in rows if kind == "all" or r["kind"] == kind]
        out["spread"][kind] = {m: _spread([r[m] for r in sel]) for m in (*METRICS, *ROWS.values(), "step_s")}
        out["spread"][kind]["n_pairs"] = len(sel)
    alarms = [v for v in verdicts if v["verdict"] in FALSE_ALARMS]
    out["false_alarms"] = {"comparisons": len(verdicts), "software_verdicts": len(alarms),
                           "inconclusive": sum(v["verdict"] == "inconclusive" for v in verdicts)}
    return out


def _spread(ds: list[float | None]) -> float | None:
    ds = [d for d in ds if d is not None and math.isfinite(d)]
    return math.sqrt(sum(d * d for d in ds) / len(ds) / 2) if ds else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m layerscope.diagnose.priors", description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="aa_check record directories")
    ap.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = ap.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        print(f"no such directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    res = estimate(args.dirs)
    for kind, s in res["spread"].items():
        print(f"{kind:6s} ({s['n_pairs']} pairs): " + "  ".join(
            f"{m} {100 * v:.1f}%" for m, v in s.items() if m != "n_pairs" and v is not None))
    for v in res["verdicts"]:
        print(f"  {v['pair']} {v['kind']:5s} {v['direction']}: {v['verdict']} {v['primary'] or ''}")
    fa = res["false_alarms"]
    print(f"software verdicts (regression/improvement/mixed) on A/A: {fa['software_verdicts']} of {fa['comparisons']};"
          f" inconclusive {fa['inconclusive']}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
