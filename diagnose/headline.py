"""The headline: one rule, from the significant metrics, for every comparison (docs/diagnose.md §2.8).

- some metric significantly worse and some significantly better: ``mixed`` (a trade-off);
- only worse: ``regression``; only better: ``improvement``; none: ``no_change``;
- the primary layer is the layer of the finding that explains the largest significant change in the
  headline's direction (for ``mixed``: the worse side, the cost of the trade-off), scored as the
  metric's change on the log-ratio scale times the finding's share of it.

Our bundles and external ones both call ``headline`` and ``primary``; the machine check
(``machine.machine_verdict``) may then turn a verdict into ``environment_changed`` or ``inconclusive``,
never into a direction the table does not show.
"""

from __future__ import annotations

import math

DIRECTIONAL = ("regression", "improvement", "mixed")


def worse_and_better(metrics: dict[str, dict], decides=lambda name: True) -> tuple[list[str], list[str]]:
    """The significant metrics that got worse and those that got better (only those ``decides`` accepts)."""
    worse = [n for n, m in metrics.items() if m.get("significant") and m.get("worse") and decides(n)]
    better = [n for n, m in metrics.items() if m.get("significant") and not m.get("worse") and decides(n)]
    return worse, better


def headline(metrics: dict[str, dict], decides=lambda name: True) -> str:
    """regression | improvement | mixed | no_change from the metrics' significance and direction."""
    worse, better = worse_and_better(metrics, decides)
    if worse and better:
        return "mixed"
    return "regression" if worse else "improvement" if better else "no_change"


def direction_metrics(verdict: str, metrics: dict[str, dict], decides=lambda name: True) -> set[str]:
    """The metrics whose change the primary finding must explain under ``verdict``: the worse ones for
    ``regression`` and ``mixed`` (plus those marked ``against`` an improvement), the better ones for
    ``improvement``; none otherwise."""
    worse, better = worse_and_better(metrics, decides)
    if verdict in ("regression", "mixed", "inconclusive"):
        return set(worse) | {n for n, m in metrics.items() if m.get("against")}
    if verdict == "improvement":
        return set(better)
    return set()


def score(metric: dict, share: float | None) -> float:
    """How much of a metric's change a finding explains: |log ratio| of the metric x the finding's share."""
    d = metric.get("delta_pct")
    if d is None or not math.isfinite(d) or d <= -100 or share is None or not math.isfinite(share):
        return 0.0
    return abs(math.log1p(d / 100)) * share


def order_by_direction(findings: list[dict], metrics: dict[str, dict], verdict: str,
                       decides=lambda name: True) -> list[dict]:
    """``findings`` with those that explain a change in the headline's direction first, by ``score``
    (largest first); the rest keep their order after them. The first one is the primary finding."""
    want = direction_metrics(verdict, metrics, decides)

    def key(f: dict) -> tuple[bool, bool, float]:
        m = metrics.get(f["metric"]) or {}
        share = f.get("share")
        lead = f["metric"] in want and (share is None or share > 0) and f.get("layer") != "workload"
        # pinned: a finding the machine check named as the software change that stands out
        return (not lead, not f.get("_pinned", False), -score(m, 1.0 if share is None else share) if lead else 0.0)

    return sorted(findings, key=key)


def primary(findings: list[dict], verdict: str, metrics: dict[str, dict]) -> dict | None:
    """{metric, layer[, alternatives]} of the first finding, when it explains a change the headline
    names; None for ``no_change`` and when no finding does."""
    if not findings or verdict == "no_change":
        return None
    f = findings[0]
    want = direction_metrics(verdict, metrics) if verdict in DIRECTIONAL else None
    if want is not None and want and f["metric"] not in want:
        return None
    out = {"metric": f["metric"], "layer": f["layer"]}
    if f.get("alternatives"):  # can't tell: the layer both share, both named
        out["alternatives"] = [a["layer"] for a in f["alternatives"]]
    return out
