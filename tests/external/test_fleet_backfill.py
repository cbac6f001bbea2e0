"""``diagnose --prometheus``, ``fleet`` and ``import prometheus`` against a real Prometheus whose TSDB
was backfilled by ``promtool`` with a synthetic vLLM fleet (benchmarks/fleet_scale.py's model: a
rollout of max_num_seqs 256 -> 64 and version 0.10.1 -> 0.11.0 that raises queue time; over the
last part one replica decodes 3x slower, one is stuck, one gets 3x the requests). Also the
errors (unreachable URL, a server that is not Prometheus, an empty selector), basic auth and TLS
with Prometheus' own web config.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest

from layerscope.cli import main
from layerscope.diagnose.external.fleet import diagnose_around, diagnose_windows, fleet_report, import_prometheus
from layerscope.diagnose.external.prometheus import Prom, PrometheusError
from layerscope.testing.servers import stop_group

ROOT = Path(__file__).resolve().parents[2]
SEL = '{job="vllm"}'


def _bench():
    spec = importlib.util.spec_from_file_location("fleet_scale", ROOT / "benchmarks" / "fleet_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, prometheus_bin, promtool):
    fs = _bench()
    tmp = tmp_path_factory.mktemp("fleet")
    end = int(time.time()) // 3600 * 3600 - 3600  # inside the retention Prometheus keeps
    start = end - 12 * 3600
    model = fs.fleet_model(8, start, end, 60)
    tsdb, _ = fs.backfill(model, tmp, promtool)
    proc, url = fs.start_prometheus(prometheus_bin, tsdb, tmp)
    try:
        yield {"url": url, "start": start, "end": end, "model": model, "tsdb": tsdb, "tmp": tmp, "fs": fs}
    finally:
        stop_group(proc, 30)


@pytest.fixture(scope="module")
def prometheus_bin():
    import shutil

    return shutil.which("prometheus") or pytest.fail("prometheus not on PATH (apt-get install prometheus)")


@pytest.fixture(scope="module")
def promtool():
    import shutil

    return shutil.which("promtool") or pytest.fail("promtool not on PATH (apt-get install prometheus)")


def test_rollout_found_and_diagnosed(fleet):
    m = fleet["model"]
    r = diagnose_around(Prom(fleet["url"]), SEL, fleet["start"], fleet["end"])
    ro = r["rollout"]
    assert m["roll"] <= ro["t"] <= m["roll"] + 1800, ro
    assert ro["found_by"].startswith("info labels changed and the fleet's latency stepped")
    assert len(ro["replicas"]) == 8
    assert r["verdict"] == "regression"
    assert r["primary"] == {"metric": "server_queue_time_mean_s", "layer": "engine.queue"}
    keys = {c["key"]: c for c in r["config_diff"]}
    assert (keys["max_num_seqs"]["baseline"], keys["max_num_seqs"]["candidate"]) == (256, 64)
    assert keys["max_num_seqs"]["layer"] == "engine.queue" and keys["max_num_seqs"]["consistent"] is True
    assert (keys["vllm.version"]["baseline"], keys["vllm.version"]["candidate"]) == ("0.10.1", "0.11.0")
    q = r["metrics"]["server_queue_time_mean_s"]
    assert q["baseline"] == pytest.approx(0.05, rel=0.1) and q["candidate"] == pytest.approx(0.40, rel=0.1)


def test_same_windows_no_change(fleet):
    """Two windows before the rollout: no verdict (the rule can say no)."""
    roll, s = fleet["model"]["roll"], fleet["start"]
    r = diagnose_windows(Prom(fleet["url"]), SEL, (s, s + 3 * 3600), (s + 3 * 3600, roll - 600))
    assert r["verdict"] == "no_change", [(k, v["delta_pct"]) for k, v in r["metrics"].items() if v["significant"]]
    assert r["config_diff"] == []


def test_fleet_names_outliers_and_layers(fleet):
    m = fleet["model"]
    r = fleet_report(Prom(fleet["url"]), SEL, m["last_day"] + 600, fleet["end"])
    got = {o["replica"]: (o["kind"], o["layer"]) for o in r["outliers"]}
    assert got == {m["slow"]: ("slow", "model.forward"), m["stuck"]: ("stuck", "engine.schedule"),
                   m["skew"]: ("routing_skew", "gateway.route")}
    assert len(r["replicas"]) == 8
    # a window that starts before it stalled: fewer tokens, its queue standing out: still stuck
    part = {o["replica"]: o for o in fleet_report(Prom(fleet["url"]), SEL, m["last_day"] - 1800, fleet["end"])["outliers"]}
    assert part[m["stuck"]]["kind"] == "stuck" and "requests waiting" in part[m["stuck"]]["message"]
    # before the faults: nobody stands out
    quiet = fleet_report(Prom(fleet["url"]), SEL, fleet["start"], m["roll"] - 600)
    assert quiet["outliers"] == []


def test_cli_import_diagnose_fleet(fleet, tmp_path, capsys):
    s, e = fleet["start"], fleet["end"]
    assert main(["import", "prometheus", fleet["url"], "--selector", SEL, "--window", f"{s}..{e}",
                 "--out", str(tmp_path / "b")]) == 0
    reps = pd.read_parquet(tmp_path / "b" / "replicas.parquet")
    assert sorted(reps["replica"]) == sorted(fleet["model"]["names"])
    man = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert man["engine"]["family"] == "vllm" and man["engine"]["distinct_configs"] == 1
    capsys.readouterr()
    assert main(["diagnose", str(tmp_path / "b"), "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["server_split"]["queue_time_count"] > 1000
    assert main(["diagnose", "--prometheus", fleet["url"], "--selector", SEL, "--around", "6h",
                 "--at", str((s + e) // 2 + 3600)]) == 0
    out = capsys.readouterr().out
    assert "rollout at" in out and "max_num_seqs 256 -> 64" in out and "engine.queue" in out
    assert main(["fleet", "--prometheus", fleet["url"], "--selector", SEL, "--window",
                 f"{fleet['model']['last_day'] + 600}..{e}"]) == 0
    out = capsys.readouterr().out
    assert f"{fleet['model']['stuck']} is stuck" in out and "routing skew" in out


def test_errors_name_what_exists(fleet, tmp_path):
    s, e = fleet["start"], fleet["end"]
    with pytest.raises(PrometheusError, match=r"no series match \{job=\"nope\"\}.*jobs with data then: vllm"):
        fleet_report(Prom(fleet["url"]), '{job="nope"}', s, e)
    with pytest.raises(PrometheusError, match="cannot reach Prometheus at http://127.0.0.1:1"):
        fleet_report(Prom("http://127.0.0.1:1", timeout_s=5), SEL, s, e)
    with pytest.raises(PrometheusError, match="expected label matchers in braces"):
        fleet_report(Prom(fleet["url"]), 'job="vllm"', s, e)
    # a real HTTP server that is not Prometheus
    (tmp_path / "index.html").write_text("<html>hello</html>")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(PrometheusError, match="not the Prometheus HTTP API's JSON"):
            import_prometheus(Prom(f"http://127.0.0.1:{httpd.server_port}"), SEL, s, e, tmp_path / "x")
    finally:
        httpd.shutdown()
    assert main(["fleet", "--prometheus", fleet["url"], "--window", f"{e}..{s}"]) == 2


def _bcrypt(pw: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        return crypt.crypt(pw, crypt.mksalt(crypt.METHOD_BLOWFISH))


def test_basic_auth_and_tls(fleet, tmp_path, prometheus_bin):
    fs = fleet["fs"]
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                   f"basic_auth_users:\n  alice: '{_bcrypt('s3cret')}'\n")
    tsdb = tmp_path / "tsdb"
    subprocess.run(["cp", "-r", str(fleet["tsdb"]), str(tsdb)], check=True)
    proc, url = fs.start_prometheus(prometheus_bin, tsdb, tmp_path, web, {"verify": False, "auth": ("alice", "s3cret")})
    try:
        s, e = fleet["start"], fleet["end"]
        assert url.startswith("https://")
        r = fleet_report(Prom(url, basic=("alice", "s3cret"), verify=str(cert)), SEL, s, e)
        assert len(r["replicas"]) == 8
        with pytest.raises(PrometheusError, match="HTTP 401"):
            fleet_report(Prom(url, basic=("alice", "wrong"), verify=str(cert)), SEL, s, e)
        with pytest.raises(PrometheusError, match="HTTP 401"):
            fleet_report(Prom(url, bearer="tok", verify=False), SEL, s, e)
        with pytest.raises(PrometheusError, match="cannot reach Prometheus.*CERTIFICATE_VERIFY_FAILED"):
            fleet_report(Prom(url, basic=("alice", "s3cret")), SEL, s, e)
    finally:
        stop_group(proc, 30)


def test_fleet_tui_screen(fleet):
    import asyncio

    from textual.widgets import DataTable, Static

    from layerscope.diagnose.tui.fleet_screen import FleetApp, FleetScreen

    m = fleet["model"]
    report = fleet_report(Prom(fleet["url"]), SEL, m["last_day"] + 600, fleet["end"])

    async def drive() -> tuple[list[str], str, str]:
        app = FleetApp(report)
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            assert isinstance(app.screen, FleetScreen)
            table = app.screen.query_one("#fleet-table", DataTable)
            keys = [r.value for r in table.rows]
            first = str(app.screen.query_one("#fleet-detail", Static).render())
            await pilot.press("down", "down", "down")
            fourth = str(app.screen.query_one("#fleet-detail", Static).render())
            return keys, first, fourth

    keys, first, fourth = asyncio.run(drive())
    outliers = sorted(o["replica"] for o in report["outliers"])
    assert keys[:3] == outliers and keys[-1] == "__median__" and len(keys) == 9
    assert first.startswith(report["outliers"][0]["message"])
    assert fourth == f"{keys[3]}: within the fleet on every metric"
