"""The overhead bench runs end to end (a tiny workload; the real figures come from its CLI)."""

from __future__ import annotations

from layerscope.probes import bench_overhead


def test_bench_overhead_runs(tiny_model, capsys):
    assert bench_overhead.main(["--model", str(tiny_model), "--requests", "4", "--max-tokens", "4", "--reps", "1",
                                "--prompt-len", "4:8", "--max-num-seqs", "4"]) == 0
    out = capsys.readouterr().out
    for level in ("off", "default", "full"):
        assert f"\n{level} " in out
    assert "cost" in out
