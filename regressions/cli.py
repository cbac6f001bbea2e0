"""``layerscope bench`` and ``layerscope run`` (registered by ``layerscope.cli``).

- ``bench --endpoint URL --workload W --out RUN``: drive any OpenAI-compatible server
  and write a bundle of what the client saw (requests.parquet client_* columns), with
  the server's /metrics scraped before (``metrics_before.prom``) and after
  (``metrics.prom``) when it has one.
- ``run --model DIR --workload W --out RUN``: start the serving stack in this process
  (gateway + HTTP server on a free loopback port on a thread, replicas as processes),
  drive it with the load generator, stop it, and write ONE bundle joining the
  replicas' recorder exports, the gateway's recorder and records, and the client's
  records, on request_id.

``execute_run`` / ``execute_bench`` are the same as functions (``regress`` runs the CLI
in a subprocess per version; tests call them directly).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from layerscope.contract import STATUS_OF_FINISH_REASON, STATUS_STOPPED

PROFILES = {
    # --profile -> ProbeRecorder knobs (the level becomes "full")
    "kernels": {"pyspy": False},
    "pyspy": {"profile_max_windows": 0},
    "all": {},
}


# ---- workloads from the command line ------------------------------------------------------------
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


def workload_from_args(args: argparse.Namespace):
    from layerscope.regressions.workloads import WorkloadError, load_workload

    overrides: dict[str, Any] = {}
    for item in args.param or []:
        if "=" not in item:
            raise WorkloadError(f"--param expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        overrides[k.strip()] = v.strip()
    for attr, key in (("seed", "seed"), ("num_requests", "num_requests"), ("rate", "rate"),
                      ("burstiness", "burstiness"), ("concurrency", "max_concurrency"), ("ramp_up_s", "ramp_up_s")):
        if getattr(args, attr) is not None:
            overrides[key] = getattr(args, attr)
    return load_workload(args.workload, **overrides)


def _command(name: str, args: argparse.Namespace) -> list[str]:
    """The command line, rebuilt from the parsed options (for the manifest)."""
    out = ["layerscope", name]
    for k, v in vars(args).items():
        if k in ("func", "command") or k.startswith("_") or v is None or v is False or v == []:
            continue
        flag = "--" + k.replace("_", "-")
        if k == "api_key":
            v = "***"
        if isinstance(v, list):
            for item in v:
                out += [flag, str(item)]
        elif v is True:
            out.append(flag)
        else:
            out += [flag, str(v)]
    return out


def _progress(args: argparse.Namespace) -> bool:
    return args.progress if args.progress is not None else sys.stderr.isatty()


# ---- the bundle -----------------------------------------------------------------------------------
def _bundle_writer_class():
    from layerscope.probes.bundle import BundleWriter

    class RunBundleWriter(BundleWriter):
        """BundleWriter plus the client's view: its summary in the manifest and a scraped
        /metrics exposition where no recorder supplies one (bench)."""

        def __init__(self, *a, client_summary: dict[str, Any] | None = None, metrics_text: str | None = None,
                     **kw):
            super().__init__(*a, **kw)
            self.client_summary = client_summary
            if metrics_text:
                self.add_metrics_text(metrics_text)

        def _manifest(self, rows):
            m = super()._manifest(rows)
            if self.client_summary is not None:
                m["summary"]["client"] = self.client_summary
            return m

    return RunBundleWriter




def client_rows(result) -> list[dict[str, Any]]:
    """requests.parquet fields of the client records (joined on the server's request id)."""
    rows = []
    for rec in result.records:
        row = rec.to_row()
        row["request_id"] = rec.request_id or f"client-{rec.index}"
        if rec.status == "ok":
            row["status"] = STATUS_OF_FINISH_REASON.get(rec.finish_reason or "", STATUS_STOPPED)
        else:
            row["status"] = rec.status  # rejected | error
        rows.append(row)
    return rows


def _scrape(endpoint: str, api_key: str | None) -> str | None:
    import httpx

    base = endpoint.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    try:
        r = httpx.get(base + "/metrics", timeout=10.0, trust_env=False,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    except httpx.HTTPError:
        return None
    ctype = r.headers.get("content-type", "")
    return r.text if r.status_code == 200 and ctype.startswith("text/plain") else None


def _report(result, out: Path) -> dict[str, Any]:
    from rich.console import Console

    from layerscope.regressions.loadgen import render_summary

    summary = result.summary()
    Console(stderr=False).print(render_summary(summary, title=f"{result.spec.name} -> {result.endpoint}"))
    print(f"wrote {out}")
    return summary


# ---- bench ----------------------------------------------------------------------------------------
def execute_bench(args: argparse.Namespace) -> Path:
    from layerscope.regressions.loadgen import run_load

    spec = workload_from_args(args)
    tokenizer = None
    if args.tokenizer:
        from layerscope.engine.gateway.gateway import load_gateway_tokenizer

        tokenizer = load_gateway_tokenizer(args.tokenizer)
    requests = spec.build(tokenizer)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
    before = _scrape(args.endpoint, args.api_key)
    result = run_load(args.endpoint, spec, requests, model=args.served_model, api_key=args.api_key,
                      progress=_progress(args), timeout_s=args.timeout)
    after = _scrape(args.endpoint, args.api_key)
    # the server's config is unknown to a client: the manifest's config stays empty, and the
    # endpoint goes with the client's summary
    summary = {**result.summary(), "endpoint": result.endpoint, "model": result.model}
    writer = _bundle_writer_class()(
        out, command=_command("bench", args), config={}, workload=spec.to_dict(), faults={}, probes="off",
        overwrite=args.overwrite, client_summary=summary, metrics_text=after)
    writer.start_ns, writer.end_ns = result.start_ns, result.end_ns
    writer.add_request_fields(client_rows(result))
    path = writer.write()
    if before is not None:
        (path / "metrics_before.prom").write_text(before)
    _report(result, path)
    return path


def cmd_bench(args: argparse.Namespace) -> int:
    execute_bench(args)
    return 0


# ---- run ------------------------------------------------------------------------------------------
def execute_run(args: argparse.Namespace) -> Path:
    """Serve, load, stop, write one bundle. Returns the bundle path."""
    from layerscope.engine.gateway.cli import build_gateway
    from layerscope.engine.gateway.server import serving
    from layerscope.probes.serving import recorders
    from layerscope.regressions.loadgen import run_load, server_in_process

    spec = workload_from_args(args)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
    recorder_kwargs = {}
    if args.profile:
        args.probes = "full"
        recorder_kwargs = PROFILES[args.profile]
    gateway = build_gateway(args, record=True, recorders=recorders(args.probes, **recorder_kwargs))
    with serving(gateway, args.startup_timeout) as url:
        requests = spec.build(gateway.tokenizer)
        with server_in_process():
            result = run_load(url, spec, requests, progress=_progress(args), timeout_s=args.timeout)
        gateway.wait_idle()
        exports = gateway.collect_replica_records()
        if gateway.recording:
            gateway.recorder.stop()
    summary = result.summary()
    writer = _bundle_writer_class()(
        out, command=_command("run", args), config=gateway.config, resolved=gateway.resolved[0],
        workload=spec.to_dict(), faults=gateway.faults, probes=args.probes, overwrite=args.overwrite,
        client_summary=summary)
    writer.start_ns, writer.end_ns = result.start_ns, result.end_ns
    for exp in exports:
        if exp is not None:
            writer.add_export(exp)
    if gateway.recording:
        writer.add_recorder(gateway.recorder)
    writer.add_request_fields(r.to_row() for r in gateway.records)
    writer.add_request_fields(client_rows(result))
    path = writer.write()
    if gateway.recording:
        gateway.recorder.shutdown()
    _report(result, path)
    return path


def cmd_run(args: argparse.Namespace) -> int:
    execute_run(args)
    return 0


def add_parser(subparsers) -> None:
    """Register ``bench`` and ``run``, and ``regress`` (regress_cli.py) where it exists."""
    from layerscope.engine.gateway.cli import add_engine_args

    p = subparsers.add_parser("bench", help="drive any OpenAI-compatible server with a workload; write a bundle")
    p.add_argument("--endpoint", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None, help="model directory whose tokenizer sizes prompts exactly")
    add_workload_args(p)
    p.set_defaults(func=cmd_bench)

    p = subparsers.add_parser("run", help="serve a model, drive it with a workload, write one run bundle")
    add_engine_args(p)
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="profiler windows (kernels), py-spy (pyspy) or both; implies --probes full")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the replicas to load")
    add_workload_args(p)
    p.set_defaults(func=cmd_run)

    try:
        from layerscope.regressions.regress_cli import add_regress_parser
    except ModuleNotFoundError as e:
        if e.name != "layerscope.regressions.regress_cli":
            raise
    else:
        add_regress_parser(subparsers)
