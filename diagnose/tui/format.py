"""Text formatting for the TUI: durations, shares and block bars. Rendering only.

Durations reuse diagnose.render's rule (ms below 0.1 s, else s) so the TUI and
``layerscope diagnose`` print the same figures.
"""

from __future__ import annotations

import math
from typing import Any

from layerscope.diagnose.render import fmt_metric, fmt_pct, fmt_s

__all__ = ["fmt_s", "fmt_pct", "fmt_metric", "fmt_share", "fmt_count", "fmt_at", "block_bar", "is_missing"]

_EIGHTHS = " ▏▎▍▌▋▊▉"


def is_missing(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt_share(x: float | None) -> str:
    """0.934 -> '93%'; a non-zero share under 0.5% -> '<1%'."""
    if is_missing(x):
        return ""
    if 0 < x < 0.005:
        return "<1%"
    return f"{100 * x:.0f}%"


def fmt_count(x: Any) -> str:
    if is_missing(x):
        return ""
    return f"{int(x):,}"


def fmt_at(x: float | None) -> str:
    """An offset from arrival: '+0.005 s' (always seconds, three decimals: the events line up)."""
    if is_missing(x):
        return ""
    return f"{x:+.3f} s"


def block_bar(share: float, width: int, start: float = 0.0) -> str:
    """A bar ``share`` of ``width`` cells long, beginning ``start`` (a share) into it, in eighth
    blocks; a present but tiny share still shows a sliver (▏), as the EXAMPLES.md sketch does."""
    if width <= 0 or is_missing(share):
        return " " * max(width, 0)
    offset = min(int(max(start, 0.0) * width), width - 1)
    eighths = max(1, round(max(share, 0.0) * width * 8))
    eighths = min(eighths, (width - offset) * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + (_EIGHTHS[part] if part else "")
    return (" " * offset + bar).ljust(width)
