"""Gate, attribution and reports on synthetic bundles (diagnose's simulator, no engine).

The simulator moves time in one layer per knob, so the expected verdicts are known:
max_num_seqs 64 -> 4 under a bursty load queues requests in the engine (engine.queue);
the same spec with other noise seeds is an A/A pair.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from layerscope.testing.synth import SynthSpec, generate
from layerscope.regressions.gate import analyse
from layerscope.regressions.regress import RegressResult, _measure, plan_runs
from layerscope.regressions.report import terminal_table, write_reports
from layerscope.regressions.suite import load_suite
from layerscope.regressions.versions import Version


def synthetic_result(tmp_path: Path, candidate: dict, per_rep: dict[int, dict] | None = None) -> RegressResult:
    """Baseline and candidate over the smoke suite's plan, each run a simulated bundle."""
    suite = load_suite("smoke")
    versions = [Version("base", "main", "git", rev="a" * 40), Version("cand", "topic", "git", rev="b" * 40)]
    session_dir = tmp_path / "session"
    session_dir.mkdir()
    runs = plan_runs(suite, versions, session_dir / "runs")
    result = RegressResult(suite, "session", session_dir, tmp_path / "results.sqlite", versions, runs)
    for i, r in enumerate(runs):
        kw = {}
        if r.version.label == "cand":
            kw = {**candidate, **(per_rep or {}).get(r.repetition, {})}
        spec = SynthSpec(num_requests=120, seed=0, noise_seed=100 + i, arrival_rate_per_s=60.0, **kw)
        generate(spec, r.bundle, run_id=r.name.replace("/", "-"))
        _measure(r, result)
        r.wall_s = 1.0
    analyse(result)
    return result


@pytest.fixture(scope="module")
def regressed(tmp_path_factory) -> RegressResult:
    result = synthetic_result(tmp_path_factory.mktemp("regressed"), {"max_num_seqs": 4})
    write_reports(result)
    return result


def test_plan_interleaves_repetitions(regressed):
    names = [(r.version.label, r.repetition) for r in regressed.runs]
    assert names == [("base", 1), ("cand", 1), ("cand", 2), ("base", 2), ("base", 3), ("cand", 3)]


def test_regression_is_gated_and_attributed(regressed):
    assert regressed.exit_status == 1
    metrics = {r["metric"] for r in regressed.regressions}
    assert "ttft_p50_s" in metrics
    r = next(r for r in regressed.regressions if r["metric"] == "ttft_p50_s")
    assert r["layer"] == "engine.queue"
    assert r["delta_pct"] > r["threshold_pct"] == 100
    assert "max_num_seqs 64 -> 4 (default -> set)" in r["config_changes"]  # the simulator sets it
    g = regressed.cells[0]["comparisons"]["cand"]["ttft_p50_s"]
    assert g["status"] == "regressed" and g["consistent"] and g["significant"]
    diag = regressed.cells[0]["diagnoses"]["cand"]
    assert diag["verdict"] == "regression" and diag["primary"]["layer"] == "engine.queue"
    diff = {d["key"]: d for d in regressed.config_diffs["cand"]}
    assert (diff["max_num_seqs"]["baseline"], diff["max_num_seqs"]["candidate"]) == (64, 4)


def test_reports_name_metric_layer_and_change(regressed):
    d = regressed.session_dir
    md = (d / "report.md").read_text()
    assert "REGRESSION (exit 1)" in md
    assert "regressed TTFT p50" in md and "engine.queue" in md
    assert "| config | max_num_seqs | 64 | 4 | engine.queue | default -> set |" in md
    html = (d / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "<script" not in html
    for src in ("plots/metrics_burst_default.png", "plots/cdf_burst_default.png"):
        assert f"src='{src}'" in html
        assert (d / src).stat().st_size > 10_000
    data = json.loads((d / "result.json").read_text())
    assert data["schema"] == "layerscope.regress/1" and data["exit_status"] == 1
    assert {r["metric"] for r in data["regressions"]} == {r["metric"] for r in regressed.regressions}
    assert len(data["runs"]) == 6 and all(r["status"] == "ok" for r in data["runs"])


def test_terminal_table(regressed):
    console = Console(width=160, record=True, color_system=None)
    console.print(terminal_table(regressed))
    text = console.export_text()
    assert "base (baseline)" in text and "REGRESSED" in text and "TTFT p50" in text
    assert "exit 1" in text


def test_same_version_twice_passes(tmp_path):
    result = synthetic_result(tmp_path, {})
    assert result.exit_status == 0 and result.regressions == [] and result.failures == []
    statuses = {g["status"] for g in result.cells[0]["comparisons"]["cand"].values()}
    assert "regressed" not in statuses
    assert [d for d in result.config_diffs["cand"] if d["kind"] == "config"] == []
    # an unchanged metric is reported as not shown, with the rise the repetitions could have seen
    console = Console(width=200, record=True, color_system=None)
    console.print(terminal_table(result))
    text = console.export_text()
    unchanged = [g for g in result.cells[0]["comparisons"]["cand"].values()
                 if g["status"] == "unchanged" and g.get("mde_pct") is not None]
    assert unchanged and f"not shown (MDE {unchanged[0]['mde_pct']:.0f}%)" in text, text
    assert " same " not in text


def test_one_slow_repetition_is_not_a_regression(tmp_path):
    """A whole run slowed by the machine (every step 3x) in one repetition: the pooled
    figures may move, but the repetitions disagree, so the gate does not fail."""
    result = synthetic_result(tmp_path, {}, per_rep={2: {"hardware_slowdown": 3.0}})
    assert result.exit_status == 0, result.regressions
    gates = result.cells[0]["comparisons"]["cand"]
    assert not any(g["status"] == "regressed" for g in gates.values())
    tail = gates["ttft_p99_s"]  # pooled: significantly worse, far beyond its threshold ...
    assert tail["worse"] and tail["regression_pct"] > tail["threshold_pct"]
    assert not tail["consistent"] and tail["status"] == "worse"  # ... but only one repetition says so
