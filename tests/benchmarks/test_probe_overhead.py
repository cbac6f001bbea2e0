"""The overhead bench runs end to end (a tiny workload; the real figures come from its CLI)."""

from __future__ import annotations

import re

import pytest

from benchmarks import probe_overhead


def test_bench_overhead_runs(tiny_model, capsys):
    assert probe_overhead.main(["--model", str(tiny_model), "--requests", "4", "--max-tokens", "4", "--reps", "2",
                                "--prompt-len", "4:8", "--max-num-seqs", "4", "--levels", "off,default,full,rolling",
                                "--push-interval-s", "0"]) == 0
    out = capsys.readouterr().out
    for level in ("default", "full", "rolling"):
        assert f"\n{level} " in out
    assert "overhead = 1 - level/off" in out and "hooks timed" in out
    assert re.search(r", drain \d+\.\d us", out)  # the timed drain's own figure, not the label


def test_paired_overhead_is_the_mean_of_the_per_rep_ratios():
    mean, half, lo, hi = probe_overhead.paired_overhead([99.0, 98.0, 97.0], [100.0, 100.0, 100.0])
    assert mean == pytest.approx(0.02) and (lo, hi) == (pytest.approx(0.01), pytest.approx(0.03))
    # sd 0.01 over 3 reps: t(2) = 4.303
    assert half == pytest.approx(4.303 * 0.01 / 3 ** 0.5)
