"""``layerscope run`` and ``layerscope bench`` (registered by ``layerscope.cli``): the
command line of the run API (``layerscope.api.run`` / ``bench``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", required=True,
                   help="built-in (chat, agentic, long-context, burst, offline) or a .toml/.json workload file")
    g.add_argument("--seed", type=int, default=None, help="workload seed")
    g.add_argument("--num-requests", type=int, default=None)
    g.add_argument("--rate", type=float, default=None, help="requests/s (agentic: sessions/s); 0 = all at t=0")
    g.add_argument("--burstiness", type=float, default=None, help="Gamma shape of arrival gaps (1 = Poisson)")
    g.add_argument("--concurrency", type=int, default=None, help="client-side cap on requests in flight")
    g.add_argument("--ramp-up-s", type=float, default=None)
    g.add_argument("--param", action="append", metavar="KEY=VALUE", help="any workload spec field (repeatable)")
    g.add_argument("--out", required=True, help="run bundle directory to write")
    g.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
    g.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout, seconds")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")


def workload_params(args: argparse.Namespace) -> dict[str, Any]:
    """The workload spec fields the command line overrides."""
    from layerscope.regressions.load.workloads import WorkloadError

    params: dict[str, Any] = {}
    for item in args.param or []:
        if "=" not in item:
            raise WorkloadError(f"--param expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        params[k.strip()] = v.strip()
    for attr, key in (("seed", "seed"), ("num_requests", "num_requests"), ("rate", "rate"),
                      ("burstiness", "burstiness"), ("concurrency", "max_concurrency"), ("ramp_up_s", "ramp_up_s")):
        if getattr(args, attr) is not None:
            params[key] = getattr(args, attr)
    return params


def _progress(args: argparse.Namespace) -> bool:
    return args.progress if args.progress is not None else sys.stderr.isatty()


def print_summary(path: Path, target: str) -> None:
    """The client's summary of a bundle, as the load generator renders it."""
    from rich.console import Console

    from layerscope.probes.reader import read_manifest
    from layerscope.regressions.load.loadgen import render_summary

    manifest = read_manifest(path)
    title = f"{manifest['workload'].get('name', '?')} -> {target}"
    Console(stderr=False).print(render_summary(manifest["summary"]["client"], title=title))
    print(f"wrote {path}")


def bench_workload(args: argparse.Namespace, tokenizer=None):
    """The workload a ``bench`` command line asks for: vLLM's dataset flags, or ours (vLLM's flags
    like --num-prompts and --request-rate override its fields)."""
    from layerscope.api import load_workload
    from layerscope.regressions import vllm_bench

    if vllm_bench.is_vllm_style(args):
        return vllm_bench.dataset_workload(args, tokenizer)
    return load_workload(args.workload, workload_params(args)).replace(**vllm_bench.workload_overrides(args))


def cmd_bench(args: argparse.Namespace) -> int:
    from layerscope.api import bench
    from layerscope.regressions import vllm_bench

    vllm_bench.check_args(args)  # vLLM-style flags (regressions/vllm_bench.py) beside ours
    endpoint = vllm_bench.server_url(args)
    tokenizer_id = vllm_bench.tokenizer_dir(args, endpoint)
    tokenizer = None
    if tokenizer_id and vllm_bench.is_vllm_style(args):
        from layerscope.engine.gateway.gateway import load_gateway_tokenizer

        tokenizer = load_gateway_tokenizer(tokenizer_id)
    spec = bench_workload(args, tokenizer)
    out = args.out or f"runs/bench-{spec.name.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"

    def vllm_results(result, path: Path, requests: list) -> None:
        for p in vllm_bench.write_results(args, result, path, result.model, tokenizer_id, requests):
            print(f"wrote {p} (vllm bench serve result format)")

    path = bench(endpoint=endpoint, workload=spec, out=out,
                 served_model=args.served_model or args.served_model_name or args.model, api_key=args.api_key,
                 tokenizer=tokenizer_id, scrape_interval_s=args.scrape_interval, server_log=args.server_log,
                 overwrite=args.overwrite, timeout_s=args.timeout,
                 progress=False if args.disable_tqdm else _progress(args), on_result=vllm_results)
    print_summary(path, endpoint)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from layerscope.api import run
    from layerscope.engine.config import parse_set_args

    path = run(model=args.model, workload=args.workload, out=args.out, config=parse_set_args(args.set),
               faults=args.fault, probes=args.probes, replicas=args.replicas, tp=args.tp,
               workload_params=workload_params(args), profile=args.profile, overwrite=args.overwrite,
               timeout_s=args.timeout, startup_timeout_s=args.startup_timeout, progress=_progress(args),
               otlp_endpoint=args.otlp_endpoint, bundle_interval_s=args.bundle_interval,
               bundle_max_requests=args.bundle_max_requests, retention=args.retention)
    print_summary(path, args.model)
    return 0


def add_parser(subparsers) -> None:
    from layerscope.api import PROFILES
    from layerscope.engine.gateway.cli import add_engine_args
    from layerscope.serve import add_rolling_args

    p = subparsers.add_parser("bench", help="drive any OpenAI-compatible server with a workload; write a bundle")
    p.add_argument("--endpoint", default=None, help="the server's URL (http://127.0.0.1:8000), or, as vLLM's, the "
                                                    "API path (/v1/completions) with --base-url")
    p.add_argument("--served-model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("LAYERSCOPE_API_KEY"),
                   help="Bearer key of the server (default: $LAYERSCOPE_API_KEY); also used for /metrics")
    p.add_argument("--tokenizer", default=None, help="model directory whose tokenizer sizes prompts exactly")
    p.add_argument("--scrape-interval", type=float, default=1.0, metavar="S",
                   help="scrape the server's /metrics every S seconds during the run (scrapes.parquet)")
    p.add_argument("--server-log", default=None, metavar="FILE",
                   help="the engine's own log (vLLM, SGLang): its config and periodic stats go into the bundle")
    add_workload_args(p)
    from layerscope.regressions.vllm_bench import add_vllm_args

    add_vllm_args(p)
    for action in p._actions:  # vLLM-style: a dataset instead of --workload, a default bundle path
        if action.dest in ("workload", "out"):
            action.required = False
    p.set_defaults(func=cmd_bench)

    p = subparsers.add_parser("run", help="serve a model, drive it with a workload, write one run bundle")
    add_engine_args(p)
    add_rolling_args(p, by_default=False)
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="profiler windows (kernels), py-spy (pyspy) or both; implies --probes full")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the replicas to load")
    add_workload_args(p)
    p.set_defaults(func=cmd_run)
