"""The headline rule (docs/diagnose.md §2.8): no headline contradicts its own table.

``contradicts`` reads only the diagnosis JSON: each metric's change (``delta_pct``), whether it is
significant, and the metric's sense (latencies: higher is worse; rates: lower is worse). It is
checked over generated metric tables (the rule alone) and over generated synthetic comparisons
(the whole of ``compare``, the machine check included)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerscope.diagnose.comparison import compare
from layerscope.diagnose.headline import headline, order_by_direction, primary

DATA = Path(__file__).resolve().parents[1] / "data"
RATES = ("output_tokens_per_s", "goodput_requests_per_s")
NAMES = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", *RATES)


def _side(name: str, m: dict) -> str | None:
    """worse | better for a significant metric (by its change and its sense), None otherwise."""
    d = m.get("delta_pct")
    if not m.get("significant") or d is None or (isinstance(d, float) and math.isnan(d)) or d == 0:
        return None
    up_is_worse = name not in RATES
    return "worse" if (d > 0) == up_is_worse else "better"


def contradicts(d: dict) -> str | None:
    """Why the verdict or the primary finding contradicts the metrics table, or None."""
    table = {n: m for n, m in d["metrics"].items() if m.get("decides", True)}
    worse = {n for n, m in table.items() if _side(n, m) == "worse"}
    better = {n for n, m in table.items() if _side(n, m) == "better"}
    against = {n for n, m in table.items() if m.get("against")}
    v = d["verdict"]
    want = {"regression": worse and not better, "improvement": better and not worse,
            "mixed": (worse and better) or (better and against and not worse),
            "no_change": not worse and not better}
    if v in want and not want[v]:
        return f"{v} with worse {sorted(worse)} and better {sorted(better)}"
    if v == "environment_changed" and not (worse or better):
        return "environment_changed with nothing significant"
    p = d.get("primary")
    # an explaining metric (``decides`` false: a server histogram) may carry the primary finding when it
    # moved the headline's way
    explains = {n: _side(n, m) for n, m in d["metrics"].items() if not m.get("decides", True)}
    worse |= {n for n, side in explains.items() if side == "worse"}
    better |= {n for n, side in explains.items() if side == "better"}
    if v in ("regression", "mixed") and p and p["metric"] not in worse | against:
        return f"{v} explained by {p['metric']}, which did not get worse"
    if v == "improvement" and p and p["metric"] not in better:
        return f"improvement explained by {p['metric']}, which did not get better"
    if v == "no_change" and p is not None:
        return "no_change with a primary finding"
    return None


metric_rows = st.fixed_dictionaries({"delta_pct": st.floats(-95, 900), "significant": st.booleans()})


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(NAMES), metric_rows, min_size=1),
       st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(("engine.queue", "model.forward", "engine.kv")),
                          st.floats(-1, 2)), max_size=8))
def test_the_rule_never_contradicts_its_table(rows, raw):
    metrics = {}
    for n, m in rows.items():
        worse = m["significant"] and m["delta_pct"] != 0 and ((m["delta_pct"] > 0) == (n not in RATES))
        metrics[n] = {**m, "worse": bool(worse), "significant": m["significant"] and m["delta_pct"] != 0}
    findings = [{"metric": n, "layer": lyr, "share": share} for n, lyr, share in raw if n in metrics]
    v = headline(metrics)
    ordered = order_by_direction(findings, metrics, v)
    d = {"verdict": v, "metrics": metrics, "primary": primary(ordered, v, metrics)}
    assert contradicts(d) is None, (contradicts(d), metrics, ordered)


KNOBS = st.fixed_dictionaries({
    "kernel_slowdown": st.sampled_from((1.0, 1.2, 1.6)),
    "step_overhead_s": st.sampled_from((0.0, 0.001)),
    "output_delay_s": st.sampled_from((0.0, 0.001)),
    "max_num_seqs": st.sampled_from((64, 4)),
    "machine_slowdown": st.sampled_from((1.0, 1.4)),
})


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(KNOBS, KNOBS, st.booleans())
def test_no_comparison_contradicts_its_table(synth, base, cand, work):
    """Generated pairs of synthetic runs, each knob drawn for either side (a busier machine on either,
    with its contention measured, with or without the steps' work columns)."""
    def make(k: dict, noise_seed: int) -> str:
        return synth(seed=1, noise_seed=noise_seed, num_requests=200, work_columns=work,
                     outside_cpu_cores=1.0 if k["machine_slowdown"] > 1 else 0.1, **k)

    d = compare(make(base, 1), make(cand, 2)).diagnosis
    assert contradicts(d) is None, (contradicts(d), d["verdict"], d["primary"],
                                    {n: (m["delta_pct"], m["significant"]) for n, m in d["metrics"].items()})


def test_the_checker_catches_a_contradiction():
    """The issue's case: TTFT p50 -63 % and TPOT p50 +202 %, both significant, headline regression with
    the primary finding on the TTFT side (which got better)."""
    d = {"verdict": "regression", "primary": {"metric": "ttft_p50_s", "layer": "engine.queue"},
         "metrics": {"ttft_p50_s": {"delta_pct": -63.0, "significant": True},
                     "tpot_p50_s": {"delta_pct": 202.0, "significant": True}}}
    assert "better" in contradicts(d)
    d["verdict"] = "mixed"
    assert "did not get worse" in contradicts(d)
    d["primary"] = {"metric": "tpot_p50_s", "layer": "engine.queue"}
    assert contradicts(d) is None


@pytest.mark.parametrize("flip", [False, True])
def test_a_concurrency_cap_added_or_removed_is_mixed_naming_the_queue(flip):
    """Recorded on our engine (max_num_seqs 64 -> 1 under a burst, the machine's speed varying x1.48):
    TTFT worse and TPOT better with the cap, the mirror without; both trade-offs, each side's TTFT
    change put on engine.queue."""
    a, b = DATA / "recorded_config_under_varying_machine" / "baseline", DATA / "recorded_config_under_varying_machine" / "candidate"
    d = compare(*((b, a) if flip else (a, b))).diagnosis
    assert d["verdict"] == "mixed" and contradicts(d) is None
    ttft = [f for f in d["findings"] if f["metric"] == "ttft_p50_s"]
    assert ttft and ttft[0]["layer"] == "engine.queue", ttft[:1]
    assert d["primary"]["layer"] == "engine.queue"
    assert d["primary"]["metric"] == ("tpot_p50_s" if flip else "ttft_p50_s")


def test_a_kv_pool_trade_off_is_mixed():
    a, b = DATA / "recorded_kv_pool_tradeoff" / "baseline", DATA / "recorded_kv_pool_tradeoff" / "candidate"
    for x, y in ((a, b), (b, a)):
        d = compare(x, y).diagnosis
        assert d["verdict"] == "mixed" and d["primary"]["layer"] == "engine.kv" and contradicts(d) is None


def test_a_cap_in_the_vllm_dialect_never_contradicts_its_table():
    """Recorded for issue 36 (tests/data/external/README.md, layerscope-dialect-cap): our server in vLLM's
    dialect, max_num_seqs 64 -> 2 under a burst of 48 with 16-token outputs. The client's token gaps are
    bunched (35 % under 0.1 ms), so the server's TPOT histogram stands in for the client's TPOT
    (external.analysis.STAND_IN): adding the cap is ``mixed`` (tokens/s -37 % worse, server TPOT -87 %
    better), the cost put on engine.queue by the server's queue histogram; removing it, the server's TPOT
    (+646 %) is worse and nothing better is called: TTFT (+100 % / -50 %) is under one external pair's floor
    on a pair this small (the longer pair of tests/external/test_tradeoff_pairs.py calls it). Neither way
    contradicts its table."""
    from layerscope.diagnose.external.analysis import compare_external

    cap = DATA / "external" / "layerscope-dialect-cap"
    added = compare_external(cap / "default", cap / "seqs2")
    assert added["verdict"] == "mixed" and added["primary"]["layer"] == "engine.queue", added["primary"]
    assert added["metrics"]["output_tokens_per_s"]["significant"] and contradicts(added) is None
    assert added["metrics"]["tpot_p50_s"].get("unreliable") and added["metrics"]["server_tpot_mean_s"]["decides"]
    removed = compare_external(cap / "seqs2", cap / "default")
    assert removed["verdict"] in ("regression", "mixed") and contradicts(removed) is None