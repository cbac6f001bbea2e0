"""The ``mixed`` verdict: one metric significantly better, another worse at 95 % but under the gate.

Recorded by the fault matrix (2026-12-03 01:18-01:19, quiet, tiny model): a 64-request burst
with the default KV pool (baseline) and with ``num_kv_blocks`` 16 (candidate). TPOT p50 fell by
88 % (fewer requests decoded at once) while output tokens/s fell by 39 % (preemptions 0 -> 10):
it used to be called ``improvement``. Now a regression of throughput (the floor on the ratio scale),
and ``mixed`` under a gate strict enough to leave the throughput loss uncalled."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from layerscope.diagnose.comparison import compare
from layerscope.diagnose.machine import higher_is_worse
from layerscope.diagnose.render import comparison_lines
from layerscope.diagnose.stats import DEFAULT_RULE, against_improvement

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded_kv_pool_tradeoff"


def test_a_smaller_kv_pool_that_trades_throughput_for_tpot_is_mixed_led_by_throughput():
    """At 36121bd this pair was called ``improvement`` (TPOT p50 gated better; tokens/s -39 % under the
    percent-scale floor of 43.7 %). On the ratio scale that floor is a fall of 30.4 % (x1/1.437), so the
    capacity loss is gated. Both gated, one each way: a trade-off, ``mixed`` by the one headline rule
    (docs/diagnose.md §2.8; it was ``regression`` before issue 36), the cost (tokens/s on engine.kv) first."""
    d = compare(RECORDED / "baseline", RECORDED / "candidate").diagnosis
    m = d["metrics"]
    assert m["tpot_p50_s"]["significant"] and m["tpot_p50_s"]["delta_pct"] < -50
    tps = m["output_tokens_per_s"]
    assert tps["significant"] and -tps["floor_pct"] < tps["delta_pct"] < -20, tps  # under the % floor, gated
    assert d["verdict"] == "mixed", d["verdict"]
    assert d["primary"] == {"metric": "output_tokens_per_s", "layer": "engine.kv"}, d["primary"]
    assert "preempt" in d["findings"][0]["cause"], d["findings"][0]
    assert any(f["metric"] == "tpot_p50_s" and f["layer"] == "engine.kv" for f in d["findings"][1:])


def test_under_a_stricter_gate_the_same_pair_is_mixed_not_an_improvement():
    """At alpha = 1e-4 the tokens/s fall (-39 %) is under the gate (its ratio floor -39.8 %) while TPOT
    p50's -88 % still passes: better on one metric, worse at 95 % on another: ``mixed``, the cost first."""
    rule = dataclasses.replace(DEFAULT_RULE, alpha=1e-4)
    d = compare(RECORDED / "baseline", RECORDED / "candidate", rule=rule).diagnosis
    m = d["metrics"]
    tps = m["output_tokens_per_s"]
    assert m["tpot_p50_s"]["significant"] and not tps["significant"] and tps["ci_pct"][1] < 0
    assert d["verdict"] == "mixed", d["verdict"]
    assert tps.get("against") is True and not m["tpot_p50_s"].get("against")
    assert d["primary"] == {"metric": "output_tokens_per_s", "layer": "engine.kv"}, d["primary"]
    assert "preempt" in d["findings"][0]["cause"], d["findings"][0]
    assert any(f["metric"] == "tpot_p50_s" and f["layer"] == "engine.kv" for f in d["findings"][1:])
    text = "\n".join(str(p) for kind, p in comparison_lines(d) if kind in ("verdict", "text", "table"))
    assert "MIXED" in text and "worse at 95% only" in text and "trade-off" in text


def test_the_same_pair_the_other_way_is_mixed_led_by_tpot():
    """Swapped, TPOT p50 is gated worse (+765 %) and throughput gated better (+64 %): ``mixed`` (the
    headline rule; a ``regression`` before issue 36, which contradicted the table's better tokens/s), the
    worse side first. (The ratio floor makes the pair's two directions mirror each other: -39 % and
    +64 % of tokens/s are one ratio, both gated.)"""
    d = compare(RECORDED / "candidate", RECORDED / "baseline").diagnosis
    assert d["verdict"] == "mixed", d["verdict"]
    tpot = d["metrics"]["tpot_p50_s"]
    assert tpot["significant"] and tpot["delta_pct"] > 100 and d["metrics"]["output_tokens_per_s"]["significant"]
    assert not any(v.get("against") for v in d["metrics"].values())
    assert d["primary"]["metric"] == "tpot_p50_s" and d["primary"]["layer"] == "engine.kv"


def _against(metrics, rule):
    return against_improvement(metrics, rule, higher_is_worse)


def _m(delta, ci, floor, sig=False, worse=False, mde=50.0):
    return {"delta_pct": delta, "ci_pct": ci, "floor_pct": floor, "significant": sig, "worse": worse,
            "mde_pct": mde}


@pytest.mark.parametrize("other, expected", [
    # worse at 95 %: interval wholly on the worse side, change beyond the floor taken at 95 %
    (_m(+30.0, [5.0, 60.0], 30.0), ["ttft_p50_s"]),
    # interval reaches no change: no evidence against
    (_m(+30.0, [-2.0, 60.0], 30.0), []),
    # interval on the worse side but the change under the 95 % floor (run-to-run spread explains it)
    (_m(+20.0, [5.0, 40.0], 30.0), []),
    # better too: not against
    (_m(-30.0, [-60.0, -5.0], 30.0), []),
    # a tail with too few requests beyond it is no evidence
    (_m(+90.0, [60.0, 120.0], 30.0, mde=None), []),
])
def test_against_takes_the_interval_and_the_floor_at_95(other, expected):
    better = _m(-80.0, [-90.0, -70.0], 40.0, sig=True)
    assert _against({"tpot_p50_s": better, "ttft_p50_s": other}, DEFAULT_RULE) == expected


def test_against_for_rates_reads_the_lower_side_and_needs_a_significant_improvement():
    better = _m(-80.0, [-90.0, -70.0], 40.0, sig=True)
    fewer_tokens = _m(-39.0, [-56.0, -16.0], 43.7)
    assert _against({"tpot_p50_s": better, "output_tokens_per_s": fewer_tokens}, DEFAULT_RULE) == \
        ["output_tokens_per_s"]
    more_tokens = _m(+39.0, [16.0, 56.0], 43.7)
    assert _against({"tpot_p50_s": better, "output_tokens_per_s": more_tokens}, DEFAULT_RULE) == []
    # nothing significantly better: nothing to be against
    assert _against({"tpot_p50_s": _m(-10.0, [-20.0, 0.5], 40.0), "output_tokens_per_s": fewer_tokens},
                    DEFAULT_RULE) == []
    # a gated regression anywhere: the verdict is a regression, no mixed
    worse = _m(+80.0, [70.0, 90.0], 40.0, sig=True, worse=True)
    assert _against({"tpot_p50_s": better, "e2e_p50_s": worse, "output_tokens_per_s": fewer_tokens},
                    DEFAULT_RULE) == []
