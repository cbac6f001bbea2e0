"""Prometheus recording and alerting rules for the SLOs, generated from the metric registry.

Same builders as the dashboards (``builder.q_*``), with no template variables, a fixed
window and grouping by ``model_name`` (``replica`` too where a replica can be the
problem alone): TTFT p99, TPOT p99, error ratio, KV-cache exhaustion (usage and
preemptions), and queue growth (engine waiting queue, gateway admission queue).
Latency SLOs are taken at the client's edge: the gateway's view of the request-layer
histograms (``replica="gateway"``), not mixed with the engine replicas' own.
Written to ``dashboards/layerscope-rules.yml`` by ``layerscope dashboards build``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from layerscope.dashboards.builder import (GATEWAY_VIEW, LATENCY_SLOS, Scope, q_error_ratio, q_gauge, q_quantile,
                                          q_rate)
from layerscope.probes.metrics import METRICS, MetricDef

RULES_FILE = "layerscope-rules.yml"
WINDOW = "5m"  # rate window of the recording rules
QUEUE_WINDOW = "10m"  # deriv window for queue growth
ERROR_RATIO_MAX = 0.01  # error-ratio SLO: at most 1% of requests fail
KV_USAGE_MAX = 0.95  # KV-cache usage above this for KV_FOR is "nearly exhausted"
KV_FOR = "10m"
QUEUE_MIN = 5  # a growing queue alerts once it holds more than this many requests
ALERT_FOR = "5m"

SCOPE = Scope(window=WINDOW)
BY_MODEL = ("model_name",)
BY_REPLICA = ("model_name", "replica")


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str


@dataclass(frozen=True)
class Alert:
    alert: str
    expr: str
    for_: str
    severity: str
    layer: str
    summary: str
    description: str
    by: Sequence[str] = BY_MODEL


# The alert's window, for the commands in its annotations: Prometheus templates have no "now", so a
# query of time() at evaluation (the firing time in the first notification) stands for it.
AT = '{{ with query "time()" }}{{ . | first | value | printf "%.0f" }}{{ end }}'
AROUND = "1h"


def _selector(by: Sequence[str]) -> str:
    """Label matchers of the alert's series for ``--selector`` (the engine replicas, not the gateway's view)."""
    own = [f'{k}="{{{{ $labels.{k} }}}}"' for k in by]
    return "{" + ",".join(own + (['replica!="gateway"'] if "replica" not in by else [])) + "}"


def commands(a: Alert) -> dict[str, str]:
    """Annotations with the layerscope commands for the alert's window (docs/fleet.md)."""
    conn = f"--prometheus {{{{ $externalURL }}}} --selector '{_selector(a.by)}' --by replica"
    out = {"diagnose": f"layerscope diagnose {conn} --around {AROUND} --at {AT}"}
    if tuple(a.by) == BY_MODEL:
        out["fleet"] = f"layerscope fleet {conn} --last {AROUND}"
    return out


def _record_name(level: Sequence[str], metric: str, ops: str) -> str:
    """``level:metric:operations`` (Prometheus' recording-rule naming)."""
    return f"{'_'.join(level)}:{metric}:{ops}"


def _fmt(x: float) -> str:
    return format(x, "g")


def build_rules(metrics: Sequence[MetricDef] = METRICS) -> dict:
    by_name = {m.name: m for m in metrics}

    def m(name: str) -> MetricDef:
        try:
            return by_name[name]
        except KeyError:
            raise KeyError(f"the SLO rules name {name!r}, which is not in the metric registry") from None

    records: list[Recording] = []
    alerts: list[Alert] = []

    for slo in LATENCY_SLOS:
        h = m(slo.metric)
        q = slo.quantile
        rec = _record_name(BY_MODEL, h.name, f"p{_fmt(q * 100)}_rate{WINDOW}")
        records.append(Recording(rec, q_quantile(h, q, SCOPE, BY_MODEL, GATEWAY_VIEW)))
        if slo.short == "E2E":
            continue  # recorded for dashboards/goodput; alerts cover TTFT and TPOT
        alerts.append(Alert(
            f"Layerscope{slo.short}P{_fmt(q * 100)}High", f"{rec} > {_fmt(slo.threshold_s)}", ALERT_FOR, "warning",
            h.layer,
            f"{slo.short} p{_fmt(q * 100)} above its SLO of {_fmt(slo.threshold_s)} s",
            f"{slo.short} p{_fmt(q * 100)} of {{{{ $labels.model_name }}}} is {{{{ $value | humanizeDuration }}}} "
            f"over {WINDOW} (SLO {_fmt(slo.threshold_s)} s). {h.help}"))

    err, ok = m("layerscope_request_errors_total"), m("layerscope_request_success_total")
    rec = _record_name(BY_MODEL, "layerscope_request_errors", f"ratio_rate{WINDOW}")
    records.append(Recording(rec, q_error_ratio(err, ok, SCOPE, BY_MODEL)))
    alerts.append(Alert(
        "LayerscopeErrorRatioHigh", f"{rec} > {_fmt(ERROR_RATIO_MAX)}", ALERT_FOR, "critical", err.layer,
        f"more than {_fmt(ERROR_RATIO_MAX * 100)}% of requests fail",
        f"{{{{ $value | humanizePercentage }}}} of {{{{ $labels.model_name }}}}'s requests failed or were refused "
        f"over {WINDOW} (SLO {_fmt(ERROR_RATIO_MAX * 100)}%). {err.help}"))

    kv = m("layerscope_kv_cache_usage_perc")
    alerts.append(Alert(
        "LayerscopeKVCacheNearlyFull", f"{q_gauge(kv, SCOPE, BY_REPLICA)} > {_fmt(KV_USAGE_MAX)}", KV_FOR, "warning",
        kv.layer, f"KV-cache usage above {_fmt(KV_USAGE_MAX * 100)}%",
        f"KV-cache usage of {{{{ $labels.model_name }}}} replica {{{{ $labels.replica }}}} is "
        f"{{{{ $value | humanizePercentage }}}}; new requests wait for blocks and running ones get preempted. "
        f"{kv.help}", BY_REPLICA))
    pre = m("layerscope_num_preemptions_total")
    rec = _record_name(BY_REPLICA, pre.name.removesuffix("_total"), f"rate{WINDOW}")
    records.append(Recording(rec, q_rate(pre, SCOPE, BY_REPLICA)))
    alerts.append(Alert(
        "LayerscopeKVCacheExhausted", f"{rec} > 0", ALERT_FOR, "warning", pre.layer,
        "requests are being preempted: the KV pool is exhausted",
        f"Replica {{{{ $labels.replica }}}} of {{{{ $labels.model_name }}}} preempts {{{{ $value | humanize }}}} "
        f"requests/s over {WINDOW}: the KV-cache pool runs out of blocks. {pre.help}", BY_REPLICA))

    for name, short in (("layerscope_num_requests_waiting", "Engine"), ("layerscope_gateway_queue_length", "Gateway")):
        g = m(name)
        level = BY_MODEL
        size = _record_name(level, g.name, "sum")
        growth = _record_name(level, g.name, f"deriv{QUEUE_WINDOW}")
        records.append(Recording(size, q_gauge(g, SCOPE, level)))
        records.append(Recording(growth, f"sum by ({', '.join(level)}) (deriv({g.name}[{QUEUE_WINDOW}]))"))
        alerts.append(Alert(
            f"Layerscope{short}QueueGrowing", f"{growth} > 0 and {size} > {QUEUE_MIN}", QUEUE_WINDOW, "warning",
            g.layer, f"{short.lower()} queue keeps growing",
            f"The {short.lower()} queue of {{{{ $labels.model_name }}}} has grown for {QUEUE_WINDOW} and holds more "
            f"than {QUEUE_MIN} requests: arrivals outpace service. {g.help}"))

    return {"groups": [
        {"name": "layerscope-recording", "rules": [{"record": r.record, "expr": r.expr} for r in records]},
        {"name": "layerscope-slo-alerts", "rules": [
            {"alert": a.alert, "expr": a.expr, "for": a.for_,
             "labels": {"severity": a.severity, "layer": a.layer},
             "annotations": {"summary": a.summary, "description": a.description, **commands(a)}}
            for a in alerts]},
    ]}


HEADER = ("# Prometheus recording and alerting rules for layerscope's SLOs.\n"
          "# Generated from the metric registry (layerscope.probes.metrics) by `layerscope dashboards build`;\n"
          "# do not edit by hand. Check with: promtool check rules layerscope-rules.yml\n")


def render_rules(rules: dict) -> str:
    import yaml  # PyYAML (a transformers dependency)

    return HEADER + yaml.safe_dump(rules, sort_keys=False, default_flow_style=False, width=100000,
                                   allow_unicode=True)
