"""Headline: the run's headline figures from report.summarize (percentiles with counts,
throughput, goodput under the SLOs)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from layerscope.diagnose.tui.format import fmt_metric, fmt_s

METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"))
CLIENT = (("client_ttft_s", "client TTFT"), ("client_e2e_s", "client E2E"))


class Headline(Static):
    DEFAULT_CSS = """
    Headline { height: auto; }
    """

    def show(self, summary: dict[str, Any]) -> None:
        self.update(headline_text(summary))


def headline_text(s: dict[str, Any]) -> Text:
    slo = ", ".join(f"{k[:-2].upper()}<{fmt_s(v)}" for k, v in (s.get("slo") or {}).items()) or "none"
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"{s['requests']:,} requests", style="bold")
    t.append(f" ({s['requests_finished']:,} finished) in {s['duration_s']:.3f} s   ")
    t.append("output ")
    t.append(f"{fmt_metric('x', s['output_tokens_per_s'])} tok/s", style="bold")
    t.append("   goodput ")
    t.append(f"{fmt_metric('x', s['goodput_requests_per_s'])} req/s", style="bold")
    t.append(f" (SLO {slo})")
    rows = [(label, s["latency"][key]) for key, label in METRICS]
    rows += [(label, s["client_latency"][key]) for key, label in CLIENT if key in (s.get("client_latency") or {})]
    for label, p in rows:
        t.append(f"\n{label:<12}")
        for q in ("p50", "p90", "p99"):
            t.append(f"{q} ")
            t.append(f"{fmt_s(p[q]):>9}", style="bold")
            t.append("   ")
        t.append(f"(n={p['count']:,})", style="dim")
    return t
