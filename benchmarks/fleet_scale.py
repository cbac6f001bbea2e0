"""A fleet at scale in a real Prometheus: a rollout diagnosed and the outliers found, timed.

``python benchmarks/fleet_scale.py [--replicas 500] [--days 7] [--interval 900]`` writes a
synthetic vLLM fleet as OpenMetrics (per replica, 37 series: e2e/queue/decode histograms with
vLLM's bucket bounds thinned to 8, token and request counters, running/waiting/KV gauges, ``up``,
``vllm:cache_config_info``), backfills it with ``promtool tsdb create-blocks-from openmetrics``,
starts Prometheus on that TSDB on 127.0.0.1, then times two commands, each in its own process:
``layerscope diagnose --prometheus URL --around`` (find the rollout, diagnose it) and
``layerscope fleet`` over the last day. Prints wall time and peak RSS of each (ours, not
Prometheus's). The fleet: a rollout at 5/7 of the span (max_num_seqs 256 -> 64 and the version,
replica by replica over 30 min) that raises queue time; over the last day one replica decodes 3x
slower, one is stuck (requests waiting, no tokens), one gets 3x the request rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from layerscope.testing.servers import free_port, stop_group

BOUNDS = (0.1, 0.3, 1.0, 2.5, 10.0, 60.0, 7680.0, float("inf"))  # vLLM's request-latency bounds, thinned
JOB = "vllm"


def _hist_series(name: str, labels: str, n: np.ndarray, mean: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Cumulative histogram series of exponentially distributed latencies (``mean`` per interval)."""
    out = []
    for b in BOUNDS:
        frac = np.ones_like(mean) if np.isinf(b) else 1 - np.exp(-b / np.maximum(mean, 1e-9))
        out.append((f'{name}_bucket{{{labels},le="{"+Inf" if np.isinf(b) else repr(b)}"}}', np.cumsum(n * frac)))
    return out + [(f"{name}_sum{{{labels}}}", np.cumsum(n * mean)), (f"{name}_count{{{labels}}}", np.cumsum(n))]


def fleet_model(replicas: int, start: int, end: int, interval: int, seed: int = 0) -> dict:
    """Per replica arrays over the sample times, and what was injected (the answers)."""
    rng = np.random.default_rng(seed)
    ts = np.arange(start, end + 1, interval)
    span = end - start
    roll = start + int(span * 5 / 7)
    last_day = max(end - 86400, roll + (end - roll) // 2)
    names = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(replicas)]
    slow, stuck, skew = names[min(17, replicas - 1)], names[min(42, replicas - 2)], names[min(99, replicas - 3)]
    out = {"ts": ts, "roll": roll, "last_day": last_day, "names": names, "slow": slow, "stuck": stuck, "skew": skew,
           "replicas": {}}
    for i, name in enumerate(names):
        at = roll + int(rng.uniform(0, 1800))  # a rolling restart over 30 min
        base = rng.uniform(0.9, 1.1)
        rate = np.where((name == skew) & (ts >= last_day), 3 * base, base)  # requests/s
        after = ts >= at
        queue = np.where(after, 0.40, 0.05) * rng.uniform(0.9, 1.1, len(ts))
        prefill = 0.08 * rng.uniform(0.9, 1.1, len(ts))
        decode = 1.2 * rng.uniform(0.9, 1.1, len(ts)) * np.where((name == slow) & (ts >= last_day), 3.0, 1.0)
        n = rate * interval * rng.uniform(0.95, 1.05, len(ts))
        waiting = np.where(after, 4.0, 0.3) * rng.uniform(0.5, 1.5, len(ts))
        if name == stuck:
            gone = ts >= last_day
            n = np.where(gone, 0.0, n)
            waiting = np.where(gone, 30.0, waiting)
        out["replicas"][name] = {"at": at, "n": n, "queue": queue, "prefill": prefill, "decode": decode,
                                 "waiting": waiting, "tokens": n * 200, "kv": np.clip(0.3 + 0.05 * waiting, 0, 1)}
    return out


def families(model: dict) -> list[tuple[str, str, list[tuple[str, np.ndarray]]]]:
    """(family, type, [(sample name with labels, values over the model's times; NaN: absent)])."""
    ts, reps = model["ts"], model["replicas"]
    lab = {name: f'instance="{name}",job="{JOB}"' for name in reps}
    out = []
    for fam, key in (("vllm:e2e_request_latency_seconds", None), ("vllm:request_queue_time_seconds", "queue"),
                     ("vllm:request_decode_time_seconds", "decode")):
        out.append((fam, "histogram", [x for name, r in reps.items() for x in _hist_series(
            fam, lab[name], r["n"], r["queue"] + r["prefill"] + r["decode"] if key is None else r[key])]))
    for fam, key in (("vllm:generation_tokens", "tokens"), ("vllm:request_success", "n")):
        out.append((fam, "counter", [(f"{fam}_total{{{lab[name]}}}", np.cumsum(r[key])) for name, r in reps.items()]))
    for fam, fn in (("vllm:num_requests_waiting", lambda r: r["waiting"]),
                    ("vllm:num_requests_running", lambda r: np.minimum(8.0, 2 + r["waiting"])),
                    ("vllm:kv_cache_usage_perc", lambda r: r["kv"]), ("up", lambda r: np.ones(len(ts)))):
        out.append((fam, "gauge", [(f"{fam}{{{lab[name]}}}", fn(r)) for name, r in reps.items()]))
    info = []
    for name, r in reps.items():
        for seqs, ver, keep in (("256", "0.10.1", ts < r["at"]), ("64", "0.11.0", ts >= r["at"])):
            info.append((f'vllm:cache_config_info{{block_size="16",{lab[name]},max_num_seqs="{seqs}",version="{ver}"}}',
                         np.where(keep, 1.0, np.nan)))
    out.append(("vllm:cache_config_info", "gauge", info))
    return out


def write_openmetrics(model: dict, out: Path, block_s: int = 7200) -> list[tuple[Path, int]]:
    """One OpenMetrics file per 2 h block (promtool reads its whole input once per block it
    writes: one file for 7 days was read 84 times), family by family, time ascending."""
    ts, fams = model["ts"], families(model)
    files = []
    for lo in range(int(ts[0]) // block_s * block_s, int(ts[-1]) + 1, block_s):
        idx = np.nonzero((ts >= lo) & (ts < lo + block_s))[0]
        if not len(idx):
            continue
        path, lines = out / f"block-{lo}.om", 0
        times = ts[idx].tolist()
        with open(path, "w") as f:
            for fam, kind, series in fams:
                f.write(f"# TYPE {fam} {kind}\n")
                for sample, values in series:
                    rows = [f"{sample} {v:.4f} {t}" for t, v in zip(times, values[idx].tolist()) if v == v]
                    if rows:
                        f.write("\n".join(rows) + "\n")
                        lines += len(rows)
            f.write("# EOF\n")
        files.append((path, lines))
    return files


def backfill(model: dict, tmp: Path, promtool: str, jobs: int = 2) -> tuple[Path, dict]:
    from concurrent.futures import ThreadPoolExecutor

    tsdb, om = tmp / "tsdb", tmp / "om"
    om.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    files = write_openmetrics(model, om)
    t1 = time.perf_counter()

    def one(path: Path) -> None:
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(path), str(tsdb)],
                       check=True, capture_output=True)
        path.unlink()

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, [p for p, _ in files]))
    t2 = time.perf_counter()
    return tsdb, {"samples": sum(n for _, n in files), "files": len(files), "write_s": t1 - t0, "promtool_s": t2 - t1}


def start_prometheus(binary: str, tsdb: Path, tmp: Path, web_config: Path | None = None,
                     ready: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Prometheus on 127.0.0.1 over ``tsdb``; ``web_config``: its TLS / basic-auth file, ``ready``:
    httpx.get keyword arguments that pass it (auth, verify)."""
    port = free_port()
    cfg = tmp / "prometheus.yml"
    cfg.write_text("global: {scrape_interval: 1m}\nscrape_configs: []\n")
    log = open(tmp / "prometheus.log", "wb")
    web = [f"--web.config.file={web_config}"] if web_config else []
    proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tsdb}", *web,
                             "--storage.tsdb.retention.time=30d", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"{'https' if web_config and 'tls_server_config' in web_config.read_text() else 'http'}://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited {proc.returncode}: {(tmp / 'prometheus.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=2, **(ready or {})).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_group(proc, 30)
    raise RuntimeError("prometheus did not become ready in 120 s")


def _tsdb_state(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    vals = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith(("prometheus_tsdb_blocks_loaded ", "prometheus_tsdb_compactions_total "))}
    return vals.get("prometheus_tsdb_blocks_loaded", -1), vals.get("prometheus_tsdb_compactions_total", -1)


def wait_compacted(url: str, quiet_s: float = 75, limit_s: float = 900) -> dict:
    """Until Prometheus has compacted the backfilled 2 h blocks (its compactor runs every minute):
    a TSDB that has held 7 days is compacted, and queries over 85 small blocks pay per block."""
    t0 = time.monotonic()
    first = last = _tsdb_state(url)
    since = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        time.sleep(5)
        now = _tsdb_state(url)
        if now != last:
            last, since = now, time.monotonic()
        elif last[1] > 0 and time.monotonic() - since >= quiet_s:
            break
    return {"blocks_before": first[0], "blocks_after": last[0], "compactions": last[1],
            "wait_s": time.monotonic() - t0}


def prometheus_cpu_s(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("process_cpu_seconds_total "))


def run_child(cmd: list[str]) -> dict:
    """``cmd`` under a wrapper process that reports its own peak RSS (ru_maxrss of RUSAGE_CHILDREN
    of a fresh process counts only this command)."""
    wrapper = ("import resource,subprocess,sys,time,json;t=time.perf_counter();"
               "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);w=time.perf_counter()-t;"
               "u=resource.getrusage(resource.RUSAGE_CHILDREN);"
               "sys.stderr.write(p.stderr);sys.stdout.write(json.dumps({'rc':p.returncode,'wall_s':w,"
               "'maxrss_kb':u.ru_maxrss,'cpu_s':u.ru_utime+u.ru_stime,'out':p.stdout}))")
    p = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True)
    if p.returncode != 0 or not p.stdout:
        raise RuntimeError(f"{cmd}: {p.stderr[-2000:]}")
    d = json.loads(p.stdout)
    d["stderr"] = p.stderr
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=500)
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--interval", type=int, default=900, help="seconds between samples (default 15 min)")
    args = ap.parse_args(argv)
    prom_bin, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prom_bin or not promtool:
        raise SystemExit("needs Debian's prometheus package (prometheus, promtool on PATH)")
    end = int(time.time()) // args.interval * args.interval - args.interval
    start = end - int(args.days * 86400)
    model = fleet_model(args.replicas, start, end, args.interval)
    print(f"load before: {os.getloadavg()}, cpus {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as d:
        tmp = Path(d)
        tsdb, fig = backfill(model, tmp, promtool)
        print(f"backfill: {args.replicas} replicas x {args.days:g} d at {args.interval} s: {fig['samples']:,} samples "
              f"in {fig['files']} OpenMetrics files (one per 2 h block, written in {fig['write_s']:.1f} s), promtool "
              f"{fig['promtool_s']:.1f} s (2 at a time)")
        proc, url = start_prometheus(prom_bin, tsdb, tmp)
        try:
            comp = wait_compacted(url)
            print(f"Prometheus compacted {comp['blocks_before']:.0f} blocks into {comp['blocks_after']:.0f} "
                  f"({comp['compactions']:.0f} compactions, waited {comp['wait_s']:.0f} s); load {os.getloadavg()}")
            ls = [sys.executable, "-m", "layerscope"]
            sel = '{job="vllm"}'
            mid = (start + end) / 2
            c0 = prometheus_cpu_s(url)
            diag = run_child(ls + ["diagnose", "--prometheus", url, "--selector", sel, "--around",
                                   f"{int((end - start) / 2)}s", "--at", str(mid), "--json"])
            c1 = prometheus_cpu_s(url)
            fl = run_child(ls + ["fleet", "--prometheus", url, "--selector", sel, "--window",
                                 f"{model['last_day']}..{end}", "--json"])
            diag["prom_cpu_s"], fl["prom_cpu_s"] = c1 - c0, prometheus_cpu_s(url) - c1
        finally:
            stop_group(proc, 30)
    print(f"load after: {os.getloadavg()}")
    for what, r in (("diagnose --around (find the rollout, diagnose it)", diag), ("fleet (last day)", fl)):
        print(f"{what}: rc {r['rc']}, wall {r['wall_s']:.2f} s, peak RSS {r['maxrss_kb'] / 1024:.0f} MB, "
              f"CPU ours {r['cpu_s']:.2f} s, Prometheus's {r['prom_cpu_s']:.2f} s")
        if r["rc"] != 0:
            print(r["stderr"][-3000:])
    d = json.loads(diag["out"])
    print(f"before {d['prometheus']['before']}, after {d['prometheus']['after']}")
    f = json.loads(fl["out"])
    print(f"rollout injected at {model['roll']} (+0..30 min per replica); found at {d['rollout']['time']} "
          f"({d['rollout']['found_by']}, {len(d['rollout']['replicas'])} replicas changed)")
    print(f"verdict {d['verdict']}, primary {d['primary']}, config diff "
          f"{[(c['key'], c['baseline'], c['candidate'], c['layer']) for c in d['config_diff']]}")
    print(f"outliers: {[(o['replica'], o['kind'], o['layer']) for o in f['outliers']]} (injected: slow "
          f"{model['slow']}, stuck {model['stuck']}, skew {model['skew']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
