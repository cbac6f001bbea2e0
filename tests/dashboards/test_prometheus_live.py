"""The dashboards against a real Prometheus scraping a real ``layerscope serve``.

Starts ``layerscope serve`` on a tiny model (TP=2 so collectives move, ``--probes full``
so the launch-gap gauge moves, a 16-block KV pool so requests get preempted, gateway
concurrency 2 so the admission queue fills), drives it with a short load (streaming and
non-streaming completions sharing a prompt prefix, plus a few invalid requests so the
error counters have a series), and starts Prometheus on 127.0.0.1 (free port, temp
storage, 1 s scrape interval, the generated rules loaded). Once Prometheus has scraped
the load, every query of every panel of both dashboards is evaluated through
``/api/v1/query`` with the template variables substituted, twice: ``.*`` for every
variable, then the variables' real values (as Grafana would send them, read through the
variables' own ``label_values()`` queries). Every query must be valid PromQL and return
data. The generated alerting/recording rules must evaluate without errors.

Needs Debian's ``prometheus`` package (``scripts/setup.sh --system``); without the
binary the test fails, it does not skip.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from layerscope.dashboards.builder import build_dashboards, iter_queries
from layerscope.dashboards.rules import RULES_FILE, build_rules, render_rules

pytestmark = pytest.mark.slow

RATE_INTERVAL = "10s"  # $__rate_interval: >= 4 scrape intervals of 1 s, like Grafana's
SERVE_ARGS = ["--tp", "2", "--probes", "full", "--set", "num_kv_blocks=16", "--set", "gateway.max_concurrency=2"]
MODEL_NAME = "tiny-llama"
CLIENTS = 4
STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGINT the process group the test started (serve, its replicas and TP workers), then kill."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, timeout), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _start_serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "layerscope", "serve", "--model", str(model_dir), "--port", "0",
           "--served-model-name", MODEL_NAME, *SERVE_ARGS]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True, env=env,
                            start_new_session=True)
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m and not found:
                found.append(m.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not found:
        if proc.poll() is not None:
            raise AssertionError(f"layerscope serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            _stop(proc)
            raise AssertionError(f"layerscope serve did not announce its port in {STARTUP_TIMEOUT_S} s:\n"
                                 f"{log.read_text()[-4000:]}")
        time.sleep(0.2)
    return proc, found[0]


def _start_prometheus(binary: str, tmp: Path, target: str) -> tuple[subprocess.Popen, str]:
    rules = tmp / RULES_FILE
    rules.write_text(render_rules(build_rules()), encoding="utf-8")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "layerscope", "static_configs": [{"targets": [target]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    port = _free_port()
    log = tmp / "prometheus.log"
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop(proc)
            raise AssertionError(f"prometheus not ready in 60 s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


class Load:
    """CLIENTS threads sending completions until stopped; one of them also sends an invalid
    request (n=2 -> 400) every few seconds, so the error counters move."""

    PREFIX = "The quick brown fox jumps over the lazy dog while the observability suite watches. "

    def __init__(self, base_url: str):
        self.base = base_url
        self.stop = threading.Event()
        self.codes: dict[int, int] = {}
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _count(self, code: int) -> None:
        with self.lock:
            self.codes[code] = self.codes.get(code, 0) + 1

    def _client(self, i: int) -> None:
        n = 0
        last_invalid = 0.0
        with httpx.Client(base_url=self.base, timeout=120) as c:
            while not self.stop.is_set():
                n += 1
                body = {"model": MODEL_NAME, "prompt": f"{self.PREFIX}Client {i} request {n}.",
                        "max_tokens": 24 + 8 * (n % 4), "ignore_eos": True, "temperature": 0.0}
                try:
                    if i == 0 and time.monotonic() - last_invalid > 3:
                        last_invalid = time.monotonic()
                        self._count(c.post("/v1/completions", json={**body, "n": 2}).status_code)
                    if n % 2:
                        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            for _ in r.iter_lines():
                                pass
                            self._count(r.status_code)
                    else:
                        self._count(c.post("/v1/completions", json=body).status_code)
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                    time.sleep(0.5)


def _query(prom: str, expr: str) -> dict:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    if r.status_code != 200 or body.get("status") != "success":
        return {"ok": False, "error": body.get("error", r.text), "result": []}
    return {"ok": True, "result": body["data"]["result"]}


def _wait_for(prom: str, expr: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _query(prom, expr)["result"]:
            return
        time.sleep(1)
    raise AssertionError(f"prometheus: `{expr}` returned nothing within {timeout_s} s")


def _substitute(expr: str, variables: dict[str, str]) -> str:
    for name, value in variables.items():
        expr = expr.replace("$" + name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def _grafana_regex_escape(value: str) -> str:
    """A value in a regex inside a PromQL string, as Grafana's Prometheus datasource escapes it:
    regex metacharacters get a backslash, itself escaped in the double-quoted string."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def _variable_values(prom: str, dashboard: dict) -> dict[str, str]:
    """Each template variable's values through its label_values() query, formatted as Grafana
    sends a multi-value selection: (a|b|c), regex-escaped."""
    values: dict[str, str] = {}
    for v in dashboard["templating"]["list"]:
        q = _substitute(v["query"]["query"], values)
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", q)
        assert m, q
        r = httpx.get(f"{prom}/api/v1/series", params={"match[]": m.group(1)}, timeout=30).json()
        assert r["status"] == "success", r
        found = sorted({s[m.group(2)] for s in r["data"] if m.group(2) in s})
        assert found, f"template variable {v['name']}: `{q}` found no values"
        values[v["name"]] = "(" + "|".join(_grafana_regex_escape(x) for x in found) + ")"
    return values


def _evaluate(prom: str, dashboards: dict, variables: dict[str, dict[str, str]] | dict[str, str]):
    rows = []
    for name, d in sorted(dashboards.items()):
        subs = variables[name] if name in variables else variables
        for panel, target in iter_queries(d):
            expr = _substitute(target["expr"], {**subs, "__rate_interval": RATE_INTERVAL})
            res = _query(prom, expr)
            values = [float(s["value"][1]) for s in res["result"]]
            rows.append({"dashboard": name, "panel": panel["title"], "legend": target["legendFormat"], "expr": expr,
                         "ok": res["ok"], "error": res.get("error"), "series": len(values),
                         "finite": any(math.isfinite(x) for x in values)})
    return rows


def test_every_dashboard_query_returns_data_from_a_live_server(prometheus_bin, tmp_path: Path):
    from layerscope.engine.models.create import create_model

    model_dir = tmp_path / "model"
    create_model(model_dir, arch="llama", preset="tiny", seed=0)
    dashboards = build_dashboards()
    serve, base = _start_serve(model_dir, tmp_path / "serve.log")
    prom_proc = None
    try:
        target = base.removeprefix("http://")
        prom_proc, prom = _start_prometheus(prometheus_bin, tmp_path, target)
        with Load(base) as load:
            _wait_for(prom, 'up{job="layerscope"} == 1', 60)
            # enough scrapes under load for rate() over $__rate_interval, then a little more
            _wait_for(prom, "sum(layerscope_generation_tokens_total) > 0", 120)
            _wait_for(prom, f"count_over_time(layerscope_generation_tokens_total[{RATE_INTERVAL}]) >= 8", 60)
            _wait_for(prom, f"sum(rate(layerscope_collective_seconds_count[{RATE_INTERVAL}])) > 0", 60)
            time.sleep(3)
            wildcard = _evaluate(prom, dashboards, {"model_name": ".*", "replica": ".*"})
            real_vars = {name: _variable_values(prom, d) for name, d in dashboards.items()}
            real = _evaluate(prom, dashboards, real_vars)
            rules = httpx.get(f"{prom}/api/v1/rules", timeout=30).json()["data"]["groups"]
        assert not load.failures, load.failures[:5]
        assert load.codes.get(200, 0) > 0 and load.codes.get(400, 0) > 0, load.codes
    finally:
        if prom_proc is not None:
            _stop(prom_proc)
        _stop(serve)

    for label, rows in (("variables = .*", wildcard), (f"variables = real values {real_vars}", real)):
        with_data = [r for r in rows if r["ok"] and r["series"]]
        finite = [r for r in with_data if r["finite"]]
        print(f"\n{len(with_data)} of {len(rows)} queries returned data ({label}); "
              f"{len(finite)} with a finite value")
        for r in rows:
            if not (r["ok"] and r["series"] and r["finite"]):
                print(f"  {'INVALID' if not r['ok'] else 'NO DATA' if not r['series'] else 'NaN only'}: "
                      f"{r['dashboard']} / {r['panel']} / {r['legend']}: {r['expr']}"
                      + (f" -> {r['error']}" if r["error"] else ""))
    invalid = [(r["panel"], r["expr"], r["error"]) for r in wildcard + real if not r["ok"]]
    assert not invalid, f"invalid PromQL: {invalid}"
    empty = [(r["dashboard"], r["panel"], r["legend"], r["expr"]) for r in wildcard + real if not r["series"]]
    assert not empty, f"queries without data: {empty}"

    bad_rules = [(g["name"], r["name"], r.get("lastError")) for g in rules for r in g["rules"]
                 if r.get("health") != "ok"]
    assert not bad_rules, bad_rules
    n_rules = sum(len(g["rules"]) for g in build_rules()["groups"])
    assert sum(len(g["rules"]) for g in rules) == n_rules
