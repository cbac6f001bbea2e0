"""Acceptance, live: a real Prometheus (Debian's, on 127.0.0.1, 1 s scrapes) scraping three servers:
two ``layerscope serve --metrics-dialect vllm`` (the small model) and one real vLLM CPU. Replica B runs
with a fault that slows its forward pass; replica A is restarted on its port with a changed config
(max_num_seqs 1) between two load phases (the rollout). Then, through Prometheus only:

- ``diagnose --prometheus URL --around``: finds A's config change, and names engine.queue and the
  changed key (our server exports its config in ``vllm:cache_config_info``/``layerscope_config_info``);
- ``fleet`` over the first phase names B and model.forward;
- what vLLM's ``cache_config_info`` leaves out (no max_num_seqs, no version) is checked on the real one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml

from layerscope.diagnose.external.fleet import diagnose_around, fleet_report
from layerscope.diagnose.external.prometheus import Prom
from layerscope.testing.servers import start, stop_group, wait_healthy

pytestmark = pytest.mark.slow

FAULT = "model.layer_delay=layers.0.mlp:150"  # ms per forward on replica B
PHASE_S = 45
SEL = '{job="fleet"}'
WORKLOAD = dict(burst_size=8, burst_interval_s=4.0, input_len=48, output_len=16, output_sigma=0.0,
                max_output_len=16, api="completions")
VLLM_PY = Path.home() / ".cache" / "layerscope" / "vllm-venv" / "bin" / "python"


def _ours(model: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "layerscope", "serve", "--model", str(model), "--port", str(port),
            "--metrics-dialect", "vllm", "--bundle", "none", "--served-model-name", "tiny", *extra]


def _prometheus(tmp: Path, targets: list[str], free_port) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("prometheus") or pytest.fail("prometheus not on PATH (apt-get install prometheus)")
    cfg = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
           "scrape_configs": [{"job_name": "fleet", "static_configs": [{"targets": targets}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=open(tmp / "prometheus.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    raise AssertionError((tmp / "prometheus.log").read_text()[-3000:])


def _load(urls: list[str], seconds: float) -> None:
    """Bursts to every server at once, from layerscope's load generator (one thread per server)."""
    from layerscope.regressions.load.loadgen import run_load
    from layerscope.regressions.load.workloads import builtin

    n = int(seconds / WORKLOAD["burst_interval_s"]) * WORKLOAD["burst_size"]
    spec = builtin("burst", num_requests=n, **WORKLOAD)
    errors: list[str] = []

    def one(url: str) -> None:
        res = run_load(url, spec, timeout_s=120)
        bad = [r for r in res.records if not r.ok]
        if len(bad) > n // 4:
            errors.append(f"{url}: {len(bad)} of {n} failed: {bad[0].error}")

    threads = [threading.Thread(target=one, args=(u,)) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, live, small_model):
    tmp = tmp_path_factory.mktemp("prom-live")
    model = small_model  # vLLM's CPU attention has no kernel for the tiny preset's head_dim 16
    py = VLLM_PY if VLLM_PY.exists() else pytest.fail(f"no vLLM venv at {VLLM_PY} (tests/external/conftest.py "
                                                      "vllm_python() installs it)")
    pa, pb = live.free_port(), live.free_port()
    with ExitStack() as stack:
        # the three start together (their start-ups overlap); each waited for, each group stopped on exit
        specs = {"v": (live.vllm_argv(py, model, "--max-num-seqs", "8", "--enforce-eager", "--max-model-len", "512"),
                       tmp / "vllm.log", live.kv_env, 900),
                 "b": (_ours(model, pb, "--fault", FAULT), tmp / "b.log", None, 300),
                 "a1": (_ours(model, pa), tmp / "a1.log", None, 300)}
        procs = {k: start(argv, log, env) for k, (argv, log, env, _) in specs.items()}
        for p in procs.values():
            stack.callback(stop_group, p)
        vurl, burl, aurl = (wait_healthy(specs[k][0], procs[k], specs[k][1], specs[k][3]) for k in ("v", "b", "a1"))
        proc, prom = _prometheus(tmp, [u.removeprefix("http://") for u in (aurl, burl, vurl)], live.free_port)
        stack.callback(stop_group, proc)
        time.sleep(3)
        t0 = time.time()
        _load([aurl, burl, vurl], PHASE_S)
        t1 = time.time()
        stop_group(procs["a1"])  # the rollout: A's first process goes, its port is served again below
        a2 = stack.enter_context(live.server(_ours(model, pa, "--set", "max_num_seqs=1"), tmp / "a2.log",
                                             startup_s=300))
        t_roll = time.time()
        _load([a2, burl, vurl], PHASE_S)
        t2 = time.time()
        time.sleep(3)  # the last scrapes
        vllm_info = httpx.get(vurl + "/metrics").text
        yield {"prom": prom, "a": aurl.removeprefix("http://"), "b": burl.removeprefix("http://"),
               "v": vurl.removeprefix("http://"), "t0": t0, "t1": t1, "t_roll": t_roll, "t2": t2 + 3,
               "vllm_metrics": vllm_info}


def test_rollout_diagnosed_from_prometheus(scenario):
    s = scenario
    mid = (s["t0"] + s["t2"]) / 2
    span = (s["t2"] - s["t0"]) / 2 + 5
    r = diagnose_around(Prom(s["prom"]), SEL, mid - span, mid + span)
    ro = r["rollout"]
    assert ro["replicas"] == [s["a"]], ro
    assert s["t1"] - 5 <= ro["t"] <= s["t_roll"] + 10, (ro, s)
    changed = {k for c in ro["label_changes"] for k in c["changed"]}
    assert "max_num_seqs" in changed, ro["label_changes"]
    # max_num_seqs=1 queues requests and decodes the admitted one faster: a regression, or a trade-off
    # (mixed) when the decode side's gain is significant too; engine.queue is primary either way
    assert r["verdict"] in ("regression", "mixed"), {k: v["delta_pct"] for k, v in r["metrics"].items()}
    assert r["primary"]["layer"] == "engine.queue", r["findings"]
    row = next(c for c in r["config_diff"] if c["key"] == "max_num_seqs")
    assert row["candidate"] == 1 and row["baseline"] != 1 and row["layer"] == "engine.queue"


def test_fleet_names_the_slow_replica_and_its_layer(scenario):
    s = scenario
    r = fleet_report(Prom(s["prom"]), SEL, s["t0"] + 5, s["t1"])
    assert len(r["replicas"]) == 3
    named = {o["replica"]: o for o in r["outliers"]}
    assert s["b"] in named, r["outliers"]
    assert (named[s["b"]]["kind"], named[s["b"]]["layer"]) == ("slow", "model.forward"), named[s["b"]]
    assert s["a"] not in named, named


def test_what_vllm_cache_config_info_leaves_out(scenario):
    from layerscope.diagnose.external.exposition import parse

    info = [x for x in parse(scenario["vllm_metrics"]).samples if x.name == "vllm:cache_config_info"]
    assert info, "vLLM exports vllm:cache_config_info"
    keys = set(info[0].label_dict)
    assert {"block_size", "enable_prefix_caching"} <= keys
    # docs/fleet.md: what a rollout of vLLM cannot show through its metrics
    assert not keys & {"max_num_seqs", "max_num_batched_tokens", "max_model_len", "version"}, sorted(keys)
    print("vllm:cache_config_info labels:", sorted(keys))
