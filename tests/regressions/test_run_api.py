"""The run API (layerscope.run / bench / create_model) and the package directions around it:
the client layer (regressions/load) imports no engine, the gateway never imports it, and the
regressions run things through the run API, not the engine's or the gateway's internals."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import layerscope

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_the_client_layer_imports_no_engine():
    code = ("import sys, layerscope.regressions.load.loadgen, layerscope.regressions.load.workloads; "
            "print(sorted(m for m in sys.modules if m.startswith('layerscope.engine') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_engine_never_imports_the_client_layer():
    for f in (ROOT / "engine").rglob("*.py"):
        assert not {m for m in _imports(f) if m.startswith("layerscope.regressions")}, f


def test_regressions_run_through_the_run_api():
    # suites validate configs against the engine's config and read the architecture registry
    allowed = {"layerscope.engine.config", "layerscope.engine.models.registry", "layerscope.engine.models"}
    for f in (ROOT / "regressions").rglob("*.py"):
        engine = {m for m in _imports(f) if m.startswith("layerscope.engine")} - allowed
        assert not engine, (f, engine)
    assert "layerscope.api" in _imports(ROOT / "regressions" / "fault_matrix.py")


def test_run_writes_one_bundle_with_what_it_was_given(tiny_model, tmp_path):
    out = layerscope.run(model=tiny_model, workload="chat", out=tmp_path / "r",
                         workload_params={"num_requests": 6, "rate": 0, "seed": 3},
                         config={"num_kv_blocks": 256, "gateway.max_queue": 64},
                         faults={"output.delay_ms": 1})
    assert out == tmp_path / "r"
    m = json.loads((out / "manifest.json").read_text())
    assert m["command"][:8] == ["layerscope", "run", "--model", str(tiny_model), "--workload", "chat", "--out",
                                str(out)]
    assert ["--set", "num_kv_blocks=256"] == m["command"][8:10] and "--fault" in m["command"]
    assert m["config"]["num_kv_blocks"] == 256 and m["config"]["gateway"]["max_queue"] == 64
    assert m["faults"] == {"output.delay_ms": 1.0}
    assert m["workload"]["num_requests"] == 6 and m["workload"]["seed"] == 3
    assert m["summary"]["client"]["requests_ok"] == 6
    from layerscope.probes.bundle import read_bundle

    rq = read_bundle(out, full=True).requests
    assert len(rq) == 6 and rq.ttft_s.notna().all() and rq.client_ttft_s.notna().all()


def test_run_refuses_bad_arguments_before_starting(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="off, default, full"):
        layerscope.run(model=tiny_model, workload="chat", out=tmp_path / "a", probes="most")
    with pytest.raises(ValueError, match="kernels, pyspy"):
        layerscope.run(model=tiny_model, workload="chat", out=tmp_path / "a", profile="gpu")
    with pytest.raises(ValueError, match="unknown workload 'chit'; built-in: chat"):
        layerscope.run(model=tiny_model, workload="chit", out=tmp_path / "a")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="overwrite"):
        layerscope.run(model=tiny_model, workload="chat", out=tmp_path / "full")
    with pytest.raises(ValueError, match="max_num_seqs"):  # an unknown key names the known ones
        layerscope.run(model=tiny_model, workload="chat", out=tmp_path / "a", config={"max_seqs": 2})
    with pytest.raises(ValueError, match="unknown fault 'gateway.dealy_ms'; faults: gateway.delay_ms"):
        layerscope.run(model=tiny_model, workload="chat", out=tmp_path / "a", faults=["gateway.dealy_ms=5"])
    assert not (tmp_path / "a").exists()


def test_demo_creates_the_model_runs_and_diagnoses(tmp_path, capsys):
    from layerscope.cli import main

    assert main(["demo", "--model", str(tmp_path / "m"), "--runs", str(tmp_path / "runs")]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("demo-chat-") and (run / "manifest.json").is_file()
    assert (tmp_path / "m" / "config.json").is_file()
    text = capsys.readouterr().out
    assert f"layerscope tui {run}" in text and "TTFT" in text


def test_a_replica_that_served_nothing_is_still_in_the_bundle(tiny_model, tmp_path):
    """Every request routed to replica 0: the bundle still lists replica 1 (manifest summary.replicas),
    so diagnose sees two replicas, one of them with all the traffic (a router collapse is visible)."""
    from layerscope.diagnose.analysis import RunAnalysis

    out = layerscope.run(model=tiny_model, workload="chat", out=tmp_path / "r", replicas=2,
                         workload_params={"num_requests": 6, "rate": 0, "seed": 3}, faults={"router.skew": 1.0})
    m = json.loads((out / "manifest.json").read_text())
    assert m["summary"]["replicas"] == ["0", "1"], m["summary"]
    a = RunAnalysis(out)
    assert set(a.run.requests["replica"].astype(str)) == {"0"}
    assert a.num_replicas == 2 and a.indicators["replica_share_max"] == 2.0
