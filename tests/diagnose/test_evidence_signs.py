"""A finding's evidence may not contradict its cause: every figure that says "more" or "less"
must move the way the finding does (worse or better), across many synthetic comparisons,
regressions and improvements alike (each knob applied to the candidate, then to the baseline).

The polarity of each kind of evidence line is stated here, independently of the rules that
write them: +1 the figure grows when the metric gets worse, -1 it shrinks, 0 context.
An evidence line no pattern knows fails the test, so a new kind of evidence gets a polarity.
"""

import math
import re

import pytest

from layerscope.diagnose.comparison import compare
from tests.diagnose.test_attribution import CASES

NUM = r"([+-]?\d[\d.]*(?:e[+-]?\d+)?)\s*(ms|us|s|%)?"
ARROW = NUM + r" -> " + NUM

# (pattern, polarity, which "A -> B" pair or signed figure to check); first match wins
POLARITY = [
    (r"^measured in [\w.]+: " + NUM, +1, "signed"),
    (r"\(this cause: " + NUM + r"\)", +1, "signed"),
    (r"per step at equal batch size .*did not move this way", 0, None),
    (r"^[\w.]+ " + NUM + r" per step at equal batch size", +1, "signed"),
    (r"^host time per step (at equal batch size )?", +1, "arrow"),
    (r"^host share of step time", 0, None),
    (r"^output phase per step (at equal batch size )?", +1, "arrow"),
    (r"^collective time per step ", +1, "arrow"),
    (r"^gateway admission per request \(median\) ", +1, "arrow"),
    (r"^forward per step ", +1, "arrow"),
    (r"^KV free blocks at 0 on ", +1, "arrow"),
    (r"^preemptions ", +1, "arrow"),
    (r"^KV tokens dropped by preemption ", +1, "arrow"),
    (r"^prefix-cache hit rate ", -1, "arrow"),
    (r"^cached prompt tokens ", -1, "arrow"),
    (r"^enable_prefix_caching ", 0, None),
    (r"^running = max_num_seqs with requests waiting on ", +1, "arrow"),
    (r"^steps at the token budget with requests waiting ", +1, "arrow"),
    (r"^steps with requests waiting ", +1, "arrow"),
    (r"^prefill tokens per request ", 0, None),
    (r"^batch tokens per step ", 0, None),
    (r"^steps per request ", +1, "arrow"),
    (r"^output tokens per step ", -1, "arrow"),
    (r"^requests per step ", +1, "arrow"),
    (r"^[\w.]+ is unchanged|per step unchanged at equal batch size", 0, None),
    (r"^busiest replica gets (\d+)% of requests \(was (\d+)%", +1, "was"),
    (r"^engine.queue per replica", 0, None),
    (r"^gateway\.(queue|route) p50 ", +1, "arrow"),
    (r"^launch gaps per profiled forward ", 0, None),  # checked per layer below
    (r"^kernel compute per profiled forward .*; forward " + NUM + " per step", +1, "signed"),
    (r"^\d+ ops each (gained|lost) ", +1, "gained"),
    (r"^\d+ ops each got about [\d.]+x (slower|faster)", +1, "slower"),
    (r"^forward fixed cost ", 0, None),  # checked per layer below
    (r"^batch tokens per step barely vary", 0, None),
    (r"^layers\.\d+\.\w+ .* per timed step", 0, None),  # the top rows; checked below for the first
    (r"^rank \d+ waits", 0, None),
    (r"^requests over the \w+ SLO \([^)]*\): " + ARROW, +1, "arrow"),
    (r"^per step at equal batch size: ", +1, "factors"),
    (r"^time measured in ", 0, None),
    (r"^the machine differed too|^a software change stands out|^other processes used|^the run's threads waited"
     r"|^the fixed yardstick|^the yardstick's timings|^no machine evidence", 0, None),
]


def _num(v: str, unit: str | None) -> float:
    x = float(v)
    return x * {"ms": 1e-3, "us": 1e-6, "s": 1.0, "%": 1e-2, None: 1.0}[unit]


def _check_line(line: str, direction: float, layer: str) -> str | None:
    """None if the line agrees with the direction (+1 worse, -1 better), else the complaint."""
    for pat, pol, how in POLARITY:
        m = re.search(pat, line)
        if not m:
            continue
        if pol == 0 or how is None:
            if line.startswith("launch gaps per profiled forward") and layer == "kernel.launch_gap":
                mm = re.search(ARROW, line)
                if (_num(mm.group(3), mm.group(4)) - _num(mm.group(1), mm.group(2))) * direction < 0:
                    return "launch gaps move against kernel.launch_gap"
            if line.startswith("forward fixed cost"):
                nums = re.findall(NUM, line)
                fixed = _num(*nums[1]) - _num(*nums[0])
                per_tok = _num(*nums[3]) - _num(*nums[2])
                moved = fixed if layer == "kernel.launch_gap" else per_tok if layer == "kernel.compute" else None
                if moved is not None and moved * direction < 0:
                    return f"{'fixed cost' if layer == 'kernel.launch_gap' else 'per-token cost'} moves against {layer}"
            return None
        if how == "signed":
            x = _num(m.group(1), m.group(2))
        elif how == "arrow":
            mm = re.search(ARROW, line)
            x = _num(mm.group(3), mm.group(4)) - _num(mm.group(1), mm.group(2))
        elif how == "was":
            x = float(m.group(1)) - float(m.group(2))
        elif how == "gained":
            x = 1.0 if m.group(1) == "gained" else -1.0
        elif how == "slower":
            x = 1.0 if m.group(1) == "slower" else -1.0
        elif how == "factors":
            fs = [float(f) for f in re.findall(r"x(\d[\d.]*)", line)]
            x = 1.0 if all(f >= 1 for f in fs) else -1.0 if all(f <= 1 for f in fs) else 0.0
        if x * pol * direction < 0:
            return f"moves against the finding ({'worse' if direction > 0 else 'better'})"
        return None
    return "no polarity known for this evidence line"


def _direction(f: dict, metric: dict) -> float:
    d = f["delta_s"]
    if d is not None and not (isinstance(d, float) and math.isnan(d)) and d != 0:
        return 1.0 if d > 0 else -1.0
    worse = (metric["delta_pct"] or 0) > 0 if f["metric"].endswith("_s") else (metric["delta_pct"] or 0) < 0
    return 1.0 if worse else -1.0


PAIRS = [(name, flip) for name in CASES for flip in (False, True)]


@pytest.mark.parametrize("name,flip", PAIRS)
def test_evidence_agrees_with_the_finding(synth, name, flip):
    base_kw, cand_kw, _ = CASES[name]
    a, b = synth(seed=1, **base_kw), synth(seed=1, noise_seed=2, **cand_kw)
    if flip:  # the same change seen as an improvement
        a, b = b, a
    d = compare(a, b).diagnosis
    assert d["verdict"] in ("regression", "improvement", "mixed", "environment_changed"), d["metrics"]
    problems = []
    for f in d["findings"]:
        if f["cause"].startswith("moved the other way"):
            continue
        direction = _direction(f, d["metrics"][f["metric"]])
        # the cause sentence reads in the finding's direction too
        if direction < 0 and re.search(r"\b(grew|got slower|dropped)\b", f["cause"]) and "faster" not in f["cause"]:
            problems.append((f["metric"], f["layer"], "cause", f["cause"]))
        rows_checked = False
        for line in f["evidence"]:
            if re.match(r"^layers\.\d+\.\w+ ", line) and not rows_checked and f["layer"] == "model.forward":
                rows_checked = True
                nums = re.findall(NUM, line)
                moved = _num(*nums[-1]) - _num(*nums[-2]) if len(nums) >= 2 else 0.0
                nums = [n for n in re.findall(NUM + r" -> " + NUM, line)]
                if nums:
                    moved = _num(nums[0][2], nums[0][3]) - _num(nums[0][0], nums[0][1])
                if moved * direction < 0:
                    problems.append((f["metric"], f["layer"], line, "the named row moves against the finding"))
                continue
            why = _check_line(line, direction, f["layer"])
            if why:
                problems.append((f["metric"], f["layer"], line, why))
    assert not problems, problems
