"""The kernel bench runs end to end (quick shapes, Triton interpreter on CPU)."""

from __future__ import annotations

import pytest

from benchmarks import kernel_bench as bench  # the benchmarks/ script (tests/conftest.py puts it on the path)
from layerscope.kernels import cpu_native
from layerscope.kernels.dispatch import KERNEL_NAMES


def test_bench_quick_runs_every_kernel_and_passes(capsys):
    rc = bench.main(["--quick", "--device", "cpu", "--reps", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = out[out.index("kernel "):]
    for name in KERNEL_NAMES:
        assert f"\n{name} " in table, name
    assert "FAIL" not in out
    assert "triton_ms" in table and "GB/s" in table


def test_bench_subset_and_unknown_kernel(capsys):
    assert bench.main(["--quick", "--device", "cpu", "--reps", "1", "--dtype", "fp16",
                       "--kernels", "rms_norm,write_kv"]) == 0
    out = capsys.readouterr().out
    assert "rms_norm" in out and "decode_attention" not in out
    assert bench.main(["--quick", "--device", "cpu", "--kernels", "nope"]) == 2


@pytest.mark.skipif(not cpu_native.available(), reason="no C compiler to build the native kernels")
def test_bench_native_cpu_kernels(capsys):
    assert bench.main(["--impl", "cpu", "--quick", "--reps", "2", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("kernel "):]
    for name in KERNEL_NAMES:
        assert f"\n{name} " in table, name
    assert "cpu_ms" in table and "torch/cpu" in table and "FAIL" not in out
