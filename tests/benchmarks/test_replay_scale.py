"""benchmarks/replay_scale.py keeps working (a small run; its figures come from the script itself,
docs/replay.md): bundles with the step loop's wait columns split over four players, 16 replays."""

from __future__ import annotations

import sys

from benchmarks import replay_scale


def test_replay_scale_runs_small(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["replay_scale.py", "--out", str(tmp_path), "--requests", "200"])
    assert replay_scale.main() == 0
    out = capsys.readouterr().out
    assert "full split (16 replays over config, step_cost, cpu_wait, front" in out
    assert "replay of the run + full split" in out
