"""The fleet's outlier rule and pool saturation on replica tables built here (the rows
``prometheus.replica_table`` returns), where the answer is known by construction."""

from __future__ import annotations

import pandas as pd

from layerscope.diagnose.external.fleet import _name, outlier_metrics, pools


def _table(n: int = 6, overrides: dict | None = None) -> pd.DataFrame:
    rows = []
    for i in range(n):
        rows.append({"replica": f"r{i}", "up": 1.0, "requests_per_s": 1.0 + 0.02 * i, "output_tokens_per_s": 200.0 + i,
                     "queue_mean_s": 0.05 + 0.001 * i, "prefill_mean_s": 0.08, "decode_mean_s": 1.2 + 0.01 * i,
                     "tpot_mean_s": 0.08, "ttft_p50_s": 0.13, "e2e_mean_s": 1.33, "kv_usage_mean": 0.5,
                     "waiting_mean": 1.0, "running_mean": 4.0, "preemptions": 0.0, "error_rate": 0.0})
    t = pd.DataFrame(rows)
    for (rep, col), v in (overrides or {}).items():
        t.loc[t["replica"] == rep, col] = v
    return t


def test_quiet_fleet_has_no_outlier_and_one_replica_is_named_with_its_layer():
    assert outlier_metrics(_table()) == {}
    t = _table(overrides={("r3", "queue_mean_s"): 0.9, ("r3", "e2e_mean_s"): 2.2, ("r3", "kv_usage_mean"): 0.97,
                  ("r3", "preemptions"): 40.0})
    flags = outlier_metrics(t)
    assert set(flags) == {"r3"}
    named = _name("r3", flags["r3"], t.set_index("replica").loc["r3"], t.median(numeric_only=True))
    assert (named["kind"], named["layer"]) == ("slow", "engine.kv")  # waits because its KV cache is full


def test_lower_is_better_is_not_an_outlier():
    t = _table(overrides={("r1", "decode_mean_s"): 0.3, ("r1", "e2e_mean_s"): 0.45})
    assert outlier_metrics(t) == {}


def test_one_pool_saturated_while_the_other_idles():
    t = _table(8)
    t["pool"] = ["prefill"] * 4 + ["decode"] * 4
    t.loc[t["pool"] == "prefill", ["kv_usage_mean", "waiting_mean"]] = [0.95, 12.0]
    t.loc[t["pool"] == "decode", ["kv_usage_mean", "waiting_mean"]] = [0.2, 0.0]
    got = {p["pool"]: p for p in pools(t)}
    assert got["prefill"]["saturated"] and got["prefill"]["layer"] == "engine.kv"
    assert got["prefill"]["while_idle"] == ["decode"] and not got["decode"]["saturated"]
    t.loc[t["pool"] == "decode", ["kv_usage_mean", "waiting_mean"]] = [0.95, 12.0]
    assert not any(p["saturated"] for p in pools(t))  # both busy: the fleet is short, not one pool
