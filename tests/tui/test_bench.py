"""A 10,000-request bundle shows its overview in < 2 s (diagnose/tui/bench.py measures it; here
in-process, best of three, since other processes share this machine's two cores)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from layerscope.diagnose.synth import SynthSpec, generate
from layerscope.diagnose.tui.bench import TARGET_S, time_to_overview

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def big_bundle(tmp_path_factory):
    return str(generate(SynthSpec(num_requests=10_000, arrival_rate_per_s=80.0),
                        tmp_path_factory.mktemp("bench") / "synth-10k", run_id="synth-10k"))


async def test_ten_thousand_requests_overview_under_two_seconds(big_bundle):
    times = []
    for _ in range(3):
        r = await time_to_overview(big_bundle, size=(160, 50))
        assert r["headline"].startswith("10,000 requests (10,000 finished)")
        times.append(r["app_s"])
        if r["app_s"] < TARGET_S:
            break
    assert min(times) < TARGET_S, f"overview after {times} s"


def test_bench_script_prints_the_figure(big_bundle):
    out = subprocess.run([sys.executable, "-m", "layerscope.diagnose.tui.bench", "--bundle", big_bundle,
                          "--repeat", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr  # 1: the target missed on a busy machine; the figure still prints
    assert "time to overview (median of 1):" in out.stdout and "from process start" in out.stdout
