"""Regression reports: Markdown, a static HTML page with plots, and a terminal table.

``write_reports(result)`` writes into the session directory:

- ``report.md`` and ``report.html`` (the same blocks; the HTML is one static page, no
  scripts, images beside it);
- ``plots/metrics_WORKLOAD_CONFIG.png``: per metric, one bar per version (pooled over
  repetitions) with its 95% block-bootstrap CI and each repetition as a dot;
- ``plots/cdf_WORKLOAD_CONFIG.png``: TTFT / TPOT / E2E CDFs per version (pooled);
- ``result.json``: the whole result (``RegressResult.to_json``).

Plots are drawn with matplotlib's Agg backend, separately from the analysis: the
result carries no figures. ``terminal_table(result)`` is the concise rich table the
CLI prints. Latencies are shown in ms, rates per second.

(Just over 400 lines: the Markdown and HTML are built from the same blocks in one place so
that they cannot drift apart.)
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from layerscope.diagnose.config_diff import source_text
from layerscope.regressions.regress import EXIT_OK, EXIT_REGRESSION
from layerscope.regressions.suite import HIGHER_IS_BETTER, METRICS

# "unchanged" is no evidence of sameness, only of no change the repetitions could see: the text says so
# and, where known, how large a rise they would have seen (status_text)
STATUS_TEXT = {"regressed": "REGRESSED", "worse": "worse", "improved": "improved", "unchanged": "not shown"}
_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974")


# ---- formatting ------------------------------------------------------------------------------
def status_text(g: dict) -> str:
    """The gate's status of one metric; an unchanged one with the rise it could have seen."""
    text = STATUS_TEXT[g["status"]]
    mde = g.get("mde_pct")
    if g["status"] == "unchanged" and mde is not None and not (isinstance(mde, float) and math.isnan(mde)):
        text += f" (MDE {mde:.0f}%)"
    return text


def fmt_value(metric: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if metric in HIGHER_IS_BETTER:
        return f"{v:.1f}/s"
    return f"{v * 1000:.1f} ms"


def fmt_pct(v: Any, signed: bool = True) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:+.1f}%" if signed else f"{v:.0f}%"


def fmt_ci(ci: Any) -> str:
    return "-" if not ci else f"[{ci[0]:+.0f}%, {ci[1]:+.0f}%]"


def _version_title(v) -> str:
    short = v.short
    return f"{v.label} ({short})" if short and not v.label.startswith(short[:10]) else v.label


# ---- blocks: one structure, two renderers -------------------------------------------------------
def blocks(result) -> list[tuple[str, Any]]:
    """The report as blocks: ("h1"|"h2"|"h3"|"p"|"list"|"table"|"image", payload)."""
    s = result.suite
    verdict = {EXIT_OK: "no regression", EXIT_REGRESSION: "REGRESSION"}.get(result.exit_status, "ERROR")
    out: list[tuple[str, Any]] = [("h1", f"layerscope regress: {s.name} — {verdict} (exit {result.exit_status})")]
    cands = ", ".join(_version_title(v) for v in result.versions[1:])
    slo = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in result.slo.items()) or "none"
    if result.client_view:
        out.append(("p", "An endpoint is among the versions: every version is measured as its load generator saw "
                         "it (client-side TTFT/TPOT/E2E); suite configs do not apply to endpoints."))
    out.append(("p", f"Session {result.session}; baseline {_version_title(result.baseline)}; candidates {cands}; "
                     f"{s.repetitions} repetitions, interleaved; model {s.model.label}; SLOs for goodput: {slo}; "
                     f"{len(result.runs)} runs in {result.wall_s:.0f} s. A metric regresses when it is "
                     "significantly worse (diagnose's rule, repetitions pooled) by more than its threshold."))
    out.append(("h2", "Verdict"))
    items = []
    for r in result.regressions:
        line = (f"**{r['version']}** regressed {r['label']} ({r['metric']}) on {r['workload']}/{r['config']}: "
                f"{fmt_value(r['metric'], r['baseline_value'])} -> {fmt_value(r['metric'], r['candidate_value'])} "
                f"({fmt_pct(r['delta_pct'])}, CI {fmt_ci(r['ci_pct'])}, threshold {fmt_pct(r['threshold_pct'], False)})"
                f"; layer **{r['layer'] or 'unknown'}**")
        if r["cause"]:
            line += f": {r['cause']}"
        if r["config_changes"]:
            line += f"; config: {'; '.join(r['config_changes'])}"
        items.append(line)
    items += [f"run failed: {f.splitlines()[0]}" for f in result.failures]
    if not items:
        items.append("no metric regressed beyond its threshold; every run succeeded")
    out.append(("list", items))
    for cell in result.cells:
        out += _cell_blocks(result, cell)
    for v in result.versions[1:]:
        out += _config_blocks(result, v)
    out.append(("h2", "Runs"))
    rows = []
    for r in result.runs:
        ok = r.status == "ok"
        status = f"ok ({r.figures.get('requests_ok')}/{r.figures.get('requests')} requests)" if ok else r.status
        where = str(Path(r.bundle).relative_to(result.session_dir)) if ok else (r.error or "").splitlines()[0]
        rows.append([r.version.label, r.workload, r.config, str(r.repetition), status,
                     f"{r.wall_s:.1f}" if r.wall_s else "-", fmt_value("ttft_p50_s", r.figures.get("ttft_p50_s")),
                     fmt_value("output_tokens_per_s", r.figures.get("output_tokens_per_s")), where])
    out.append(("table", (["version", "workload", "config", "rep", "status", "wall s", "TTFT p50", "tokens/s",
                           "bundle"], rows)))
    out.append(("p", f"Result store: {result.store_path} (every run of every session)."))
    return out


def _cell_blocks(result, cell: dict) -> list[tuple[str, Any]]:
    base = result.baseline.label
    out: list[tuple[str, Any]] = [("h2", f"{cell['workload']} / {cell['config']}")]
    cands = [v.label for v in result.versions[1:]]
    headers = ["metric", f"{base} (baseline)"]
    for c in cands:
        headers += [c, "change", "95% CI", "status"]
    headers.append("threshold")
    rows = []
    for m, label in METRICS.items():
        row = [label, fmt_value(m, cell["versions"][base]["metrics"][m]["value"])]
        for c in cands:
            g = cell["comparisons"].get(c, {}).get(m)
            val = cell["versions"][c]["metrics"][m]["value"]
            row += [fmt_value(m, val), fmt_pct(g["delta_pct"]) if g else "-", fmt_ci(g["ci_pct"]) if g else "-",
                    status_text(g) if g else "n/a"]
        thr = result.suite.thresholds.get(m)
        row.append("not gated" if thr is None else f"{'-' if m in HIGHER_IS_BETTER else '+'}{thr:.0f}%")
        rows.append(row)
    out.append(("table", (headers, rows)))
    slug = _slug(cell)
    out.append(("image", (f"plots/metrics_{slug}.png", f"metrics per version, {cell['workload']}/{cell['config']}")))
    out.append(("image", (f"plots/cdf_{slug}.png", f"latency CDFs, {cell['workload']}/{cell['config']}")))
    out += _history_blocks(result, cell)
    for c, d in cell["diagnoses"].items():
        out.append(("h3", f"Diagnosis {base} -> {c} (representative repetitions)"))
        if "note" in d:
            out.append(("p", d["note"]))
            continue
        out.append(("p", f"layerscope diagnose {d['baseline_bundle']} {d['candidate_bundle']}: verdict "
                         f"{d['verdict']}" + (f", primary {d['primary']['metric']} in {d['primary']['layer']}"
                                              if d.get("primary") else "")))
        items = []
        for f in d.get("findings", [])[:6]:
            share = f"{f['share']:.0%}" if isinstance(f.get("share"), float) and not math.isnan(f["share"]) else "-"
            line = f"{f['metric']}: **{f['layer']}** ({share} of the change): {f['cause']}"
            if f.get("config_changes"):
                line += f" — config: {'; '.join(f['config_changes'])}"
            if f.get("evidence"):
                line += f" — evidence: {'; '.join(f['evidence'][:3])}"
            items.append(line)
        out.append(("list", items or ["no finding on the representative pair (pooled figures above decide)"]))
    return out


def _trend(result, cell: dict):
    from layerscope.regressions.store import ResultStore

    with ResultStore(result.store_path) as db:
        return db.trend(result.suite.name, cell["workload"], cell["config"])


def _history_blocks(result, cell: dict) -> list[tuple[str, Any]]:
    """The last sessions of this suite in the result store (medians over repetitions)."""
    t = _trend(result, cell)
    if t["session"].nunique() < 2:
        return []
    rows = [[r.session, r.version, (r.git_rev or "")[:10], str(r.num_runs), fmt_value("ttft_p50_s", r.ttft_p50_s),
             fmt_value("ttft_p99_s", r.ttft_p99_s), fmt_value("tpot_p50_s", r.tpot_p50_s),
             fmt_value("output_tokens_per_s", r.output_tokens_per_s)] for r in t.itertuples()]
    return [("h3", f"History: the last {t['session'].nunique()} sessions of {result.suite.name} "
                   f"(medians over repetitions)"),
            ("table", (["session", "version", "git rev", "runs", "TTFT p50", "TTFT p99", "TPOT p50", "tokens/s"],
                       rows)),
            ("image", (f"plots/history_{_slug(cell)}.png", f"history, {cell['workload']}/{cell['config']}"))]


def _config_blocks(result, v) -> list[tuple[str, Any]]:
    base = result.baseline.label
    out: list[tuple[str, Any]] = [("h2", f"Config diff {base} -> {v.label}")]
    diff = result.config_diffs.get(v.label) or []
    if not diff:
        out.append(("p", "no difference in config (defaults included), resolved values, versions or hardware"))
        return out
    rows = []
    for r in diff:
        src = source_text(r.get("baseline_source"), r.get("candidate_source"))
        rows.append([r["kind"], r["key"], str(r["baseline"]), str(r["candidate"]), r.get("layer") or "any", src])
    out.append(("table", (["kind", "key", base, v.label, "acts on", "source"], rows)))
    return out


def _slug(cell: dict) -> str:
    return f"{cell['workload']}_{cell['config']}"


def to_markdown(bl: list[tuple[str, Any]]) -> str:
    lines: list[str] = []
    for kind, x in bl:
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + x, ""]
        elif kind == "p":
            lines += [x, ""]
        elif kind == "list":
            lines += [f"- {i}" for i in x] + [""]
        elif kind == "table":
            headers, rows = x
            cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            lines.append("| " + " | ".join(map(cell, headers)) + " |")
            lines.append("|" + "|".join("---" for _ in headers) + "|")
            lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
            lines.append("")
        elif kind == "image":
            lines += [f"![{x[1]}]({x[0]})", ""]
    return "\n".join(lines)


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
td.REGRESSED { background: #f8d0d0; font-weight: bold; } td.improved { background: #d4f0d4; }
td.worse { background: #fbeed0; }
img { max-width: 100%; border: 1px solid #eee; margin: 6px 0; }
.verdict li { margin: 4px 0; }
"""


def to_html(bl: list[tuple[str, Any]], title: str) -> str:
    esc = html.escape
    bold = lambda s: esc(s).replace("**", "\x00").split("\x00")  # noqa: E731

    def inline(s: str) -> str:  # **bold** only
        parts = bold(s)
        return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))

    body = []
    for kind, x in bl:
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{esc(x)}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{inline(x)}</p>")
        elif kind == "list":
            body.append("<ul class='verdict'>" + "".join(f"<li>{inline(i)}</li>" for i in x) + "</ul>")
        elif kind == "table":
            headers, rows = x
            head = "".join(f"<th>{esc(str(h))}</th>" for h in headers)
            trs = "".join("<tr>" + "".join(f"<td class='{esc(str(c))}'>{esc(str(c))}</td>"
                                           if str(c) in STATUS_TEXT.values() else f"<td>{esc(str(c))}</td>"
                                           for c in r) + "</tr>" for r in rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>")
        elif kind == "image":
            body.append(f"<figure><img src='{esc(x[0])}' alt='{esc(x[1])}'><figcaption>{esc(x[1])}</figcaption>"
                        "</figure>")
    return (f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


# ---- plots --------------------------------------------------------------------------------------
def plot_cell(result, cell: dict, dest: Path) -> list[Path]:
    """Write the metrics and CDF plots of one workload x config (and its history across sessions,
    when there are two or more); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    dest.mkdir(parents=True, exist_ok=True)
    labels = [v.label for v in result.versions]
    colors = {lab: _COLORS[i % len(_COLORS)] for i, lab in enumerate(labels)}
    slug = _slug(cell)
    paths = [_save(_metrics_figure(result, cell, labels, colors), dest / f"metrics_{slug}.png"),
             _save(_cdf_figure(cell, labels, colors), dest / f"cdf_{slug}.png")]
    history = _history_figure(result, cell)
    if history is not None:
        paths.append(_save(history, dest / f"history_{slug}.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _metrics_figure(result, cell: dict, labels: list[str], colors: dict[str, str]):
    """One bar per version and headline metric: pooled value, CI whiskers, repetitions as dots."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(14, 6.5))
    for ax, (m, title) in zip(axes.flat, METRICS.items()):
        is_rate = m in HIGHER_IS_BETTER
        scale = 1.0 if is_rate else 1000.0
        for i, lab in enumerate(labels):
            st = cell["versions"][lab]["metrics"][m]
            val = st["value"]
            if val is None or (isinstance(val, float) and math.isnan(val)):
                continue
            status = cell["comparisons"].get(lab, {}).get(m, {}).get("status")
            yerr = None
            if st["ci"]:
                lo, hi = st["ci"]
                yerr = [[max(val - lo, 0) * scale], [max(hi - val, 0) * scale]]
            ax.bar(i, val * scale, color=colors[lab], yerr=yerr, capsize=4,
                   edgecolor="#c00000" if status == "regressed" else "none", linewidth=2.5)
            reps = [x for x in st["per_repetition"] if x is not None]
            ax.scatter([i] * len(reps), [x * scale for x in reps], color="black", s=10, zorder=3)
        ax.set_title(title + ("" if is_rate else " (ms)"), fontsize=10)
        ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    axes.flat[-1].axis("off")
    axes.flat[-1].text(0, 0.5, "bars: pooled over repetitions\nwhiskers: 95% block-bootstrap CI\n"
                               "  (rates: range of repetitions)\ndots: single repetitions\n"
                               "red edge: regressed beyond threshold", fontsize=9)
    fig.suptitle(f"{result.suite.name}: {cell['workload']} / {cell['config']}")
    return fig


def _cdf_figure(cell: dict, labels: list[str], colors: dict[str, str]):
    """TTFT, TPOT and E2E CDFs of each version, pooled over its repetitions."""
    import matplotlib.pyplot as plt
    import numpy as np

    from layerscope.regressions.pooled import pooled_values

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric in zip(axes, ("ttft", "tpot", "e2e")):
        for lab in labels:
            an = [r.analysis for r in cell["_runs"][lab]]
            x = np.sort(pooled_values(an, metric))
            x = x[~np.isnan(x)]
            if len(x):
                ax.plot(x * 1000, np.arange(1, len(x) + 1) / len(x), label=f"{lab} (n={len(x)})", color=colors[lab],
                        drawstyle="steps-post")
        ax.set_title(f"{metric.upper()} CDF", fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    return fig


def _history_figure(result, cell: dict):
    """Each revision's medians across the sessions of the history (None: fewer than two sessions)."""
    import matplotlib.pyplot as plt

    t = _trend(result, cell)
    if t["session"].nunique() < 2:
        return None
    sessions = list(dict.fromkeys(t["session"]))
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, (m, title) in zip(axes, (("ttft_p50_s", "TTFT p50 (ms)"), ("tpot_p50_s", "TPOT p50 (ms)"),
                                     ("output_tokens_per_s", "output tokens/s"))):
        scale = 1.0 if m in HIGHER_IS_BETTER else 1000.0
        for i, (rev, g) in enumerate(t.groupby("git_rev", sort=False, dropna=False)):
            color = _COLORS[i % len(_COLORS)]
            x = [sessions.index(sx) for sx in g["session"]]  # every version of every session: a dot
            ax.scatter(x, g[m] * scale, color=color, s=14)
            mean = g.groupby("session", sort=False)[m].mean()  # the revision's line: mean per session
            ax.plot([sessions.index(sx) for sx in mean.index], mean * scale, "-", color=color,
                    label=str(rev)[:10] if isinstance(rev, str) else "endpoint")
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(sessions)), [sx[:15] for sx in sessions], rotation=25, fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, title="git rev", title_fontsize=7)
    return fig


def write_reports(result) -> dict[str, Path]:
    """Write report.md, report.html, plots/ and result.json into the session directory."""
    d = result.session_dir
    for cell in result.cells:
        plot_cell(result, cell, d / "plots")
    bl = blocks(result)
    (d / "report.md").write_text(to_markdown(bl))
    (d / "report.html").write_text(to_html(bl, f"layerscope regress {result.suite.name} {result.session}"))
    (d / "result.json").write_text(json.dumps(result.to_json(), indent=1))
    return {"markdown": d / "report.md", "html": d / "report.html", "json": d / "result.json"}


# ---- terminal -----------------------------------------------------------------------------------
def terminal_table(result):
    """A rich Table: one row per workload/config x metric, baseline and each candidate."""
    from rich.table import Table

    base = result.baseline.label
    cands = [v.label for v in result.versions[1:]]
    t = Table(title=f"layerscope regress {result.suite.name}: {base} (baseline) vs {', '.join(cands)}",
              title_justify="left")
    t.add_column("workload/config")
    t.add_column("metric")
    t.add_column(base, justify="right")
    for c in cands:
        t.add_column(c, justify="right")
        t.add_column("change", justify="right")
        t.add_column("status")
    t.add_column("gate", justify="right")
    style = {"regressed": "bold red", "worse": "yellow", "improved": "green", "unchanged": "dim"}
    for cell in result.cells:
        first = True
        for m, label in METRICS.items():
            row = [f"{cell['workload']}/{cell['config']}" if first else "", label,
                   fmt_value(m, cell["versions"][base]["metrics"][m]["value"])]
            for c in cands:
                g = cell["comparisons"].get(c, {}).get(m)
                row.append(fmt_value(m, cell["versions"][c]["metrics"][m]["value"]))
                row.append(fmt_pct(g["delta_pct"]) if g else "-")
                row.append(f"[{style[g['status']]}]{status_text(g)}[/]" if g else "n/a")
            thr = result.suite.thresholds.get(m)
            row.append("-" if thr is None else f"{thr:.0f}%")
            t.add_row(*row)
            first = False
        t.add_section()
    n = len(result.regressions)
    t.caption = (f"{n} regression{'s' if n != 1 else ''}" + (f", {len(result.failures)} failed runs" if
                                                               result.failures else "")
                 + f"; exit {result.exit_status}; report: {result.session_dir / 'report.html'}")
    return t
