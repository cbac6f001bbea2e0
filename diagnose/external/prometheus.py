"""Read a fleet's window from Prometheus (or Thanos, Mimir, VictoriaMetrics) into an external bundle.

The store aggregates: histogram and counter deltas are ``increase()`` over the window, summed
``by (replica label)`` in PromQL; gauges come back as ``*_over_time`` per replica and as a fleet
range query at a step keeping a series under ``MAX_POINTS``. The fleet total is the sum of the
per-replica rows (a few hundred numbers). Engine family, version and config come from the metric
names and the info metrics' labels (``vllm:cache_config_info``, ``layerscope_config_info``, any
``*_info`` with a ``version`` label). docs/fleet.md has the commands.
"""

from __future__ import annotations

import json
import math
import re
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from layerscope.diagnose.external.exposition import Exposition, Sample, histogram_quantile
from layerscope.diagnose.external.names import CONCEPTS, Resolved, detect_family, normalize, resolve

MAX_POINTS = 400  # points per range query series: enough for change points, cheap to fetch
HISTOGRAMS = ("ttft", "tpot", "itl", "e2e", "queue_time", "prefill_time", "decode_time", "inference_time",
              "iteration_tokens")
# histograms whose buckets are read (TTFT quantiles per replica; the server-side comparison's
# variance bounds); the others' sums and counts only: a vLLM histogram has ~20 buckets per replica
BUCKETED = ("ttft", "queue_time", "prefill_time", "decode_time")
COUNTERS = ("preemptions", "prefix_queries", "prefix_hits", "prompt_tokens", "generation_tokens",
            "requests_finished", "requests_aborted")
GAUGES = ("running", "waiting", "kv_usage")
INFO_SKIP = {"__name__", "job", "instance", "model_name", "engine", "replica", "le"}
VERSION_KEYS = ("version", "vllm_version", "sglang_version", "layerscope_version")


class PrometheusError(ValueError):
    """A Prometheus that cannot be reached, refuses a query, or holds nothing for the selector."""


# ---- times ---------------------------------------------------------------------------------------
_DUR = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_UNIT = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(s: str) -> float:
    m = _DUR.match(s.strip())
    if not m:
        raise PrometheusError(f"duration {s!r}: expected a number and a unit (ms, s, m, h, d, w), e.g. 90s, 6h")
    return float(m.group(1)) * _UNIT[m.group(2)]


def parse_time(s: str) -> float:
    """Unix seconds or RFC 3339 (a time without a zone is UTC)."""
    s = s.strip()
    try:
        return float(s)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise PrometheusError(f"time {s!r}: expected Unix seconds or RFC 3339 (2026-12-05T10:00:00Z)") from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def parse_range(s: str) -> tuple[float, float]:
    """``START..END`` (each Unix seconds or RFC 3339)."""
    if ".." not in s:
        raise PrometheusError(f"window {s!r}: expected START..END (Unix seconds or RFC 3339)")
    a, b = (parse_time(x) for x in s.split("..", 1))
    if b <= a:
        raise PrometheusError(f"window {s!r}: END must come after START")
    return a, b


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def promql_duration(seconds: float) -> str:  # whole seconds: "302400s"
    return f"{max(1, int(round(seconds)))}s"


# ---- the HTTP API --------------------------------------------------------------------------------
@dataclass
class Prom:
    """The Prometheus HTTP API at ``url``: bearer or basic auth, TLS verify / CA file, a timeout."""

    url: str
    bearer: str | None = None
    basic: tuple[str, str] | None = None
    verify: bool | str = True
    timeout_s: float = 30.0
    num_queries: int = field(default=0, init=False)

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise PrometheusError(f"--prometheus {self.url!r}: expected an http:// or https:// base URL")
        verify: Any = self.verify
        if isinstance(verify, str):
            if not Path(verify).is_file():
                raise PrometheusError(f"--ca-file {verify}: no such file")
            verify = ssl.create_default_context(cafile=verify)
        headers = {"Authorization": f"Bearer {self.bearer}"} if self.bearer else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, auth=self.basic, verify=verify,
                                  timeout=self.timeout_s)

    def api(self, path: str, params: dict[str, Any], method: str = "POST") -> Any:
        self.num_queries += 1
        try:
            r = (self._http.post(path, data=params) if method == "POST" else self._http.get(path, params=params))
        except httpx.TimeoutException:
            raise PrometheusError(f"{self.url}{path}: no answer within {self.timeout_s:g} s (--timeout)") from None
        except httpx.HTTPError as e:
            raise PrometheusError(f"cannot reach Prometheus at {self.url} ({type(e).__name__}: {e})") from None
        if r.status_code in (401, 403):
            raise PrometheusError(f"{self.url}{path}: HTTP {r.status_code} {r.reason_phrase} (check --bearer-token, "
                                  "--basic-auth)")
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("status") not in ("success", "error"):
            kind = r.headers.get("content-type", "?")
            raise PrometheusError(f"{self.url}{path} answered HTTP {r.status_code} ({kind}), not the Prometheus HTTP "
                                  f"API's JSON: is {self.url} the base URL of a Prometheus (or Thanos, Mimir, "
                                  "VictoriaMetrics)?")
        if body["status"] != "success":
            what = params.get("query") or params.get("match[]") or path
            raise PrometheusError(f"Prometheus at {self.url} refused {what!r}: {body.get('errorType')}: "
                                  f"{body.get('error')}")
        return body["data"]

    def query(self, q: str, t: float) -> list[dict]:
        return self.api("/api/v1/query", {"query": q, "time": f"{t:.3f}"})["result"]

    def query_range(self, q: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("/api/v1/query_range", {"query": q, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                "step": f"{max(step, 0.001):.3f}"})["result"]

    def label_values(self, label: str, match: str, start: float, end: float) -> list[str]:
        return self.api(f"/api/v1/label/{label}/values", {"match[]": match, "start": f"{start:.3f}",
                                                          "end": f"{end:.3f}"}, method="GET")

    def many(self, queries: dict[str, str], t: float) -> dict[str, list[dict]]:
        """Instant queries at ``t``, a few at a time (the store runs them in parallel)."""
        with ThreadPoolExecutor(4) as pool:
            futs = {k: pool.submit(self.query, q, t) for k, q in queries.items()}
            return {k: f.result() for k, f in futs.items()}


# ---- selectors and names -------------------------------------------------------------------------
def matchers(selector: str | None) -> str:
    """The inside of ``{job="vllm"}`` (empty for none)."""
    s = (selector or "").strip()
    if not s:
        return ""
    if not (s.startswith("{") and s.endswith("}")):
        raise PrometheusError(f"--selector {selector!r}: expected label matchers in braces, e.g. '{{job=\"vllm\"}}'")
    return s[1:-1].strip()


def sel(name: str, m: str, extra: str = "") -> str:
    return f"{name}{{{','.join(x for x in (m, extra) if x)}}}"


@dataclass
class Source:
    """What one selector holds in a time range: the metric names, the family and its concepts."""

    prom: Prom
    selector: str
    m: str
    names: set[str]
    resolved: Resolved
    by: str

    def raw(self, name: str) -> str:
        """The stored spelling of a normalized name (SGLang's ``sglang_`` spelling)."""
        alt = "sglang_" + name[len("sglang:"):] if name.startswith("sglang:") else name
        return alt if name not in self.names and alt in self.names else name

    def metric(self, concept: str, suffix: str = "") -> str | None:
        n = self.resolved.names.get(concept)
        return None if n is None else self.raw(n + suffix)

    def info_names(self) -> list[str]:
        return sorted(n for n in self.names if n.endswith("_info"))


def open_source(prom: Prom, selector: str | None, start: float, end: float, by: str = "instance") -> Source:
    """The names under ``selector`` in [start, end]; an empty selection names the jobs that exist."""
    m = matchers(selector)
    match = "{" + (m or '__name__=~".+"') + "}"
    names = set(prom.label_values("__name__", match, start, end))
    if not names:
        jobs = prom.label_values("job", '{__name__=~".+"}', start, end)
        raise PrometheusError(f"no series match {selector or '{}'} between {iso(start)} and {iso(end)} on {prom.url}; "
                              f"jobs with data then: {', '.join(jobs[:20]) or 'none'}")
    norm = {normalize(n) for n in names}
    family = detect_family(norm)
    resolved = resolve(Exposition([Sample(n, (), 0.0) for n in norm]), family)
    if family is None:
        raise PrometheusError(f"{selector}: {len(names)} metrics, none of vLLM, SGLang or layerscope "
                              f"(e.g. {', '.join(sorted(names)[:6])})")
    return Source(prom, selector or "{}", m, names, resolved, replica_label(prom, m, resolved, by, start, end))


REPLICA_LABELS = ("instance", "engine", "replica", "pod")


def replica_label(prom: Prom, m: str, resolved: Resolved, by: str, start: float, end: float) -> str:
    """``by`` where the engine's series carry it, else the first of REPLICA_LABELS they do carry (vLLM
    names a replica ``engine``, our native names ``replica``, every scrape ``instance``)."""
    probe = next((n for c, n in resolved.names.items() if CONCEPTS[c].kind in ("gauge", "counter")), None)
    if probe is None:
        return by
    for label in (by, *[x for x in REPLICA_LABELS if x != by]):
        if prom.label_values(label, "{" + ",".join(x for x in (m, f'__name__="{probe}"') if x) + "}", start, end):
            return label
    return by


# ---- one window, per replica ---------------------------------------------------------------------
def _vec(result: list[dict], by: str | None, extra: str | None = None) -> dict:
    """{replica: value} or {(replica, extra): value} from an instant vector (by None: "fleet")."""
    out = {}
    for r in result:
        k = r["metric"].get(by, "") if by else "fleet"
        out[(k, r["metric"].get(extra, "")) if extra else k] = float(r["value"][1])
    return out


def window_queries(src: Source, end: float, dur: float, narrow: str = "", by: str | None = None) -> dict[str, str]:
    """The window's queries, per replica (``by``) or for the fleet in one row (None: what a
    comparison needs; a few numbers come back instead of one row per replica and bucket)."""
    d, m = promql_duration(dur), ",".join(x for x in (src.m, narrow) if x)
    g, gle = (f"by ({by})", f"by ({by}, le)") if by else ("", "by (le)")
    q: dict[str, str] = {}
    for c in HISTOGRAMS:
        if src.metric(c) is None:
            continue
        if c in BUCKETED:  # the +Inf bucket is the count
            q[f"{c}:bucket"] = f"sum {gle} (increase({sel(src.metric(c, '_bucket'), m)}[{d}]))"
        for part in ("sum",) if c in BUCKETED else ("sum", "count"):
            q[f"{c}:{part}"] = f"sum {g} (increase({sel(src.metric(c, '_' + part), m)}[{d}]))"
    for c in COUNTERS:
        if src.metric(c) is not None:
            q[c] = f"sum {g} (increase({sel(src.metric(c), m)}[{d}]))"
    if src.metric("requests_finished") is not None:
        bad = sel(src.metric("requests_finished"), m, 'finished_reason=~"abort|error"')
        q["aborted_reason"] = f"sum {g} (increase({bad}[{d}]))"
    if not by:
        return q  # the fleet's gauges come as series (fleet_series)
    for c in GAUGES:
        if src.metric(c) is not None:
            q[f"{c}:mean"] = f"sum by ({by}) (avg_over_time({sel(src.metric(c), m)}[{d}]))"
            q[f"{c}:max"] = f"max by ({by}) (max_over_time({sel(src.metric(c), m)}[{d}]))"
    q["up"] = f"avg by ({by}) (avg_over_time({sel('up', m)}[{d}]))"
    return q


@dataclass
class Window:
    """One window's per-replica figures (histogram increases kept) and the fleet total."""

    start: float
    end: float
    hists: dict[str, dict[str, tuple[list[float], list[float], float, float]]]  # concept -> replica -> hist
    counters: dict[str, dict[str, float]]
    gauges: dict[str, dict[str, float]]  # "kv_usage:mean" -> replica -> value
    replicas: list[str]
    per_replica: bool = True  # False: one "fleet" row (what a comparison needs)

    def total_hist(self, c: str) -> tuple[list[float], list[float], float, float] | None:
        hs = list(self.hists.get(c, {}).values())
        if not hs:
            return None
        bounds = sorted({b for h in hs for b in h[0]})
        counts = [sum(h[1][h[0].index(b)] for h in hs if b in h[0]) for b in bounds]
        return bounds, counts, sum(h[2] for h in hs), sum(h[3] for h in hs)


def read_window(src: Source, start: float, end: float, narrow: str = "", per_replica: bool = True) -> Window:
    by = src.by if per_replica else None
    res = src.prom.many(window_queries(src, end, end - start, narrow, by), end)
    hists: dict[str, dict] = {}
    for c in HISTOGRAMS:
        if f"{c}:sum" not in res:
            continue
        sums = _vec(res[f"{c}:sum"], by)
        per: dict[str, dict[float, float]] = {}
        if f"{c}:bucket" in res:
            for (rep, le), v in _vec(res[f"{c}:bucket"], by, "le").items():
                per.setdefault(rep, {})[float(le)] = v
        else:  # means only: one +Inf bucket holding the count
            per = {rep: {math.inf: v} for rep, v in _vec(res[f"{c}:count"], by).items()}
        hists[c] = {rep: (sorted(b), [b[k] for k in sorted(b)], sums.get(rep, 0.0), b.get(math.inf, 0.0))
                    for rep, b in per.items()}
    counters = {c: _vec(res[c], by) for c in (*COUNTERS, "aborted_reason") if c in res}
    gauges = {k: _vec(v, by) for k, v in res.items() if k.endswith((":mean", ":max")) or k == "up"}
    reps = sorted({r for d in (*hists.values(), *counters.values(), *gauges.values()) for r in d} - {""})
    return Window(start, end, hists, counters, gauges, reps, per_replica)


def _mean(h) -> float:
    return h[2] / h[3] if h is not None and h[3] > 0 else math.nan


def replica_table(w: Window) -> pd.DataFrame:
    """One row per replica: what the fleet report compares (docs/fleet.md)."""
    dur = w.end - w.start
    rows = []
    for rep in w.replicas:
        h = {c: w.hists.get(c, {}).get(rep) for c in HISTOGRAMS}
        cnt = {c: w.counters.get(c, {}).get(rep) for c in w.counters}
        g = {k: v.get(rep) for k, v in w.gauges.items()}
        fin = cnt.get("requests_finished")
        bad = cnt.get("requests_aborted") if cnt.get("requests_aborted") is not None else cnt.get("aborted_reason")
        rows.append({
            "replica": rep, "up": g.get("up"), "requests": h["e2e"][3] if h["e2e"] else fin,
            "requests_per_s": (h["e2e"][3] if h["e2e"] else (fin or 0.0)) / dur,
            "output_tokens_per_s": (cnt.get("generation_tokens") or 0.0) / dur,
            "ttft_p50_s": histogram_quantile(0.5, *h["ttft"][:2]) if h["ttft"] else math.nan,
            "ttft_p99_s": histogram_quantile(0.99, *h["ttft"][:2]) if h["ttft"] else math.nan,
            "tpot_mean_s": _mean(h["tpot"]), "itl_mean_s": _mean(h["itl"]), "e2e_mean_s": _mean(h["e2e"]),
            "queue_mean_s": _mean(h["queue_time"]), "prefill_mean_s": _mean(h["prefill_time"]),
            "decode_mean_s": _mean(h["decode_time"]),
            "kv_usage_mean": g.get("kv_usage:mean"), "kv_usage_max": g.get("kv_usage:max"),
            "waiting_mean": g.get("waiting:mean"), "waiting_max": g.get("waiting:max"),
            "running_mean": g.get("running:mean"), "preemptions": cnt.get("preemptions"),
            "error_rate": (bad / fin) if bad is not None and fin else (0.0 if fin else math.nan),
        })
    return pd.DataFrame(rows).astype({"replica": str})


# ---- engine, version and config from the info metrics ------------------------------------------
def info_labels(src: Source, t: float, lookback: float, narrow: str = "") -> dict[str, dict[str, str]]:
    """replica -> the info metrics' labels at ``t`` (config keys and version), newest series only."""
    m = ",".join(x for x in (src.m, narrow) if x)
    out: dict[str, dict[str, str]] = {}
    for n in src.info_names():
        res = (src.prom.query(sel(n, m), t)
               or src.prom.query(f"last_over_time({sel(n, m)}[{promql_duration(lookback)}])", t))
        for r in res:
            rep = r["metric"].get(src.by, "")
            out.setdefault(rep, {}).update({k: v for k, v in r["metric"].items() if k not in INFO_SKIP})
    return out


def _value(v: str) -> Any:
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return {"True": True, "False": False, "true": True, "false": False, "None": None}.get(v, v)


def engine_of(src: Source, labels: dict[str, dict[str, str]], replicas: list[str] | None = None) -> dict[str, Any]:
    """The manifest's ``engine`` for a set of replicas: the most common config among them."""
    chosen = [labels[r] for r in (replicas or labels) if r in labels]
    keyed = [json.dumps(x, sort_keys=True) for x in chosen]
    common = json.loads(max(set(keyed), key=keyed.count)) if keyed else {}
    version = next((common.pop(k) for k in VERSION_KEYS if k in common), None)
    for k in VERSION_KEYS:
        common.pop(k, None)
    return {"family": src.resolved.family, "version": version, "config": {k: _value(v) for k, v in common.items()},
            "non_default_args": {}, "sources": ["prometheus:" + n for n in src.info_names()],
            "replicas_reporting": len(chosen), "distinct_configs": len(set(keyed))}


# ---- the bundle ----------------------------------------------------------------------------------
def exposition_text(src: Source, w: Window) -> str:
    """The window's fleet totals as an exposition under the engine's own names: what an external
    bundle's ``metrics.prom`` holds (already deltas: the bundle has no ``metrics_before.prom``)."""
    lines = []
    for c in HISTOGRAMS:
        h = w.total_hist(c)
        if h is None:
            continue
        n = src.resolved.names[c]
        lines.append(f"# TYPE {n} histogram")
        lines += [f'{n}_bucket{{le="{"+Inf" if math.isinf(b) else repr(float(b))}"}} {v!r}' for b, v in zip(h[0], h[1])]
        lines += [f"{n}_sum {h[2]!r}", f"{n}_count {h[3]!r}"]
    for c in COUNTERS:
        if c in w.counters:
            n = src.resolved.names[c]
            lines += [f"# TYPE {n} counter", f"{n} {sum(w.counters[c].values())!r}"]
    return "\n".join(lines) + "\n"


def fleet_series(src: Source, start: float, end: float, narrow: str = "") -> pa.Table:
    """The fleet's gauges (summed over replicas) at a step under MAX_POINTS: ``scrapes.parquet``."""
    step = max((end - start) / MAX_POINTS, 1.0)
    m = ",".join(x for x in (src.m, narrow) if x)
    ts, metric, value = [], [], []
    for c in GAUGES:
        n = src.metric(c)
        if n is None:
            continue
        for r in src.prom.query_range(f"sum({sel(n, m)})", start, end, step):
            for t, v in r["values"]:
                ts.append(int(float(t) * 1e9))
                metric.append(src.resolved.names[c])
                value.append(float(v))
    return pa.table({"ts_ns": pa.array(ts, pa.int64()), "metric": metric, "labels": [""] * len(ts),
                     "value": pa.array(value, pa.float64())})


def write_bundle(src: Source, w: Window, out: str | Path, engine: dict[str, Any], *, command: list[str],
                 narrow: str = "", overwrite: bool = False) -> Path:
    """An external bundle (docs/external.md) of one window: no client records, the server's deltas,
    the fleet's gauges, ``replicas.parquet`` (one row per replica) and the manifest's engine."""
    from layerscope.probes.schema import BUNDLE_FORMAT, REQUESTS, SCHEMA_VERSION

    p = Path(out)
    if p.exists() and any(p.iterdir()) and not overwrite:
        raise FileExistsError(f"{p}: exists and is not empty (--overwrite replaces it)")
    p.mkdir(parents=True, exist_ok=True)
    pq.write_table(REQUESTS.empty_table(), p / "requests.parquet")
    (p / "metrics.prom").write_text(exposition_text(src, w))
    pq.write_table(fleet_series(src, w.start, w.end, narrow), p / "scrapes.parquet")
    if w.per_replica:
        pq.write_table(pa.Table.from_pandas(replica_table(w), preserve_index=False), p / "replicas.parquet")
    manifest = {
        "format": BUNDLE_FORMAT, "schema_version": SCHEMA_VERSION, "run_id": p.name, "command": command, "start_ns": int(w.start * 1e9), "end_ns": int(w.end * 1e9),
        "start_time": iso(w.start), "workload": {}, "summary": {"client": {"duration_s": w.end - w.start}},
        "engine": engine,
        "external": {"source": "import-prometheus", "prometheus": src.prom.url, "selector": src.selector,
                     "narrow": narrow or None, "replica_label": src.by, "window": [iso(w.start), iso(w.end)],
                     "replicas": len(w.replicas), "has_metrics_before": False, "has_metrics_after": True},
    }
    (p / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    return p
