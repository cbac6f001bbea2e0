"""Capture what a running server (vLLM, SGLang, or ours) says about itself during a run.

- ``Scraper``: a thread that GETs ``/metrics`` every ``interval_s`` and keeps the texts
  with their monotonic timestamps and its own cost (seconds per scrape, bytes).
- ``engine_info``: the engine family, version and config that the server offers
  (vLLM ``/version`` + ``vllm:cache_config_info`` labels; SGLang ``/get_server_info``),
  merged with what a ``--server-log`` says.
- ``finish_bundle``: adds to a written bundle ``scrapes.parquet`` (long form: ts_ns,
  metric, labels, value; histogram buckets kept), ``server_log.parquet`` (the log's
  periodic stats lines), the optional client ITL table, and the manifest's ``engine``
  and ``external`` keys (docs/external.md).
- ``watch``: only record a live server for a time window (``layerscope watch``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from layerscope.diagnose.external.exposition import label_text, parse
from layerscope.diagnose.external.names import detect_family
from layerscope.diagnose.external.server_log import ServerLog, parse_log

SCRAPES = pa.schema([("ts_ns", pa.int64()), ("metric", pa.string()), ("labels", pa.string()),
                     ("value", pa.float64())])
ITLS = pa.schema([("request_id", pa.string()), ("itl_s", pa.float64())])


def base_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _headers(api_key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


def get_text(endpoint: str, path: str, api_key: str | None = None, timeout_s: float = 10.0) -> str | None:
    """GET ``path`` of a server; the body on 200, else None (never raises on HTTP errors)."""
    import httpx

    try:
        r = httpx.get(base_url(endpoint) + path, timeout=timeout_s, trust_env=False, headers=_headers(api_key))
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def scrape(endpoint: str, api_key: str | None = None) -> str | None:
    """One ``/metrics`` text (a Prometheus exposition), or None when the server has none."""
    text = get_text(endpoint, "/metrics", api_key)
    return text if text and ("# TYPE" in text or "# HELP" in text) else None


class Scraper:
    """Scrapes ``/metrics`` every ``interval_s`` on a daemon thread until ``stop()``."""

    def __init__(self, endpoint: str, interval_s: float = 1.0, api_key: str | None = None):
        if interval_s <= 0:
            raise ValueError(f"--scrape-interval must be > 0, got {interval_s}")
        self.endpoint, self.interval_s, self.api_key = endpoint, interval_s, api_key
        self.texts: list[tuple[int, str]] = []
        self.costs_s: list[float] = []
        self.num_failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="layerscope-scraper", daemon=True)

    def start(self) -> "Scraper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic_ns()
            text = scrape(self.endpoint, self.api_key)
            t1 = time.monotonic_ns()
            if text is None:
                self.num_failed += 1
            else:
                self.texts.append(((t0 + t1) // 2, text))
                self.costs_s.append((t1 - t0) / 1e9)
            self._stop.wait(max(0.0, self.interval_s - (t1 - t0) / 1e9))

    def cost(self) -> dict[str, Any]:
        """The scraping's own cost: count, seconds per scrape (mean, max), bytes per scrape."""
        n = len(self.costs_s)
        return {"num_scrapes": n, "num_failed": self.num_failed, "interval_s": self.interval_s,
                "mean_s": sum(self.costs_s) / n if n else None, "max_s": max(self.costs_s) if n else None,
                "mean_bytes": sum(len(t) for _, t in self.texts) / n if n else None}


def scrapes_table(texts: list[tuple[int, str]]) -> pa.Table:
    """Long form of timed expositions: one row per sample (histogram buckets kept)."""
    ts, metric, labels, value = [], [], [], []
    for t, text in texts:
        for s in parse(text).samples:
            ts.append(t)
            metric.append(s.name)
            labels.append(label_text(s.labels))
            value.append(s.value)
    return pa.table({"ts_ns": pa.array(ts, pa.int64()), "metric": metric, "labels": labels,
                     "value": pa.array(value, pa.float64())}, schema=SCRAPES)


def engine_info(endpoint: str | None = None, api_key: str | None = None, metrics_text: str | None = None,
                log: ServerLog | None = None) -> dict[str, Any]:
    """``{family, version, config, sources}`` from what the server and its log offer.

    config keys are the engine's own (``max_num_seqs``, ``enable_prefix_caching``...);
    where sources disagree the log's non-default args win (what the user set), then the
    server info, then the log's engine config line, then cache_config_info labels."""
    family = version = None
    config: dict[str, Any] = {}
    sources: list[str] = []
    non_default: dict[str, Any] = {}
    if metrics_text:
        exp = parse(metrics_text)
        family = detect_family(exp)
        for s in exp.samples:
            if s.name == "vllm:cache_config_info":
                config.update({k: _value(v) for k, v in s.labels if k not in ("model_name", "engine")})
                sources.append("cache_config_info")
                break
    if log is not None:
        family = family or log.family
        version = log.version
        config.update(log.config)
        non_default = dict(log.non_default_args)
        for k in ("attention_backend", "kv_cache_tokens", "max_concurrency"):
            if getattr(log, k) is not None:
                config[k] = getattr(log, k)
        sources.append("server_log")
    if endpoint:
        v = get_text(endpoint, "/version", api_key)
        if v:
            try:
                version = json.loads(v).get("version") or version
                family = family or "vllm"
                sources.append("/version")
            except (json.JSONDecodeError, AttributeError):
                pass
        info = get_text(endpoint, "/get_server_info", api_key)
        if info:
            try:
                d = json.loads(info)
            except json.JSONDecodeError:
                d = None
            if isinstance(d, dict):
                family = "sglang"
                version = d.get("version") or version
                config.update({k: v for k, v in d.items() if isinstance(v, (str, int, float, bool)) or v is None})
                sources.append("/get_server_info")
    config.update(non_default)
    return {"family": family, "version": version, "config": config, "non_default_args": non_default,
            "sources": sources}


def _value(v: str) -> Any:
    if v in ("True", "true"):
        return True
    if v in ("False", "false"):
        return False
    if v in ("None", ""):
        return None
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def read_server_log(path: str | Path | None) -> ServerLog | None:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--server-log {p}: no such file")
    return parse_log(p.read_text(errors="replace"))


def finish_bundle(path: str | Path, *, before: str | None, after: str | None, scraper: Scraper | None = None,
                  log: ServerLog | None = None, info: dict[str, Any] | None = None,
                  itls: dict[str, list[float]] | None = None, source: str = "bench",
                  client_summary: dict[str, Any] | None = None) -> Path:
    """Add the external capture to a bundle written by BundleWriter (see module doc);
    ``client_summary`` replaces the manifest's client summary (an imported tool's own figures)."""
    from layerscope.probes.bundle import MANIFEST, read_manifest, write_text

    p = Path(path)
    texts = list(scraper.texts) if scraper is not None else []
    if before is not None:
        (p / "metrics_before.prom").write_text(before)
    if texts:
        pq.write_table(scrapes_table(texts), p / "scrapes.parquet")
    if log is not None and log.stats:
        pq.write_table(pa.Table.from_pylist([{k: (float(v) if isinstance(v, (int, float)) else v)
                                              for k, v in r.items()} for r in log.stats]), p / "server_log.parquet")
    if itls:
        rows = [(rid, float(x)) for rid, xs in itls.items() for x in xs]
        pq.write_table(pa.table({"request_id": [r for r, _ in rows], "itl_s": [x for _, x in rows]}, schema=ITLS),
                       p / "itls.parquet")
    manifest = read_manifest(p)
    if client_summary is not None:
        manifest["summary"]["client"] = client_summary
    manifest["engine"] = info if info is not None else engine_info(metrics_text=after or before, log=log)
    manifest["external"] = {"source": source, "scrape": scraper.cost() if scraper is not None else None,
                            "has_metrics_before": before is not None, "has_metrics_after": after is not None,
                            "server_log": ({k: v for k, v in log.to_dict().items() if k != "config"}
                                           if log is not None else None)}
    write_text(p / MANIFEST, json.dumps(manifest, indent=1, default=str))
    return p


def client_itls(result) -> dict[str, list[float]]:
    """Per request id: the client-side gaps between streamed tokens (seconds)."""
    out = {}
    for rec in result.records:
        if rec.ok and len(rec.token_ns) > 1:
            out[rec.request_id or f"client-{rec.index}"] = rec.itl_s
    return out


def watch(endpoint: str, out: str | Path, duration_s: float, interval_s: float = 1.0, api_key: str | None = None,
          server_log: str | Path | None = None, overwrite: bool = False, command: list[str] | None = None) -> Path:
    """Record a live server for ``duration_s``: no load is sent. Returns the bundle path."""
    from layerscope.probes.bundle import BundleWriter

    if duration_s <= 0:
        raise ValueError(f"--duration must be > 0, got {duration_s}")
    before = scrape(endpoint, api_key)
    if before is None:
        raise ValueError(f"{base_url(endpoint)}/metrics: no Prometheus exposition (is the server up, and is its "
                         "metrics endpoint enabled? SGLang needs --enable-metrics)")
    scraper = Scraper(endpoint, interval_s, api_key)
    start = time.monotonic_ns()
    scraper.start()
    time.sleep(duration_s)
    scraper.stop()
    end = time.monotonic_ns()
    after = scrape(endpoint, api_key)
    log = read_server_log(server_log)
    writer = BundleWriter(out, command=command or ["layerscope", "watch", endpoint], config={}, workload={},
                          faults={}, probes="off", overwrite=overwrite)
    writer.start_ns, writer.end_ns = start, end
    if after:
        writer.add_metrics_text(after)
    path = writer.write()
    info = engine_info(endpoint, api_key, after or before, log)
    return finish_bundle(path, before=before, after=after, scraper=scraper, log=log, info=info, source="watch")
