"""Grafana dashboards generated from the metric registry (``layerscope.probes.metrics``).

Nothing here is hand-written PromQL: every query comes from a ``MetricDef`` through a
few builders that follow the metric's type:

- histogram: ``histogram_quantile(q, sum by (le) (rate(<name>_bucket[...])))`` for p50/p90/p99,
  and the mean ``sum(rate(<name>_sum[...])) / sum(rate(<name>_count[...]))``;
- counter: ``sum(rate(<name>[...]))``;
- gauge: the value, summed (counts) or averaged (ratios) per replica.

The layout below only says *which* metrics a panel shows and how (quantiles, mean,
rate, ...); names, label matchers, suffixes, units and descriptions come from the
registry. A metric the layout does not mention still gets a default panel in its
layer's row, so a metric added to the registry shows up on the next build, and a
layout entry that names a metric the registry lacks fails the build.

Two dashboards, ``layerscope-overview`` (latencies, throughput, goodput, errors, request rate)
and ``layerscope-layers`` (a row per layer), with a ``DS_PROMETHEUS`` import input and
``model_name`` / ``replica`` variables; a rebuild is byte-identical.

Why one file past 400 lines: the two dashboards' layouts are data (rows of panels per layer) and
read best in one place beside the few panel builders they call; splitting them would scatter one
table over several files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from prometheus_client.utils import floatToGoString

from layerscope.contract import LAYERS
from layerscope.probes.metrics import BASE_LABELS, GATEWAY_REPLICA, METRICS, REQUEST_LAYER, MetricDef

SCHEMA_VERSION = 39  # Grafana 10.4/11 dashboard schema
GRAFANA_VERSION = "10.4.0"  # the oldest Grafana the JSON is written for (__requires)
DS_INPUT = "DS_PROMETHEUS"
DATASOURCE = {"type": "prometheus", "uid": "${" + DS_INPUT + "}"}
TAGS = ("layerscope",)
RATE_INTERVAL = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)

# Metrics of these layers are recorded by the gateway process (replica="gateway"):
# their panels are not filtered by $replica, which selects engine replicas.
GATEWAY_PROCESS_LAYERS = ("gateway.queue",)

# One line per layer (DESIGN.md, "The layer taxonomy"), for the row panels.
LAYER_TITLES: dict[str, str] = {
    REQUEST_LAYER: "end-to-end request latency (spans every layer)",
    "client": "load generator side",
    "gateway.queue": "gateway admission queue and limits",
    "gateway.route": "router decision and hand-off to a replica",
    "engine.queue": "engine waiting queue until first scheduled",
    "engine.schedule": "engine steps: scheduling, batch composition, host time",
    "engine.kv": "KV blocks, preemption and the prefix cache",
    "model.forward": "model compute: prefill, decode, per-layer forward",
    "parallel.collective": "tensor-parallel collectives and rank skew",
    "kernel.compute": "time inside kernels/ops",
    "kernel.launch_gap": "device idle between kernels/ops",
    "engine.output": "sampled tokens, finished requests, errors",
    "hardware": "uniform compute slowdown",
    "workload": "offered load",
}

# Said in the description of every panel of these layers.
LAYER_NOTES: dict[str, str] = {
    "parallel.collective": "Data only with tensor parallelism (serve --tp 2 or more); empty on a TP=1 server.",
    "kernel.launch_gap": "Moves only under --probes full (profiler windows); 0 otherwise.",
}

# Grafana unit ids by MetricDef.unit: for a value, and for its per-second rate.
VALUE_UNITS = {"seconds": "s", "ratio": "percentunit"}
RATE_UNITS = {"requests": "reqps"}
DEFAULT_UNIT = "short"


def value_unit(m: MetricDef) -> str:
    return VALUE_UNITS.get(m.unit, DEFAULT_UNIT)


def rate_unit(m: MetricDef) -> str:
    return RATE_UNITS.get(m.unit, DEFAULT_UNIT)


def le_value(bound: float) -> str:
    """A bucket bound as the ``le`` label prometheus_client exposes (1.0 -> "1.0")."""
    return floatToGoString(bound)


# ---- PromQL from MetricDefs -------------------------------------------------------------------
@dataclass(frozen=True)
class Scope:
    """Where queries run: label matchers (regexes) on the base labels, and the rate window.

    Grafana panels use the template variables and ``$__rate_interval``; rules use no
    matchers and a fixed window.
    """

    matchers: tuple[tuple[str, str], ...] = ()
    window: str = "5m"


GRAFANA = Scope(matchers=(("model_name", "$model_name"), ("replica", "$replica")), window=RATE_INTERVAL)


Matcher = tuple[str, str, str]  # (label, op, value): op is one of = != =~ !~


def selector(m: MetricDef, scope: Scope, suffix: str = "", match: Sequence[Matcher] = ()) -> str:
    """``<name><suffix>{label=~"regex", ...}``: scope matchers on the metric's labels, then ``match``."""
    parts = []
    for label, regex in scope.matchers:
        if label not in m.labels:
            continue
        if label == "replica" and m.layer in GATEWAY_PROCESS_LAYERS:
            continue
        parts.append(f'{label}=~"{regex}"')
    for label, op, value in match:
        if op not in ("=", "!=", "=~", "!~"):
            raise ValueError(f"bad matcher operator {op!r}")
        if label not in m.labels and not (label == "le" and m.type == "histogram"):
            raise ValueError(f"{m.name} has no label {label!r}")
        parts.append(f'{label}{op}"{value}"')
    return f"{m.name}{suffix}{{{', '.join(parts)}}}" if parts else f"{m.name}{suffix}"


def _agg(fn: str, by: Sequence[str], inner: str) -> str:
    return f"{fn} by ({', '.join(by)}) ({inner})" if by else f"{fn}({inner})"


def _check_by(m: MetricDef, by: Sequence[str]) -> None:
    for label in by:
        if label not in m.labels:
            raise ValueError(f"{m.name} has no label {label!r} to group by")


def q_rate(m: MetricDef, scope: Scope, by: Sequence[str] = (), suffix: str = "",
           match: Sequence[Matcher] = ()) -> str:
    """Per-second rate of a counter (or of a histogram's ``_count``/``_sum``/``_bucket``), summed."""
    if m.type == "counter" and suffix:
        raise ValueError(f"{m.name} is a counter: no {suffix} series")
    if m.type == "histogram" and not suffix:
        raise ValueError(f"{m.name} is a histogram: rate one of its _bucket/_sum/_count series")
    if m.type == "gauge":
        raise ValueError(f"{m.name} is a gauge: rate() applies to counters")
    _check_by(m, [b for b in by if b != "le"])
    return _agg("sum", by, f"rate({selector(m, scope, suffix, match)}[{scope.window}])")


def q_quantile(m: MetricDef, q: float, scope: Scope, by: Sequence[str] = (), match: Sequence[Matcher] = ()) -> str:
    _need(m, "histogram")
    return f"histogram_quantile({q}, {q_rate(m, scope, (*by, 'le'), '_bucket', match)})"


def q_mean(m: MetricDef, scope: Scope, by: Sequence[str] = (), match: Sequence[Matcher] = ()) -> str:
    _need(m, "histogram")
    return f"{q_rate(m, scope, by, '_sum', match)} / {q_rate(m, scope, by, '_count', match)}"


def q_gauge(m: MetricDef, scope: Scope, by: Sequence[str] = ()) -> str:
    """A gauge per group: averaged for ratios (0..1), summed for counts."""
    _need(m, "gauge")
    _check_by(m, by)
    return _agg("avg" if m.unit == "ratio" else "sum", by, selector(m, scope))


def q_ratio(num: MetricDef, den: MetricDef, scope: Scope, by: Sequence[str] = ()) -> str:
    """rate(num) / rate(den), both counters."""
    _need(num, "counter")
    _need(den, "counter")
    return f"{q_rate(num, scope, by)} / {q_rate(den, scope, by)}"


def q_error_ratio(errors: MetricDef, ok: MetricDef, scope: Scope, by: Sequence[str] = ()) -> str:
    """errors / (errors + ok): 0, not empty, when no error has been counted yet.

    Error counters have no series until the first error, so ``rate(errors)`` is filled
    with ``rate(ok) * 0`` (same label set) before dividing.
    """
    _need(errors, "counter")
    _need(ok, "counter")
    err = f"({q_rate(errors, scope, by)} or {q_rate(ok, scope, by)} * 0)"
    return f"{err} / ({err} + {q_rate(ok, scope, by)})"


def _need(m: MetricDef, type_: str) -> None:
    if m.type != type_:
        raise ValueError(f"{m.name} is a {m.type}, not a {type_}")


# ---- panels -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass
class Panel:
    title: str
    layer: str
    metrics: tuple[MetricDef, ...]
    targets: tuple[Target, ...]
    unit: str
    description: str
    width: int = 12
    height: int = 8


def _qlabel(q: float) -> str:
    return "p" + format(q * 100, "g")


def _legend(base: str, by: Sequence[str]) -> str:
    groups = " ".join("{{" + b + "}}" for b in by)
    return f"{base} {groups}".strip() if base else groups


def describe(ms: Iterable[MetricDef], extra: str = "") -> str:
    """A panel description: each metric's help and name, the layer notes, then ``extra``."""
    ms = list(ms)
    lines = []
    for m in ms:
        lines.append(f"{m.help} (`{m.name}`, {m.type}, {m.unit})")
    notes = []
    for m in ms:
        note = LAYER_NOTES.get(m.layer)
        if note and note not in notes:
            notes.append(note)
    if any(m.layer in GATEWAY_PROCESS_LAYERS for m in ms):
        notes.append("Recorded by the gateway process: not filtered by $replica.")
    if extra:
        notes.append(extra)
    return "\n\n".join(lines + notes)


# Request-layer metrics are recorded by every process on the request's path: the gateway
# (replica="gateway": from gateway arrival to the token leaving the gateway, the client's
# view) and each engine replica (from gateway arrival to the token sampled). Their
# panels show the two views apart instead of summing them into one distribution.
GATEWAY_VIEW: tuple[Matcher, ...] = (("replica", "=", GATEWAY_REPLICA),)
ENGINE_VIEW: tuple[Matcher, ...] = (("replica", "!=", GATEWAY_REPLICA),)
PROCESS_VIEWS: tuple[tuple[str, tuple[Matcher, ...]], ...] = (("gateway", GATEWAY_VIEW), ("engines", ENGINE_VIEW))
PROCESS_VIEWS_NOTE = (f'Two views: "gateway" (replica="{GATEWAY_REPLICA}": gateway arrival to the token leaving the '
                      'gateway, what clients see) and "engines" (the engine replicas: gateway arrival to the token '
                      'sampled); the gap between them is the output path.')


def split_by_process(m: MetricDef, by: Sequence[str]) -> bool:
    return m.layer == REQUEST_LAYER and "replica" not in by


def histogram_panel(m: MetricDef, title: str, scope: Scope = GRAFANA, by: Sequence[str] = (),
                    quantiles: Sequence[float] = QUANTILES, mean: bool = True, extra: str = "") -> Panel:
    views = PROCESS_VIEWS if split_by_process(m, by) else (("", ()),)
    targets = []
    for view, match in views:
        for q in quantiles:
            targets.append(Target(q_quantile(m, q, scope, by, match), _legend(f"{_qlabel(q)} {view}".strip(), by)))
        if mean:
            targets.append(Target(q_mean(m, scope, by, match), _legend(f"mean {view}".strip(), by)))
    what = ", ".join([_qlabel(q) for q in quantiles] + (["mean"] if mean else []))
    notes = [f"Shows {what} over $__rate_interval."]
    if len(views) > 1:
        notes.append(PROCESS_VIEWS_NOTE)
    if extra:
        notes.append(extra)
    return Panel(title, m.layer, (m,), tuple(targets), value_unit(m), describe([m], " ".join(notes)))


def counter_panel(m: MetricDef, title: str, scope: Scope = GRAFANA, by: Sequence[str] = (),
                  legend: str = "", extra: str = "") -> Panel:
    legend = legend or (_legend("", by) if by else "per second")
    return Panel(title, m.layer, (m,), (Target(q_rate(m, scope, by), legend),), rate_unit(m),
                 describe([m], "Per-second rate over $__rate_interval." + (" " + extra if extra else "")))


def gauge_panel(ms: Sequence[MetricDef], title: str, scope: Scope = GRAFANA, by: Sequence[str] = ("replica",),
                legends: Sequence[str] = (), extra: str = "") -> Panel:
    targets = []
    for i, m in enumerate(ms):
        by_m = [b for b in by if not (b == "replica" and m.layer in GATEWAY_PROCESS_LAYERS)]
        base = legends[i] if i < len(legends) else ("" if by_m else m.name)
        if by_m == ["replica"]:
            base = (base + " replica").strip()
        targets.append(Target(q_gauge(m, scope, by_m), _legend(base, by_m)))
    units = {value_unit(m) for m in ms}
    if len(units) != 1:
        raise ValueError(f"panel {title!r} mixes units {sorted(units)}")
    return Panel(title, ms[0].layer, tuple(ms), tuple(targets), units.pop(), describe(ms, extra))


def default_panel(m: MetricDef) -> Panel:
    """The panel a metric gets when the layout does not mention it."""
    title = m.name.removeprefix("layerscope_").replace("_", " ")
    by = m.extra_labels[:1]
    if m.type == "histogram":
        return histogram_panel(m, title, by=by)
    if m.type == "counter":
        return counter_panel(m, title + " /s", by=by)
    return gauge_panel([m], title, by=("replica", *by))


# ---- the layout -------------------------------------------------------------------------------
# SLO thresholds used by the goodput panel and the alert rules (rules.py). Each must be a
# bucket bound of its histogram so "requests within the SLO" is one _bucket series.
@dataclass(frozen=True)
class LatencySLO:
    metric: str
    short: str  # TTFT, TPOT, E2E
    quantile: float  # the alert's quantile
    threshold_s: float


LATENCY_SLOS: tuple[LatencySLO, ...] = (
    LatencySLO("layerscope_time_to_first_token_seconds", "TTFT", 0.99, 2.5),
    LatencySLO("layerscope_time_per_output_token_seconds", "TPOT", 0.99, 0.1),
    LatencySLO("layerscope_e2e_request_latency_seconds", "E2E", 0.99, 20.0),
)


class Registry:
    """Looks metrics up by name; remembers which ones the layout used."""

    def __init__(self, metrics: Sequence[MetricDef]):
        self.by_name = {m.name: m for m in metrics}
        self.metrics = tuple(metrics)
        self.used: set[str] = set()

    def __getitem__(self, name: str) -> MetricDef:
        try:
            m = self.by_name[name]
        except KeyError:
            raise KeyError(f"the dashboard layout names {name!r}, which is not in the metric registry "
                           "(layerscope.probes.metrics.METRICS)") from None
        self.used.add(name)
        return m


def overview_panels(r: Registry) -> list[Panel]:
    ttft, tpot = r["layerscope_time_to_first_token_seconds"], r["layerscope_time_per_output_token_seconds"]
    itl, e2e = r["layerscope_inter_token_latency_seconds"], r["layerscope_e2e_request_latency_seconds"]
    gen, ok = r["layerscope_generation_tokens_total"], r["layerscope_request_success_total"]
    err, http = r["layerscope_request_errors_total"], r["layerscope_gateway_requests_total"]
    panels = [
        histogram_panel(ttft, "Time to first token (TTFT)"),
        histogram_panel(tpot, "Time per output token (TPOT)"),
        histogram_panel(itl, "Inter-token latency (ITL)"),
        histogram_panel(e2e, "End-to-end request latency (E2E)"),
    ]
    panels.append(Panel(
        "Request rate", http.layer, (http, ok),
        (Target(q_rate(http, GRAFANA), "answered by the gateway (HTTP)"),
         Target(q_rate(ok, GRAFANA), "finished by the engines")),
        "reqps",
        describe([http, ok], "HTTP responses/s at the gateway (every status) and requests/s the engines "
                             "finished, over $__rate_interval.")))
    panels.append(counter_panel(gen, "Throughput (output tokens/s)", legend="output tokens/s"))
    # Goodput: the registry has no "requests meeting every SLO" counter; bound it per SLO
    # from the histograms' buckets (the gateway's view: what clients see), next to the
    # rate of successfully finished requests.
    good = [Target(q_rate(ok, GRAFANA, match=(("finished_reason", "=~", "stop|length"),)), "finished (stop|length)")]
    slo_ms = []
    for slo in LATENCY_SLOS:
        m = r[slo.metric]
        if slo.threshold_s not in (m.buckets or ()):
            raise ValueError(f"SLO {slo.short} <= {slo.threshold_s}s is not a bucket bound of {m.name}")
        slo_ms.append(m)
        match = (*GATEWAY_VIEW, ("le", "=", le_value(slo.threshold_s)))
        good.append(Target(q_rate(m, GRAFANA, suffix="_bucket", match=match),
                           f"{slo.short} <= {format(slo.threshold_s, 'g')} s"))
    panels.append(Panel(
        "Goodput (derived, requests/s within each SLO)", ok.layer, (ok, *slo_ms), tuple(good), "reqps",
        describe([ok], "Goodput is requests/s meeting every SLO at once; the registry has no counter for "
                       "it, so this panel derives bounds: successfully finished requests/s, and for each "
                       "latency SLO the requests/s within it as the gateway saw them (the histogram bucket "
                       f'at the threshold, replica="{GATEWAY_REPLICA}"). Goodput is at most the lowest line. '
                       "SLOs: " + ", ".join(f"{s.short} <= {format(s.threshold_s, 'g')} s" for s in LATENCY_SLOS)
                 + ".")))
    panels.append(Panel(
        "Error ratio", err.layer, (err, ok), (Target(q_error_ratio(err, ok, GRAFANA), "errors / requests"),),
        "percentunit",
        describe([err, ok], "errors / (errors + finished) over $__rate_interval; 0 while no error was counted.")))
    panels.append(counter_panel(err, "Errors by reason", by=("reason",),
                                extra="A reason has a series only once it has been counted."))
    return panels


def layer_panels(r: Registry) -> list[Panel]:
    m = r.__getitem__
    waiting, running = m("layerscope_num_requests_waiting"), m("layerscope_num_requests_running")
    hits, queries = m("layerscope_prefix_cache_hits_total"), m("layerscope_prefix_cache_queries_total")
    phase = m("layerscope_step_phase_seconds")
    layer_fwd = m("layerscope_layer_forward_seconds")
    coll = m("layerscope_collective_seconds")
    panels = [
        # gateway.queue
        gauge_panel([m("layerscope_gateway_queue_length"), m("layerscope_gateway_inflight_requests")],
                    "Gateway admission: queued and in flight", legends=("queued", "in flight")),
        histogram_panel(m("layerscope_gateway_queue_time_seconds"), "Gateway queue time"),
        counter_panel(m("layerscope_gateway_requests_total"), "Gateway responses by HTTP code", by=("code",)),
        # gateway.route
        counter_panel(m("layerscope_router_requests_total"), "Routed requests per replica", by=("replica",),
                      legend="replica {{replica}}"),
        # engine.queue
        gauge_panel([waiting], "Engine waiting queue", legends=("waiting",)),
        histogram_panel(m("layerscope_request_queue_time_seconds"), "Engine queue time"),
        # engine.schedule
        gauge_panel([running], "Running requests", legends=("running",)),
        histogram_panel(phase, "Step phase time (mean)", by=("phase",), quantiles=()),
        histogram_panel(phase, "Step phase time (p99)", by=("phase",), quantiles=(0.99,), mean=False),
        histogram_panel(m("layerscope_batch_tokens"), "Tokens per step (batch tokens)"),
        # engine.kv
        gauge_panel([m("layerscope_kv_cache_usage_perc")], "KV-cache usage", legends=("KV used",)),
        counter_panel(m("layerscope_num_preemptions_total"), "Preemptions/s", by=("replica",),
                      legend="replica {{replica}}",
                      extra="Moves only when the KV pool runs out of blocks; 0 otherwise."),
        Panel("Prefix-cache hit rate", hits.layer, (hits, queries),
              (Target(q_ratio(hits, queries, GRAFANA), "hit rate (tokens)"),), "percentunit",
              describe([hits, queries], "hits/s / queries/s over $__rate_interval.")),
        # model.forward
        histogram_panel(m("layerscope_request_prefill_time_seconds"), "Prefill time per request"),
        histogram_panel(m("layerscope_request_decode_time_seconds"), "Decode time per request"),
        histogram_panel(layer_fwd, "Per-layer forward time (mean)", by=("layer",), quantiles=(),
                        extra="Recorded on sampled steps (layer_timing_interval)."),
        # parallel.collective
        histogram_panel(coll, "Collective time by op", by=("op",), quantiles=(0.5, 0.99)),
        histogram_panel(m("layerscope_collective_wait_seconds"), "Collective wait for the slowest rank (skew)"),
        # kernel.launch_gap
        gauge_panel([m("layerscope_launch_gap_ratio")], "Launch-gap ratio", legends=("idle share",)),
        # engine.output
        counter_panel(m("layerscope_generation_tokens_total"), "Output tokens/s per replica", by=("replica",),
                      legend="replica {{replica}}"),
        counter_panel(m("layerscope_request_success_total"), "Finished requests by reason",
                      by=("finished_reason",)),
        counter_panel(m("layerscope_request_errors_total"), "Request errors by reason", by=("reason",),
                      extra="A reason has a series only once it has been counted."),
        # workload
        counter_panel(m("layerscope_prompt_tokens_total"), "Prompt tokens/s", legend="prompt tokens/s"),
    ]
    return panels


# ---- dashboard JSON ---------------------------------------------------------------------------
def layer_order(layer: str) -> int:
    return -1 if layer == REQUEST_LAYER else (LAYERS.index(layer) if layer in LAYERS else len(LAYERS))


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict:
    return {
        "datasource": DATASOURCE,
        "description": p.description,
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "palette-classic"},
                "custom": {"drawStyle": "line", "fillOpacity": 10, "lineWidth": 1, "showPoints": "never",
                           "spanNulls": False},
                "min": 0,
                "unit": p.unit,
            },
            "overrides": [],
        },
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "id": pid,
        "options": {
            "legend": {"calcs": ["mean", "max"], "displayMode": "table", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"datasource": DATASOURCE, "editorMode": "code", "expr": t.expr, "legendFormat": t.legend,
             "range": True, "refId": chr(ord("A") + i)}
            for i, t in enumerate(p.targets)
        ],
        "title": p.title,
        "type": "timeseries",
    }


def _row_json(layer: str, pid: int, y: int) -> dict:
    return {
        "collapsed": False,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        "id": pid,
        "panels": [],
        "title": f"{layer} — {LAYER_TITLES.get(layer, layer)}",
        "type": "row",
    }


def layout(panels: Sequence[Panel]) -> list[dict]:
    """Row panels per layer (in taxonomy order), panels left to right, top to bottom."""
    out: list[dict] = []
    pid, y = 1, 0
    layers = sorted({p.layer for p in panels}, key=layer_order)
    for layer in layers:
        out.append(_row_json(layer, pid, y))
        pid, y = pid + 1, y + 1
        x, row_h = 0, 0
        for p in (p for p in panels if p.layer == layer):
            if x + p.width > 24:
                x, y, row_h = 0, y + row_h, 0
            out.append(_panel_json(p, pid, x, y))
            pid += 1
            x += p.width
            row_h = max(row_h, p.height)
        y += row_h
    return out


def variable_metric(metrics: Sequence[MetricDef]) -> str:
    """The series template variables read labels from: the first request-layer metric with only
    the base labels (``_count`` of a histogram). Every process on the request path (gateway
    and engine replicas) exports it from start-up, so each model/replica shows up at once."""
    for m in metrics:
        if m.layer == REQUEST_LAYER and m.labels == BASE_LABELS:
            return m.name + ("_count" if m.type == "histogram" else "")
    raise ValueError("the registry has no request-layer metric with only the base labels")


def templating(metrics: Sequence[MetricDef]) -> dict:
    src = variable_metric(metrics)
    queries = {
        "model_name": f"label_values({src}, model_name)",
        "replica": f'label_values({src}{{model_name=~"$model_name"}}, replica)',
    }
    labels = {"model_name": "model", "replica": "replica"}
    return {"list": [
        {
            "allValue": ".*",
            "current": {},
            "datasource": DATASOURCE,
            "definition": q,
            "hide": 0,
            "includeAll": True,
            "label": labels[name],
            "multi": True,
            "name": name,
            "options": [],
            "query": {"query": q, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2,
            "regex": "",
            "skipUrlSync": False,
            "sort": 1,
            "type": "query",
        }
        for name, q in queries.items()
    ]}


def dashboard_json(uid: str, title: str, description: str, panels: Sequence[Panel],
                   metrics: Sequence[MetricDef]) -> dict:
    return {
        "__inputs": [{"description": "Prometheus scraping layerscope serve's /metrics", "label": "Prometheus",
                      "name": DS_INPUT, "pluginId": "prometheus", "pluginName": "Prometheus",
                      "type": "datasource"}],
        "__requires": [
            {"id": "grafana", "name": "Grafana", "type": "grafana", "version": GRAFANA_VERSION},
            {"id": "prometheus", "name": "Prometheus", "type": "datasource", "version": "1.0.0"},
            {"id": "timeseries", "name": "Time series", "type": "panel", "version": ""},
        ],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
            "type": "dashboard"}]},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{"asDropdown": False, "icon": "external link", "includeVars": True, "keepTime": True,
                   "tags": list(TAGS), "targetBlank": False, "title": "layerscope", "type": "dashboards"}],
        "panels": layout(panels),
        "refresh": "10s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": list(TAGS),
        "templating": templating(metrics),
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


OVERVIEW = "layerscope-overview"
LAYERS_DASHBOARD = "layerscope-layers"


def build_dashboards(metrics: Sequence[MetricDef] = METRICS) -> dict[str, dict]:
    """{file name: dashboard JSON} for the registry ``metrics``."""
    r = Registry(metrics)
    overview = overview_panels(r)
    layers = layer_panels(r)
    layers += [default_panel(m) for m in metrics if m.name not in r.used]
    return {
        f"{OVERVIEW}.json": dashboard_json(
            OVERVIEW, "layerscope — overview",
            "Request latency (TTFT, TPOT, ITL, E2E), throughput, goodput, errors and request rate of a "
            "layerscope server. Generated from the metric registry by `layerscope dashboards build`.",
            overview, metrics),
        f"{LAYERS_DASHBOARD}.json": dashboard_json(
            LAYERS_DASHBOARD, "layerscope — layers",
            "One row per layer of the serving stack (gateway, router, engine queue/scheduler/KV, model, "
            "collectives, kernels, output). Generated from the metric registry by `layerscope dashboards build`.",
            layers, metrics),
    }


def render_json(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def iter_queries(dashboard: dict) -> Iterable[tuple[dict, dict]]:
    """(panel, target) for every query of a dashboard, rows' nested panels included."""
    for p in dashboard["panels"]:
        for sub in [p, *p.get("panels", [])]:
            for t in sub.get("targets", []):
                yield sub, t


def default_dir() -> Path:
    """The package's dashboards folder (where the generated files are committed)."""
    return Path(__file__).resolve().parent


def render_all(metrics: Sequence[MetricDef] = METRICS) -> dict[str, str]:
    """{file name: text} of every generated file: the dashboards and the Prometheus rules."""
    from layerscope.dashboards.rules import RULES_FILE, build_rules, render_rules

    files = {name: render_json(d) for name, d in build_dashboards(metrics).items()}
    files[RULES_FILE] = render_rules(build_rules(metrics))
    return dict(sorted(files.items()))


def write_all(out: Path | str | None = None, metrics: Sequence[MetricDef] = METRICS) -> list[Path]:
    out = Path(out) if out is not None else default_dir()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all(metrics).items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


# ---- the vLLM dialect (``layerscope dashboards build --dialect vllm``) --------------------------------
_NAME_RE = re.compile(r"\blayerscope_[a-z0-9_]+")


def _vllm_rename(text: str) -> str:
    """Our metric names in ``text`` replaced by their vLLM v1 names (others kept)."""
    from layerscope.probes.metrics import METRICS_BY_NAME, VLLM_NAMES

    names = {}
    for ours, theirs in VLLM_NAMES.items():
        names[ours] = theirs
        if METRICS_BY_NAME[ours].type == "histogram":
            names.update({ours + suf: theirs + suf for suf in ("_bucket", "_sum", "_count")})
    return _NAME_RE.sub(lambda m: names.get(m.group(0), m.group(0)), text)


def _vllm_expr(expr: str) -> str | None:
    """One PromQL expression rewritten for a vLLM fleet (vLLM v1 names, ``engine`` for
    ``replica``, no gateway series), or None when it needs a metric vLLM does not have."""
    out = _vllm_rename(expr)
    if "layerscope_" in out:
        return None
    out = re.sub(r'\{replica="gateway"\}', "", out)
    out = re.sub(r',?\s*replica="gateway"', "", out)
    return re.sub(r"\breplica\b", "engine", out)


def vllm_dialect_files(files: dict[str, str]) -> dict[str, str]:
    """The dashboards and rules of ``render_all`` for vLLM servers (and ``layerscope serve
    --metrics-dialect vllm``): panels and rules whose metrics vLLM lacks are left out."""
    import yaml

    out: dict[str, str] = {}
    for fname, text in files.items():
        new_name = fname.replace("layerscope", "vllm")
        if fname.endswith(".json"):
            d = json.loads(text)
            panels = []
            for p in d["panels"]:
                subs = p.get("panels")
                if subs is not None:
                    p["panels"] = [s for s in subs if _vllm_panel(s)]
                if p.get("type") == "row" or _vllm_panel(p):
                    panels.append(p)
            d["panels"] = [p for p in panels if p.get("type") != "row" or p.get("panels") != []]
            d["uid"] = d["uid"].replace("layerscope", "vllm")
            d["title"] = d["title"].replace("layerscope", "vLLM (layerscope)")
            d["description"] = d["description"].replace("a layerscope server", "a vLLM server (or layerscope serve "
                                                        "--metrics-dialect vllm)")
            d["templating"]["list"] = [_vllm_var(v) for v in d["templating"]["list"]]
            out[new_name] = render_json(d)
        else:
            rules = yaml.safe_load(text)
            for g in rules["groups"]:
                g["name"] = g["name"].replace("layerscope", "vllm")
                kept = []
                for r in g["rules"]:
                    e = _vllm_expr(r["expr"].replace(":layerscope_", ":vllm_"))
                    if e is None:
                        continue
                    r["expr"] = e
                    if "record" in r:
                        r["record"] = r["record"].replace(":layerscope_", ":vllm_").replace("replica", "engine")
                    kept.append(r)
                g["rules"] = kept
            header = text[: text.index("groups:")].replace("layerscope's SLOs", "a vLLM fleet's SLOs").replace("layerscope-rules.yml", "vllm-rules.yml")
            out[new_name] = header + yaml.safe_dump(rules, sort_keys=False, default_flow_style=False, width=100000)
    return out


def _vllm_panel(p: dict) -> bool:
    targets = p.get("targets", [])
    new = [_vllm_expr(t["expr"]) for t in targets]
    if not targets or any(e is None for e in new):
        return False
    for t, e in zip(targets, new):
        t["expr"] = e
        t["legendFormat"] = t.get("legendFormat", "").replace("replica", "engine")
    if isinstance(p.get("description"), str):
        p["description"] = _vllm_rename(p["description"]).replace("replica", "engine")
    return True


def _vllm_var(v: dict) -> dict:
    v = json.loads(json.dumps(v).replace('"replica"', '"engine"').replace("$replica", "$engine"))
    for key in ("definition",):
        if isinstance(v.get(key), str):
            v[key] = _vllm_expr(v[key]) or v[key]
    if isinstance(v.get("query"), dict):
        v["query"]["query"] = _vllm_expr(v["query"]["query"]) or v["query"]["query"]
    return v
