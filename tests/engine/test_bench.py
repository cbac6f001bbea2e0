"""The engine-vs-transformers benchmark script runs end to end on a tiny model."""

from __future__ import annotations

from layerscope.engine import bench


def test_engine_bench_prints_every_figure(capsys):
    rc = bench.main(["--preset", "tiny", "--requests", "6", "--batch", "4", "--max-prompt", "48",
                     "--max-output", "20", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for needle in ("machine peaks:", "matmul", "GB/s", "engine ", "transformers ", "ratio engine / transformers",
                   "decode step at batch 4", "% of roofline", "step phases (median): schedule", "forward alone"):
        assert needle in out, needle
