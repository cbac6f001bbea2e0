"""The result store: rows survive reopening, history filters, sessions are recorded."""

from __future__ import annotations

import json
import math

from layerscope.regressions.store import FIGURES, ResultStore, RunRecord


def rec(session: str, version: str, rep: int, ttft: float, **kw) -> RunRecord:
    base = dict(session=session, suite="smoke", suite_digest="abc", started_at=f"2026-01-0{rep}T00:00:00+00:00",
                version=version, version_spec=version, version_kind="git", git_rev="f" * 40, git_dirty=None,
                is_baseline=version == "A", workload="burst", config="default", repetition=rep, status="ok",
                wall_s=1.5, bundle=f"/x/{version}/{rep}",
                figures={"ttft_p50_s": ttft, "output_tokens_per_s": 100.0, "slo": {"ttft_s": 0.5}})
    base.update(kw)
    return RunRecord(**base)


def test_history_accumulates_across_sessions(tmp_path):
    path = tmp_path / "sub" / "results.sqlite"
    with ResultStore(path) as db:
        db.start_session("s1", "smoke", "2026-01-01T00:00:00+00:00", [{"label": "A"}, {"label": "B"}], "/out/s1")
        db.add(rec("s1", "A", 1, 0.05))
        db.add(rec("s1", "B", 1, 0.09))
        db.finish_session("s1", 1, [{"metric": "ttft_p50_s"}])
    with ResultStore(path) as db:  # reopened: the same file, new rows appended
        db.add(rec("s2", "A", 2, 0.06))
        db.add(rec("s2", "A", 3, float("nan"), status="failed", error="exit status 1", bundle=None,
                   figures={}))
        h = db.history(suite="smoke")
        assert list(h["session"]) == ["s1", "s1", "s2", "s2"]
        assert list(h["version"]) == ["A", "B", "A", "A"]
        assert h.loc[1, "ttft_p50_s"] == 0.09 and h.loc[1, "is_baseline"] == 0
        assert math.isnan(h.loc[3, "ttft_p50_s"]) and h.loc[3, "status"] == "failed"
        assert json.loads(h.loc[0, "metrics_json"]) == {"slo": {"ttft_s": 0.5}}
        assert set(FIGURES) <= set(h.columns)
        assert len(db.history(session="s1")) == 2 and len(db.history(workload="other")) == 0
        assert len(db.history(limit=1)) == 1
        s = db.sessions("smoke")
        assert list(s["session"]) == ["s1"] and s.loc[0, "exit_status"] == 1


def test_trend_one_row_per_session_and_version(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as db:
        for session, ttfts in (("s1", (0.04, 0.06, 0.05)), ("s2", (0.07, 0.09, 0.08))):
            for rep, t in enumerate(ttfts, start=1):
                db.add(rec(session, "A", rep, t))
                db.add(rec(session, "B", rep, 2 * t))
        db.add(rec("s2", "B", 4, 9.0, status="failed"))  # failed runs do not count
        t = db.trend("smoke")
        assert list(zip(t["session"], t["version"])) == [("s1", "A"), ("s1", "B"), ("s2", "A"), ("s2", "B")]
        assert list(t["num_runs"]) == [3, 3, 3, 3]
        assert t["ttft_p50_s"].round(6).tolist() == [0.05, 0.1, 0.08, 0.16]
        assert list(db.trend("smoke", num_sessions=1)["session"]) == ["s2", "s2"]
        assert db.trend("other").empty
