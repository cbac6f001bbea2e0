"""A 10,000-request bundle shows its overview in < 2 s (benchmarks/tui_open.py measures it; here
in-process, best of three, since other processes share this machine's two cores)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from layerscope.testing.synth import SynthSpec, generate
from benchmarks.tui_open import TARGET_S, time_to_overview

pytestmark = pytest.mark.anyio
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tui_open.py"


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
    out = subprocess.run([sys.executable, str(SCRIPT), "--bundle", big_bundle,
                          "--repeat", "1"], capture_output=True, text=True, timeout=120)
    # exit 1 when the target is missed on a busy machine; the figure prints either way, and the
    # exit status, the verdict printed and the figure must agree
    m = re.search(r"median of 1\): ([0-9.]+) s from app start, [0-9.]+ s from process start  "
                  r"\[target < ([0-9.]+) s: (met|MISSED)\]", out.stdout)
    assert m, (out.stdout, out.stderr)
    app_s, target_s, verdict = float(m[1]), float(m[2]), m[3]
    assert 0 < app_s < 120 and verdict == ("met" if app_s < target_s else "MISSED")
    assert out.returncode == (0 if verdict == "met" else 1), out.stderr
