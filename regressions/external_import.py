"""Import what people already have into a run bundle (``layerscope import ...``).

- ``import_metrics``: one or two saved ``/metrics`` texts (``curl`` output) of vLLM (any
  version), SGLang or ours: the engine snapshot, and with two the deltas over the interval.
- ``import_vllm_bench``: ``vllm bench serve --save-result [--save-detailed]`` JSON: per
  request ``ttfts``, ``itls``, ``latencies``, ``input_lens``, ``output_lens``,
  ``start_times`` when present, else the summary only (vLLM <= 0.9 saved no
  ``latencies``: then ttft + sum(itls), which is how its client measured latency).
- ``import_sglang_bench``: ``python -m sglang.bench_serving --output-file`` JSONL (the last
  line is the run; ``--output-details`` adds the per-request lists).

Each takes optional ``metrics=(BEFORE, AFTER)`` and ``server_log``; the bundle's
requests.parquet holds the client-side figures, ``itls.parquet`` the per-token gaps, and
the manifest the engine (family, version, config) and the tool's summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerscope.regressions.capture import engine_info, finish_bundle, read_server_log

_MS = ("ttft", "tpot", "itl", "e2el", "e2e_latency")


def _read(path: str | Path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} {p}: no such file")
    return p.read_text(errors="replace")


def _writer(out: str | Path, command: list[str], workload: dict[str, Any], overwrite: bool):
    from layerscope.probes.bundle import BundleWriter

    return BundleWriter(out, command=command, config={}, workload=workload, faults={}, probes="off",
                        overwrite=overwrite)


def import_metrics(scrape: str | Path, scrape_after: str | Path | None, out: str | Path, *,
                   server_log: str | Path | None = None, overwrite: bool = False) -> Path:
    """A bundle from one or two saved /metrics texts (BEFORE [AFTER])."""
    from layerscope.diagnose.external.exposition import parse

    first = _read(scrape, "metrics")
    second = _read(scrape_after, "metrics") if scrape_after else None
    for name, text in ((scrape, first), (scrape_after, second)):
        if text is not None and not parse(text).samples:
            raise ValueError(f"{name}: no Prometheus samples in it (expected a saved /metrics text)")
    after = second if second is not None else first
    before = first if second is not None else None
    log = read_server_log(server_log)
    w = _writer(out, ["layerscope", "import", "metrics", str(scrape)] + ([str(scrape_after)] if scrape_after else []),
                {}, overwrite)
    w.add_metrics_text(after)
    path = w.write()
    return finish_bundle(path, before=before, after=after, log=log, info=engine_info(metrics_text=after, log=log),
                         source="import-metrics")


def _per_request_rows(d: dict[str, Any], prefix: str) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """requests.parquet rows and ITLs from per-request lists (seconds), where present."""
    ttfts, lats = d.get("ttfts"), d.get("latencies") or d.get("e2e_latencies")
    if not isinstance(ttfts, list) or not ttfts:
        return [], {}
    n = len(ttfts)
    starts = d.get("start_times") if isinstance(d.get("start_times"), list) and len(d["start_times"]) == n else None
    t0 = min(starts) if starts else 0.0
    errors = d.get("errors") if isinstance(d.get("errors"), list) else [""] * n
    ins, outs = d.get("input_lens") or [None] * n, d.get("output_lens") or [None] * n
    itls = d.get("itls") if isinstance(d.get("itls"), list) else [[]] * n
    rows, gaps = [], {}
    for i in range(n):
        rid = f"{prefix}-{i}"
        err = errors[i] if i < len(errors) else ""
        send = int(((starts[i] - t0) if starts else 0.0) * 1e9)
        ttft = ttfts[i]
        lat = lats[i] if isinstance(lats, list) and i < len(lats) else None
        if lat is None and ttft is not None and i < len(itls) and isinstance(itls[i], list):
            # vLLM <= 0.9 saves no latencies: its client measures latency as the last chunk's
            # arrival, which is ttft + the sum of the gaps it saved (endpoint_request_func.py)
            lat = ttft + sum(itls[i])
        ok = not err and ttft is not None and ttft > 0
        rows.append({
            "request_id": rid, "status": "finished_length" if ok else "error", "error": err or None,
            "num_prompt_tokens": ins[i] if i < len(ins) else None,
            "num_output_tokens": outs[i] if i < len(outs) else None,
            "client_send_ns": send,
            "client_first_token_ns": send + int(ttft * 1e9) if ok else None,
            "client_done_ns": send + int(lat * 1e9) if ok and lat is not None else None,
        })
        if ok and i < len(itls) and isinstance(itls[i], list) and itls[i]:
            gaps[rid] = [float(x) for x in itls[i]]
    return rows, gaps


def _summary(d: dict[str, Any]) -> dict[str, Any]:
    """The tool's own headline figures (latencies converted from ms to s, with _s names)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, (list, dict)):
            continue
        if k.endswith("_ms") and isinstance(v, (int, float)):
            out[k[:-3] + "_s"] = v / 1e3
        else:
            out[k] = v
    return out


def _import_bench(d: dict[str, Any], out: str | Path, tool: str, src: str | Path, metrics, server_log,
                  overwrite: bool) -> Path:
    rows, gaps = _per_request_rows(d, tool)
    before = _read(metrics[0], "--metrics") if metrics else None
    after = _read(metrics[1], "--metrics") if metrics and len(metrics) > 1 else None
    log = read_server_log(server_log)
    workload = {"name": f"{tool}:{d.get('dataset_name') or d.get('dataset') or 'unknown'}", "kind": "imported",
                "seed": d.get("seed"), "num_requests": d.get("num_prompts") or len(rows) or d.get("completed"),
                "rate": d.get("request_rate"), "burstiness": d.get("burstiness"),
                "max_concurrency": d.get("max_concurrency") or d.get("concurrency")}
    w = _writer(out, ["layerscope", "import", tool, str(src)], {k: v for k, v in workload.items() if v is not None},
                overwrite)
    w.add_request_fields(rows)
    if after:
        w.add_metrics_text(after)
    if rows:
        sends = [r["client_send_ns"] for r in rows]
        dur = d.get("duration")
        w.start_ns, w.end_ns = min(sends), min(sends) + int((dur or 0) * 1e9)
    path = w.write()
    info = engine_info(metrics_text=after or before, log=log)
    info["family"] = info["family"] or ("vllm" if tool == "vllm-bench" else "sglang")
    info["config"].setdefault("model", d.get("model_id") or d.get("model"))
    return finish_bundle(path, before=before, after=after, log=log, info=info, itls=gaps, source=f"import-{tool}",
                         client_summary={**_summary(d), "per_request": bool(rows)})


def import_vllm_bench(result: str | Path, out: str | Path, *, metrics: tuple[str, ...] | None = None,
                      server_log: str | Path | None = None, overwrite: bool = False) -> Path:
    """A bundle from a ``vllm bench serve --save-result`` JSON."""
    try:
        d = json.loads(_read(result, "vllm bench result"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{result}: not JSON ({e})") from None
    if not isinstance(d, dict) or not ({"completed", "duration"} <= set(d)):
        raise ValueError(f"{result}: not a `vllm bench serve --save-result` JSON (expected keys completed, "
                         f"duration; found {', '.join(sorted(d)[:12]) if isinstance(d, dict) else type(d).__name__})")
    return _import_bench(d, out, "vllm-bench", result, metrics, server_log, overwrite)


def import_sglang_bench(result: str | Path, out: str | Path, *, metrics: tuple[str, ...] | None = None,
                        server_log: str | Path | None = None, overwrite: bool = False) -> Path:
    """A bundle from a ``sglang.bench_serving --output-file`` JSONL (its last line)."""
    lines = [ln for ln in _read(result, "sglang bench result").splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{result}: empty (expected one JSON object per line)")
    try:
        d = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise ValueError(f"{result}: the last line is not JSON ({e})") from None
    if not isinstance(d, dict) or "completed" not in d:
        raise ValueError(f"{result}: not a sglang bench_serving result line (expected key completed)")
    return _import_bench(d, out, "sglang-bench", result, metrics, server_log, overwrite)
