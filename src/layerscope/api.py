"""The run API: ``layerscope.run`` and ``layerscope.bench`` (what ``layerscope run``/``bench`` do).

- ``run(model=..., workload=..., out=...)``: start the serving stack in this process
  (gateway + HTTP server on a free loopback port on a thread, replicas as processes),
  drive it with the load generator, stop it, and write ONE bundle joining the replicas'
  recorder exports, the gateway's recorder and records, and the client's records, on
  request_id.
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
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from layerscope.contract import STATUS_OF_FINISH_REASON, STATUS_STOPPED

PROFILES = {
    # profile -> ProbeRecorder knobs (the probe level becomes "full")
    "kernels": {"pyspy": False},
    "pyspy": {"profile_max_windows": 0},
    "all": {},
}
PROBE_LEVELS = ("off", "default", "full")


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


# ---- the bundle -----------------------------------------------------------------------------------
def _bundle_writer_class():
    from layerscope.probes.bundle import BundleWriter

    class RunBundleWriter(BundleWriter):
        """BundleWriter plus the client's view: its summary in the manifest and a scraped
        /metrics exposition where no recorder supplies one (bench)."""

        def __init__(self, *a, client_summary: dict[str, Any] | None = None, metrics_text: str | None = None,
                     machine: dict[str, Any] | None = None, **kw):
            super().__init__(*a, **kw)
            self.client_summary = client_summary
            self.machine = machine
            if metrics_text:
                self.add_metrics_text(metrics_text)

        def _manifest(self, rows):
            m = super()._manifest(rows)
            if self.client_summary is not None:
                m["summary"]["client"] = self.client_summary
            if self.machine is not None:
                m["machine"] = self.machine  # optional key (probes/machine.py)
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
    scraper = capture.Scraper(endpoint, scrape_interval_s, api_key).start() if before else None
    try:
        result = run_load(endpoint, spec, requests, model=served_model, api_key=api_key, progress=progress,
                          timeout_s=timeout_s)
    finally:
        if scraper is not None:
            scraper.stop()
    after = _scrape(endpoint, api_key)
    # the server's config is unknown to a client: the manifest's config stays empty, and the
    # endpoint goes with the client's summary
    summary = {**result.summary(), "endpoint": result.endpoint, "model": result.model}
    command = _command("bench", [("--endpoint", endpoint), ("--workload", workload if isinstance(workload, (str, Path))
                                                             else spec.name), ("--out", out)],
                       [("--param", [f"{k}={_value(v)}" for k, v in (workload_params or {}).items()])],
                       [("--served-model", served_model), ("--api-key", "***" if api_key else None),
                        ("--tokenizer", tokenizer), ("--overwrite", overwrite)])
    writer = _bundle_writer_class()(
        out, command=command, config={}, workload=spec.to_dict(), faults={}, probes="off", overwrite=overwrite,
        client_summary=summary, metrics_text=after)
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
def _gateway(model: str | Path, config: Mapping[str, Any] | None, faults: list[str], probes: str, replicas: int,
             tp: int, recorder_kwargs: dict | None):
    """EngineConfig + Faults + a recording Gateway (not started yet)."""
    from layerscope.engine.config import EngineConfig
    from layerscope.engine.faults import Faults
    from layerscope.engine.gateway.gateway import Gateway
    from layerscope.probes.serving import recorders

    overrides = dict(config or {})
    if "model" in overrides:
        raise ValueError("config: the model is the model= argument, not a config key")
    overrides["model"] = str(model)
    if tp:
        overrides["tp_size"] = tp
    return Gateway(EngineConfig.from_overrides(**overrides), Faults.parse(faults), num_replicas=replicas,
                   recorders=recorders(probes, **(recorder_kwargs or {})), record=True)


def run(*, model: str | Path, workload: Any, out: str | Path, config: Mapping[str, Any] | None = None,
        faults: Mapping[str, Any] | Sequence[str] | None = None, probes: str = "default", replicas: int = 1,
        tp: int = 0, workload_params: Mapping[str, Any] | None = None, profile: str | None = None,
        overwrite: bool = False, timeout_s: float = 300.0, startup_timeout_s: float = 300.0,
        progress: bool = False, otlp_endpoint: str | None = None) -> Path:
    """Serve ``model`` (a checkpoint directory), drive it with ``workload`` (a built-in name, a
    .toml/.json file or a WorkloadSpec; ``workload_params`` override its fields), stop, and
    write one bundle to ``out``; returns its path.

    ``config``: engine/gateway keys (``--set``: ``{"max_num_seqs": 8, "gateway.max_queue": 64}``);
    ``faults``: ``{"gateway.delay_ms": 150}`` or ``["model.layer_delay=layers.1.mlp:6"]``;
    ``probes``: off | default | full; ``profile``: kernels | pyspy | all (implies full);
    ``timeout_s``: per request; ``startup_timeout_s``: for the replicas to load;
    ``otlp_endpoint``: also export traces to this OTLP/HTTP collector (needs layerscope[otlp]).
    """
    from layerscope.engine.gateway.server import serving
    from layerscope.probes.machine import MachineSampler
    from layerscope.regressions.load.loadgen import run_load, server_in_process

    if probes not in PROBE_LEVELS:
        raise ValueError(f"probes must be one of {', '.join(PROBE_LEVELS)}, got {probes!r}")
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(sorted(PROFILES))}, got {profile!r}")
    spec = load_workload(workload, workload_params)
    out = Path(out)
    _check_out(out, overwrite)
    fault_items = _fault_items(faults)
    recorder_kwargs = None
    if profile:
        probes, recorder_kwargs = "full", PROFILES[profile]
    from layerscope.engine.gateway.cli import use_otlp_endpoint

    use_otlp_endpoint(otlp_endpoint)
    gateway = _gateway(model, config, fault_items, probes, replicas, tp, recorder_kwargs)
    with serving(gateway, startup_timeout_s) as url:
        from layerscope.engine.gateway.cli import warmup_line

        print(warmup_line(gateway, "run"), file=sys.stderr, flush=True)
        requests = spec.build(gateway.tokenizer)
        machine = MachineSampler()  # what the rest of the machine does meanwhile (issue 16)
        machine.yardstick("before")
        with server_in_process():
            machine.start()
            result = run_load(url, spec, requests, progress=progress, timeout_s=timeout_s)
            machine.stop().yardstick("after")
        gateway.wait_idle()
        exports = gateway.collect_replica_records()
        if gateway.recording:
            gateway.recorder.stop()
    command = _command("run", [("--model", model), ("--workload", workload if isinstance(workload, (str, Path))
                                                     else spec.name), ("--out", out)],
                       [("--set", [f"{k}={_value(v)}" for k, v in (config or {}).items()]),
                        ("--fault", fault_items),
                        ("--param", [f"{k}={_value(v)}" for k, v in (workload_params or {}).items()])],
                       [("--probes", probes), ("--replicas", replicas if replicas != 1 else None),
                        ("--tp", tp or None), ("--profile", profile), ("--overwrite", overwrite)])
    writer = _bundle_writer_class()(
        out, command=command, config=gateway.config, resolved=gateway.resolved[0], workload=spec.to_dict(),
        faults=gateway.faults, probes=probes, overwrite=overwrite, client_summary=result.summary(),
        machine=machine.manifest_section())
    writer.start_ns, writer.end_ns = result.start_ns, result.end_ns
    for exp in exports:
        if exp is not None:
            writer.add_export(exp)
    if gateway.recording:
        writer.add_recorder(gateway.recorder)
    writer.add_request_fields(r.to_row() for r in gateway.records)
    writer.add_request_fields(client_rows(result))
    path = writer.write()
    from layerscope.probes.bundle import write_table
    from layerscope.probes.machine import MACHINE_FILE

    write_table(path / MACHINE_FILE, machine.table())  # the sampler's table, beside the bundle's
    if gateway.recording:
        gateway.recorder.shutdown()
    return path


def create_model(out_dir: str | Path, arch: str = "llama", preset: str = "tiny", seed: int = 0,
                 dtype: str | None = None, overwrite: bool = False) -> Path:
    """``layerscope model create``: a seeded random HF-format checkpoint (engine.models.create)."""
    from layerscope.engine.models.create import create_model as _create

    return Path(_create(out_dir, arch=arch, preset=preset, seed=seed, dtype=dtype, overwrite=overwrite))
