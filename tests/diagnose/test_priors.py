"""The run-to-run priors (diagnose/priors.toml) and the recorded A/A set they were re-measured on.

The A/A set's summary (tests/data/aa_priors/summary.json, from ``python -m layerscope.diagnose.priors``)
is kept apart from the tests that use the priors: no test here diagnoses it, and no other test reads it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from layerscope.diagnose import priors, stats

SUMMARY = Path(__file__).resolve().parents[1] / "data" / "aa_priors" / "summary.json"


def test_every_prior_names_its_source_and_sample_size():
    for table in ("chat", "saturated", "external"):
        for key, v in priors.load()[table].items():
            assert 0 < v["spread"] < 1 and isinstance(v["n_runs"], int) and v["source"], (table, key, v)


def test_the_rule_holds_the_toml_values():
    assert stats.RUN_SPREAD == priors.spreads("chat")
    assert stats.RUN_SPREAD_SATURATED["tpot_p50_s"] == priors.load()["saturated"]["tpot_p50_s"]["spread"]
    assert stats.DEFAULT_RULE.spread("step_s", "p50") == priors.load()["chat"]["step_s"]["spread"]


def test_the_step_prior_is_what_the_recorded_quiet_pairs_give():
    """step_s re-derived from the stored per-pair log ratios: sqrt(mean(d**2) / 2) over the quiet pairs."""
    s = json.loads(SUMMARY.read_text())
    quiet = [p["step_s"] for p in s["pairs"] if p["kind"] == "quiet" and p["step_s"] is not None]
    assert len(quiet) == 4
    got = math.sqrt(sum(d * d for d in quiet) / len(quiet) / 2)
    assert abs(got - priors.load()["chat"]["step_s"]["spread"]) < 5e-4, got
    assert priors.load()["chat"]["step_s"]["n_runs"] == 2 * len(quiet)


def test_estimate_needs_pairs(tmp_path, capsys):
    assert priors.main([str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_the_work_row_priors_are_what_their_recorded_quiet_pairs_give():
    """step_own_s and gateway_queue_s come from an A/A set recorded with the steps' work columns
    (tests/data/aa_priors/work_rows.json: per-pair log ratios, kept apart from the noise matrix)."""
    s = json.loads((Path(__file__).parents[1] / "data" / "aa_priors" / "work_rows.json").read_text())
    quiet = [r for r in s["pairs"] if r["kind"] == "quiet"]
    assert len(quiet) == 4
    for key in ("step_own_s", "gateway_queue_s"):
        got = math.sqrt(sum(r[key] ** 2 for r in quiet) / len(quiet) / 2)
        assert abs(got - priors.load()["chat"][key]["spread"]) < 5e-4, (key, got)
        assert priors.load()["chat"][key]["n_runs"] == 2 * len(quiet)
    assert s["false_alarms"]["software_verdicts"] == 0
