"""The run API: ``layerscope.run`` and ``layerscope.bench`` (what ``layerscope run``/``bench`` do).

- ``run(model=..., workload=..., out=...)``: start the serving stack in this process
  (gateway + HTTP server on a free loopback port on a thread, replicas as processes),
  drive it with the load generator, stop it, and write ONE bundle joining the replicas'
  recorder exports, the gateway's recorder and records, and the client's records, on
  request_id. With a rolling option (``bundle_interval_s``, ``bundle_max_requests``,
  ``retention``: ``serve``'s ``--bundle-interval`` etc.) the bundle is written as the run goes,
  in parts, by ``serve``'s writer (``probes/rolling.py``), and what is written leaves memory.
- ``bench(endpoint=..., workload=..., out=...)``: drive any OpenAI-compatible server and
  write a bundle of what the client saw (requests.parquet client_* columns), with the
  server's /metrics scraped before (``metrics_before.prom``) and after (``metrics.prom``)
  when it has one.

The CLI, ``demo``, the fault matrix and ``regress`` (through the CLI of each version's own
checkout, in a subprocess) all come here; nothing else assembles a run. Both return the
bundle's path; the client's summary is in its manifest (``summary.client``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from layerscope.contract import STATUS_OF_FINISH_REASON, STATUS_STOPPED
from layerscope.engine.gateway.cli import PROBE_LEVELS

PROFILES = {
    # profile -> ProbeRecorder knobs (the probe level becomes "full")
    "kernels": {"pyspy": False},
    "pyspy": {"profile_max_windows": 0},
    "all": {},
}


def load_workload(workload: Any, params: Mapping[str, Any] | None = None):
    """A WorkloadSpec from a spec, a built-in name or a .toml/.json file, with ``params``
    (any spec field: ``num_requests``, ``rate``, ``seed``, ...) overriding its fields."""
    from layerscope.regressions.load.workloads import WorkloadSpec
    from layerscope.regressions.load.workloads import load_workload as _load

    if isinstance(workload, WorkloadSpec):
        return workload.replace(**params) if params else workload
    return _load(str(workload), **dict(params or {}))


def _fault_items(faults: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    """``{"gateway.delay_ms": 150}`` or ``["gateway.delay_ms=150"]`` -> the ``--fault`` items."""
    if not faults:
        return []
    if isinstance(faults, Mapping):
        return [f"{k}={v}" for k, v in faults.items()]
    if isinstance(faults, str):
        raise TypeError("faults: a mapping or a list of 'KEY=VALUE' strings, not one string")
    return [str(f) for f in faults]


def _value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _command(name: str, required: list[tuple[str, Any]], repeated: list[tuple[str, list[str]]],
             optional: list[tuple[str, Any]]) -> list[str]:
    """The equivalent ``layerscope`` command line (for the manifest)."""
    out = ["layerscope", name]
    for flag, v in required:
        out += [flag, str(v)]
    for flag, items in repeated:
        for item in items:
            out += [flag, item]
    for flag, v in optional:
        if v is True:
            out.append(flag)
        elif v not in (None, False):
            out += [flag, str(v)]
    return out


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (--overwrite) to replace it")


# ---- the bundle ----------------------------------------------------------------------------------
def _run_writer(base: type) -> type:
    """``base`` (``BundleWriter``, or ``RollingBundleWriter`` for a rolling run) plus the client's
    view in the manifest: ``client_summary`` (``summary.client``) and ``machine`` (set them before
    the bundle's last write)."""

    class RunWriter(base):
        client_summary: dict[str, Any] | None = None
        machine: dict[str, Any] | None = None

        def _manifest(self, *a):
            m = super()._manifest(*a)
            if self.client_summary is not None:
                m["summary"]["client"] = self.client_summary
            if self.machine is not None:
                m["machine"] = self.machine  # optional key (probes/machine.py)
            return m

    return RunWriter


def client_row(rec) -> dict[str, Any]:
    """requests.parquet fields of one client record (joined on the server's request id)."""
    row = rec.to_row()
    row["request_id"] = rec.request_id or f"client-{rec.index}"
    if rec.status == "ok":
        row["status"] = STATUS_OF_FINISH_REASON.get(rec.finish_reason or "", STATUS_STOPPED)
    else:
        row["status"] = rec.status  # rejected | error
    return row


def client_rows(result) -> list[dict[str, Any]]:
    """requests.parquet fields of the client records (joined on the server's request id)."""
    return [client_row(rec) for rec in result.records]


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


# ---- bench ----------------------------------------------------------------------------------------
def bench(*, endpoint: str, workload: Any, out: str | Path, workload_params: Mapping[str, Any] | None = None,
          served_model: str | None = None, api_key: str | None = None, tokenizer: str | Path | None = None,
          overwrite: bool = False, timeout_s: float = 300.0, progress: bool = False,
          scrape_interval_s: float = 1.0, server_log: str | Path | None = None,
          on_result: Callable[[Any, Path, list], None] | None = None) -> Path:
    """Drive ``endpoint`` (an OpenAI-compatible server's base URL) with ``workload``; write a
    client-side bundle to ``out`` and return its path. ``tokenizer``: a model directory whose
    tokenizer sizes prompts exactly; ``timeout_s``: per request. The server's /metrics is scraped
    every ``scrape_interval_s`` during the run (scrapes.parquet); ``server_log``: the engine's own
    log (vLLM, SGLang), whose config and periodic stats go into the bundle (docs/external.md).
    ``on_result(result, path, requests)``: called with the load generator's result once the bundle
    is written (the CLI writes ``vllm bench serve``'s result JSON from it)."""
    from layerscope.probes.machine import client_machine_section, yardstick
    from layerscope.regressions import capture
    from layerscope.regressions.load.loadgen import run_load

    spec = load_workload(workload, workload_params)
    tok = None
    if tokenizer:
        from layerscope.engine.gateway.gateway import load_gateway_tokenizer

        tok = load_gateway_tokenizer(str(tokenizer))
    requests = spec.build(tok)
    out = Path(out)
    _check_out(out, overwrite)
    before = _scrape(endpoint, api_key)
    # the machine's speed, by the fixed yardstick before and after the load (issue 16): the server is
    # another process tree (maybe another machine), so only this speed evidence is the client's to give
    ys_before = yardstick(3)
    scraper = capture.Scraper(endpoint, scrape_interval_s, api_key).start() if before else None
    try:
        result = run_load(endpoint, spec, requests, model=served_model, api_key=api_key, progress=progress,
                          timeout_s=timeout_s)
    finally:
        if scraper is not None:
            scraper.stop()
    ys_after = yardstick(3)
    after = _scrape(endpoint, api_key)
    # the server's config is unknown to a client: the manifest's config stays empty, and the
    # endpoint goes with the client's summary
    summary = {**result.summary(), "endpoint": result.endpoint, "model": result.model}
    command = _command("bench", [("--endpoint", endpoint), ("--workload", workload if isinstance(workload, (str, Path))
                                                             else spec.name), ("--out", out)],
                       [("--param", [f"{k}={_value(v)}" for k, v in (workload_params or {}).items()])],
                       [("--served-model", served_model), ("--api-key", "***" if api_key else None),
                        ("--tokenizer", tokenizer), ("--overwrite", overwrite)])
    from layerscope.probes.bundle import BundleWriter

    writer = _run_writer(BundleWriter)(out, command=command, config={}, workload=spec.to_dict(), faults={},
                                       probes="off", overwrite=overwrite)
    writer.client_summary = summary
    writer.machine = client_machine_section(ys_before, ys_after)
    if after:
        writer.add_metrics_text(after)
    writer.start_ns, writer.end_ns = result.start_ns, result.end_ns
    writer.add_request_fields(client_rows(result))
    path = writer.write()
    log = capture.read_server_log(server_log)
    capture.finish_bundle(path, before=before, after=after, scraper=scraper, log=log, itls=capture.client_itls(result),
                          info=capture.engine_info(endpoint, api_key, after or before, log))
    if on_result is not None:
        on_result(result, path, requests)
    return path


# ---- run ------------------------------------------------------------------------------------------
def run(*, model: str | Path, workload: Any, out: str | Path, config: Mapping[str, Any] | None = None,
        faults: Mapping[str, Any] | Sequence[str] | None = None, probes: str = "default", replicas: int = 1,
        tp: int = 0, workload_params: Mapping[str, Any] | None = None, profile: str | None = None,
        overwrite: bool = False, timeout_s: float = 300.0, startup_timeout_s: float = 300.0,
        progress: bool = False, otlp_endpoint: str | None = None, bundle_interval_s: float | None = None,
        bundle_max_requests: int | None = None, retention: str | None = None) -> Path:
    """Serve ``model`` (a checkpoint directory), drive it with ``workload`` (a built-in name, a
    .toml/.json file or a WorkloadSpec; ``workload_params`` override its fields), stop, and
    write one bundle to ``out``; returns its path.

    ``config``: engine/gateway keys (``--set``: ``{"max_num_seqs": 8, "gateway.max_queue": 64}``);
    ``faults``: ``{"gateway.delay_ms": 150}`` or ``["model.layer_delay=layers.1.mlp:6"]``;
    ``probes``: off | default | full; ``profile``: kernels | pyspy | all (implies full);
    ``timeout_s``: per request; ``startup_timeout_s``: for the replicas to load;
    ``otlp_endpoint``: also export traces to this OTLP/HTTP collector (needs layerscope[otlp]).

    Rolling (any of these given; ``serve``'s options): the bundle is written as the run goes, a
    part every ``bundle_interval_s`` seconds (default 10) or once ``bundle_max_requests`` requests
    were answered (default 5000; 0: by time only), keeping only the parts within ``retention``
    ("6h", "2GB"; default: all); what is written leaves the recorders' memory, and a run cut short
    leaves a bundle that loads up to its last part. Needs probes (not "off").
    """
    from layerscope.probes.rolling import RollingOptions

    if probes not in PROBE_LEVELS:
        raise ValueError(f"probes must be one of {', '.join(PROBE_LEVELS)}, got {probes!r}")
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(sorted(PROFILES))}, got {profile!r}")
    recorder_kwargs = None
    if profile:
        probes, recorder_kwargs = "full", PROFILES[profile]
    rolling = RollingOptions.given(bundle_interval_s, bundle_max_requests, retention)
    if rolling is not None and probes == "off":
        raise ValueError("a rolling bundle (--bundle-interval, --bundle-max-requests, --retention) is what the "
                         "probes record, written as it goes: with --probes off there is none; use --probes default "
                         "or drop those options (one bundle at the end)")
    spec = load_workload(workload, workload_params)
    out = Path(out)
    _check_out(out, overwrite)
    fault_items = _fault_items(faults)
    from layerscope.engine.gateway.cli import build_gateway
    from layerscope.probes.serving import recorders

    gateway = build_gateway(model, config=config, faults=fault_items, replicas=replicas, tp=tp,
                            recorders=recorders(probes, **(recorder_kwargs or {})), record=rolling is None,
                            rolling=rolling is not None, otlp_endpoint=otlp_endpoint)
    command = _command("run", [("--model", model), ("--workload", workload if isinstance(workload, (str, Path))
                                                     else spec.name), ("--out", out)],
                       [("--set", [f"{k}={_value(v)}" for k, v in (config or {}).items()]),
                        ("--fault", fault_items),
                        ("--param", [f"{k}={_value(v)}" for k, v in (workload_params or {}).items()])],
                       [("--probes", probes), ("--replicas", replicas if replicas != 1 else None),
                        ("--tp", tp or None), ("--profile", profile), ("--overwrite", overwrite),
                        *[(flag, None if v is None else str(v)) for flag, v in (
                            ("--bundle-interval", bundle_interval_s), ("--bundle-max-requests", bundle_max_requests),
                            ("--retention", retention))]])
    meta = dict(command=command, config=gateway.config, workload=spec.to_dict(), faults=gateway.faults,
                probes=probes, overwrite=overwrite)
    if rolling is None:
        return _run_then_write(gateway, spec, out, meta, timeout_s, startup_timeout_s, progress)
    return _run_rolling(gateway, spec, out, meta, rolling, timeout_s, startup_timeout_s, progress)


def _drive(gateway, spec, url: str, timeout_s: float, progress: bool, on_done=None):
    """Drive the started ``gateway`` at ``url`` with ``spec``; returns (the load result, the machine
    sampler), once the gateway is idle."""
    from layerscope.engine.gateway.cli import warmup_line
    from layerscope.probes.machine import MachineSampler
    from layerscope.regressions.load.loadgen import run_load, server_in_process

    print(warmup_line(gateway, "run"), file=sys.stderr, flush=True)
    requests = spec.build(gateway.tokenizer)
    machine = MachineSampler()  # what the rest of the machine does meanwhile (issue 16)
    machine.yardstick("before")
    with server_in_process():
        machine.start()
        result = run_load(url, spec, requests, progress=progress, timeout_s=timeout_s, on_done=on_done)
        machine.stop()
    gateway.wait_idle()
    # the after-yardstick once the run's own processes are idle (the replicas' last pushes, the
    # gateway's last drains): timed before, it competed with the run it measures the machine for
    _wait_quiet()
    machine.yardstick("after")
    return result, machine


def _wait_quiet(max_cores: float = 0.1, window_s: float = 0.1, timeout_s: float = 3.0) -> bool:
    """Block until this process tree uses under ``max_cores`` CPUs over a ``window_s`` window (False:
    still busy after ``timeout_s``; no psutil: False at once)."""
    try:
        import psutil
    except ImportError:
        return False

    def tree_cpu_s() -> float:
        total = 0.0
        for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # exited meanwhile
                pass
        return total

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        c0, t0 = tree_cpu_s(), time.monotonic()
        time.sleep(window_s)
        if (tree_cpu_s() - c0) / (time.monotonic() - t0) < max_cores:
            return True
    return False


def _finish(gateway, path: Path, machine) -> Path:
    from layerscope.probes.bundle import write_table
    from layerscope.probes.machine import MACHINE_FILE

    write_table(path / MACHINE_FILE, machine.table())  # the sampler's table, beside the bundle's
    if gateway.recording:
        gateway.recorder.shutdown()
    return path


def _run_then_write(gateway, spec, out: Path, meta: dict, timeout_s: float, startup_timeout_s: float,
                    progress: bool) -> Path:
    """The run, then its one bundle: every recorder's export and record joined at the end."""
    from layerscope.engine.gateway.server import serving
    from layerscope.probes.bundle import BundleWriter

    with serving(gateway, startup_timeout_s) as url:
        result, machine = _drive(gateway, spec, url, timeout_s, progress)
        exports = gateway.collect_replica_records()
        if gateway.recording:
            gateway.recorder.stop()
    writer = _run_writer(BundleWriter)(out, resolved=gateway.resolved[0], **meta)
    writer.client_summary, writer.machine = result.summary(), machine.manifest_section()
    writer.start_ns, writer.end_ns = result.start_ns, result.end_ns
    for exp in exports:
        if exp is not None:
            writer.add_export(exp)
    if gateway.recording:
        writer.add_recorder(gateway.recorder)
    writer.add_request_fields(r.to_row() for r in gateway.records)
    writer.add_request_fields(client_rows(result))
    return _finish(gateway, writer.write(), machine)


def _run_rolling(gateway, spec, out: Path, meta: dict, rolling, timeout_s: float, startup_timeout_s: float,
                 progress: bool) -> Path:
    """The run, its bundle written as it goes (``serve``'s ``RollingBundle``), the client's rows too."""
    from layerscope.engine.gateway.server import serving
    from layerscope.probes.rolling import RollingBundle, RollingBundleWriter

    writer = _run_writer(RollingBundleWriter)(out, expect_client=True, **meta, **rolling.writer_kwargs())
    with serving(gateway, startup_timeout_s) as url:
        bundle = RollingBundle(gateway, writer, rolling).start()
        print(f"layerscope run: {bundle.describe()}", file=sys.stderr, flush=True)
        try:
            result, machine = _drive(gateway, spec, url, timeout_s, progress,
                                     on_done=lambda rec: bundle.add_client_rows([client_row(rec)]))
            writer.client_summary, writer.machine = result.summary(), machine.manifest_section()
        finally:  # a failed run still closes what it wrote
            path = bundle.close()
        if gateway.recording:
            gateway.recorder.stop()
    return _finish(gateway, path, machine)


def create_model(out_dir: str | Path, arch: str = "llama", preset: str = "tiny", seed: int = 0,
                 dtype: str | None = None, overwrite: bool = False) -> Path:
    """``layerscope model create``: a seeded random HF-format checkpoint (engine.models.create)."""
    from layerscope.engine.models.create import create_model as _create

    return Path(_create(out_dir, arch=arch, preset=preset, seed=seed, dtype=dtype, overwrite=overwrite))
