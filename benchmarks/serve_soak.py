"""Soak: many short requests through ``layerscope serve`` with default probes and a rolling bundle.

    python benchmarks/serve_soak.py [--requests 20000] [--model DIR] [--concurrency 8]

Starts ``serve`` (tiny model unless --model; a part every --interval seconds), sends
--requests short completions (a few prompt tokens, --max-tokens output tokens) from
--concurrency client threads, and samples the resident memory (RSS) of the server's
processes (gateway + replicas) every 1,000 requests. Prints the RSS growth per 1,000
requests after warm-up (the first --warmup requests; a least-squares slope), then stops
the server (SIGTERM), checks that the bundle holds every request exactly once and is
complete, and diagnoses it (``layerscope diagnose --json``). Then a second, short server is
killed with SIGKILL mid-run: its bundle must read up to its last complete part and say it was
cut short (``complete`` false, ``Bundle.note``).

``start_layerscope`` / ``start_server`` start a ``layerscope`` command as a process of its own
(the tests of ``serve``'s and ``run``'s rolling bundles use them too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from layerscope.probes.reader import read_bundle, read_manifest


def _rss_mb(pid: int) -> float:
    """RSS of ``pid`` and its descendants (MB)."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return total / 1024


def start_layerscope(args: list[str], ready: str, timeout_s: float = 300.0) -> tuple[subprocess.Popen, list[str]]:
    """``python -m layerscope ARGS`` in a process group of its own (``os.killpg`` stops it with its
    replicas), its output read into the returned list by a thread (the pipe never fills); returns once
    a line holds ``ready`` (RuntimeError with its last lines if it exits or takes longer)."""
    cmd = [sys.executable, "-m", "layerscope", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()  # the ready line, or the end of the output

    def read():
        for line in proc.stdout:
            lines.append(line)
            if ready in line:
                seen.set()
        seen.set()

    threading.Thread(target=read, daemon=True).start()
    if not seen.wait(timeout_s) or not any(ready in line for line in lines):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise RuntimeError(f"{' '.join(cmd[2:4])} did not print {ready!r}:\n" + "".join(lines[-30:]))
    return proc, lines


def start_server(model: str, bundle: Path, extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str, list[str]]:
    """``layerscope serve`` on a free port with its rolling bundle at ``bundle`` (``extra``: more
    options); returns (process, URL, its output lines so far and to come)."""
    proc, lines = start_layerscope(["serve", "--model", str(model), "--port", "0", "--bundle", str(bundle), *extra],
                                   "listening on")
    return proc, next(line for line in lines if "listening on" in line).split()[-1], lines


def send(url: str, model: str, n: int, concurrency: int, max_tokens: int, on_done=None, stop=None) -> int:
    """``n`` short completions from ``concurrency`` threads; returns how many got a 200."""
    import httpx

    counter = {"i": 0, "ok": 0}
    lock = threading.Lock()

    def worker():
        with httpx.Client(base_url=url, timeout=120) as c:
            while True:
                with lock:
                    if counter["i"] >= n or (stop is not None and stop.is_set()):
                        return
                    i = counter["i"]
                    counter["i"] += 1
                try:
                    r = c.post("/v1/completions", json={"model": model, "prompt": f"soak {i % 97}",
                                                        "max_tokens": max_tokens})
                except Exception:  # noqa: BLE001 - the server was killed (the kill -9 part)
                    return
                with lock:
                    counter["ok"] += r.status_code == 200
                    done = counter["ok"]
                if on_done is not None:
                    on_done(done)

    with ThreadPoolExecutor(concurrency) as ex:
        for f in [ex.submit(worker) for _ in range(concurrency)]:
            f.result()
    return counter["ok"]


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def soak(model: str, out: Path, requests: int, warmup: int, concurrency: int, max_tokens: int, interval: float) -> dict:
    bundle = out / "soak-bundle"
    proc, url, lines = start_server(model, bundle, ["--bundle-interval", str(interval)])
    samples: list[tuple[int, float]] = [(0, _rss_mb(proc.pid))]
    parts_at: dict[int, int] = {}  # requests answered when the bundle first had k parts
    every = 1000 if requests >= 4000 else max(requests // 8, 50)
    t0 = time.perf_counter()

    def on_done(done):
        if done % every == 0:
            samples.append((done, _rss_mb(proc.pid)))
            try:
                parts_at.setdefault(read_manifest(bundle)["parts"], done)
            except (OSError, ValueError, KeyError):
                pass
            print(f"  {done:>7} requests  RSS {samples[-1][1]:8.1f} MB  {done / (time.perf_counter() - t0):6.1f} req/s",
                  flush=True)

    try:
        ok = send(url, model, requests, concurrency, max_tokens, on_done)
        elapsed = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(180)
    # warm-up: --warmup requests and the first two parts (the writer's first parts allocate its
    # working memory: Arrow's pool, pandas; a part's size grows with the requests per interval)
    second = min((n for k, n in parts_at.items() if k >= 2), default=None)
    # fewer than two parts while sampling: no steady state seen (the growth is then not measured)
    warm = max(warmup, second if second is not None else samples[-1][0])
    after = [(n, r) for n, r in samples if n >= warm]
    growth = _slope([n / 1000 for n, _ in after], [r for _, r in after]) if len(after) >= 2 else float("nan")
    b = read_bundle(bundle)
    m, ids = b.manifest, b.table("requests", columns=["request_id"])["request_id"].to_pylist()
    result = {"requests": requests, "ok": ok, "seconds": round(elapsed, 1), "req_per_s": round(ok / elapsed, 1),
              "warmup_requests": warm, "rss_mb_first": samples[0][1], "rss_mb_warm": after[0][1] if after else None,
              "rss_mb_last": samples[-1][1], "rss_growth_mb_per_1000_after_warmup": round(growth, 3),
              "server_rc": rc, "bundle_parts": m["parts"], "bundle_complete": m["complete"],
              "bundle_requests": len(ids), "bundle_unique_requests": len(set(ids)),
              "bundle_bytes": sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())}
    # diagnose through the command line (probes never import diagnose)
    t1 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "layerscope", "diagnose", str(bundle), "--json"],
                          capture_output=True, text=True, timeout=600)
    result["diagnose_s"] = round(time.perf_counter() - t1, 2)
    result["diagnose_rc"] = proc.returncode
    if proc.returncode != 0:
        result["diagnose_error"] = (proc.stderr.strip().splitlines() or [""])[-1][:300]
    else:
        try:
            result["diagnose_requests"] = json.loads(proc.stdout)["requests"]  # single-run diagnose JSON
        except (ValueError, KeyError, TypeError):
            result["diagnose_requests"] = None
    return result


def kill_mid_run(model: str, out: Path, requests: int, concurrency: int, max_tokens: int, interval: float) -> dict:
    bundle = out / "killed-bundle"
    proc, url, _ = start_server(model, bundle, ["--bundle-interval", str(interval)])
    stop = threading.Event()
    sender = threading.Thread(target=send, args=(url, model, requests, concurrency, max_tokens, None, stop))
    sender.start()
    time.sleep(interval * 3.5)
    os.killpg(proc.pid, signal.SIGKILL)  # gateway and replicas at once: nothing closes the bundle
    proc.wait(30)
    stop.set()
    sender.join(120)
    b = read_bundle(bundle)
    m = b.manifest
    return {"parts": m["parts"], "complete": m["complete"], "requests_read": b.table("requests").num_rows,
            "manifest_requests": m["summary"]["requests"], "last_part_time": m["last_part_time"], "note": b.note}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=None, help="requests before RSS growth is measured (default: 1/4)")
    ap.add_argument("--model", default=None, help="checkpoint (default: a tiny llama made in a temp dir)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--interval", type=float, default=2.0, help="--bundle-interval of the server (s)")
    ap.add_argument("--out", default=None, help="where the bundles go (default: a temp dir)")
    ap.add_argument("--no-kill", action="store_true", help="skip the kill -9 part")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="layerscope-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from layerscope.engine.models.create import create_model

        model = str(create_model(out / "tiny", arch="llama", preset="tiny", seed=0, overwrite=True))
    warmup = args.warmup if args.warmup is not None else args.requests // 4
    print(f"soak: {args.requests} requests, max_tokens={args.max_tokens}, concurrency={args.concurrency}, "
          f"a part every {args.interval:g} s, RSS growth measured after {warmup} requests; bundles under {out}")
    r = soak(model, out, args.requests, warmup, args.concurrency, args.max_tokens, args.interval)
    print(json.dumps(r, indent=1))
    print(f"RSS growth after warm-up ({r['warmup_requests']} requests, two parts): "
          f"{r['rss_growth_mb_per_1000_after_warmup']:.3f} MB per 1,000 requests "
          f"(target < 0.5); bundle holds {r['bundle_unique_requests']}/{r['ok']} answered requests, "
          f"complete={r['bundle_complete']}")
    if not args.no_kill:
        k = kill_mid_run(model, out, 100000, args.concurrency, args.max_tokens, args.interval)
        print("kill -9 mid-run:", json.dumps(k, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
