"""Attribution: split a metric's change into layers, then name the layer that caused it.

Step 1, accounting (``quantile_components``, ``throughput_components``): the requests
around the same quantile in both runs (e.g. ranks 40-60% for p50) are averaged per
component; the component deltas plus a residual sum exactly to the quantile's
delta. Throughput is attributed as seconds per output token, split by step phase.

Step 2, causes: the layer where time was *spent* is not always the layer that *caused* it.
``Causes.explain`` passes a component's delta through the cause rules, which are data
(``rules.RULES``, ``QUEUE_RULES``, ``FORWARD_RULES``: layer, measures read, predicate, explanation,
evidence; docs/diagnose.md §4 lists them). ``Causes`` holds what the rules read: both runs'
analyses, the per-step phase deltas at equal batch size, and the evidence each rule quotes.

(Over 400 lines: the measures the rules read share one context, both runs' analyses and the
per-step fits; split, a rule's predicate and the evidence it quotes would read different fits.)
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from layerscope.contract import CONFIG_DEFAULTS
from layerscope.diagnose import model
from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.decompose import COMPONENTS, col
from layerscope.diagnose.rules import FORWARD, FORWARD_RULES, KV_LAYERS, PHASE_OF, RULES, STEP_LAYERS, Ask, Part, dispatch

WINDOWS = {0.5: (0.4, 0.6), 0.9: (0.85, 0.95), 0.99: (0.97, 1.0)}
STEP_PHASES = ("engine.schedule", "model.forward", "parallel.collective", "engine.output")
# below this overlap of the two runs' batch-token mixes (Causes.batch_overlap) a change of model time
# is put down to the batches, not to a row or kernel "at equal batch size", when a config that shapes the
# batch changed (docs/diagnose.md §2).
# On the fault matrix: A/A pairs 0.98-1.0, injected faults 0.89-1.0 but a collective delay 0.63 (slower
# steps batch more), token budget 32 0.52, max_num_seqs 1 0.17, a 16-block KV pool 0.32 (docs/diagnose.md §2)
MIN_BATCH_OVERLAP = 0.5
# the run's own threads' CPU wait share (run-queue wait over wait + CPU) must move at least this much
# the way the steps did for a routing change to be read as the replicas' changed share of the CPUs
# (fault matrix router.skew, three revisions: 42-43% -> 26-30%)
MIN_WAIT_MOVE = 0.05
# the busiest replica's share of requests (in fair shares) moved by at least this: the routing changed
ROUTER_SHARE_MOVE = 0.15
# Router policies whose choice does not depend on how fast the replicas are: round_robin takes
# them in turn, prefix_affinity hashes the prompt's first block (least_loaded follows the
# replicas' requests in flight, which slower steps change: there the share can follow the speed).
LOAD_INDEPENDENT_ROUTING = ("round_robin", "prefix_affinity")
# config keys that shape the batch, and the layer each acts through (first match wins)
BATCH_SHAPING = {"max_num_batched_tokens": "engine.queue", "enable_chunked_prefill": "engine.schedule",
                 "max_num_seqs": "engine.queue", "num_kv_blocks": "engine.kv", "resolved.num_kv_blocks": "engine.kv",
                 "block_size": "engine.kv", "kv_cache_memory_bytes": "engine.kv"}
BATCH_SHAPING_KEYS = frozenset(BATCH_SHAPING)


def quantile_components(base: pd.DataFrame, cand: pd.DataFrame, metric: str, q: float) -> pd.DataFrame:
    """Per-layer change of ``metric`` (ttft | tpot | e2e) around quantile ``q``.

    Columns: layer, baseline_s, candidate_s, delta_s, share (of the quantile's delta).
    The last row, ``residual``, makes delta_s sum exactly to the quantile delta.
    """
    vb, vc = _window_means(base, metric, q), _window_means(cand, metric, q)
    qb = float(np.nanquantile(base[f"{metric}_s"], q)) if base[f"{metric}_s"].notna().any() else math.nan
    qc = float(np.nanquantile(cand[f"{metric}_s"], q)) if cand[f"{metric}_s"].notna().any() else math.nan
    rows = [(layer, vb[layer], vc[layer], vc[layer] - vb[layer]) for layer in COMPONENTS]
    explained = sum(r[3] for r in rows)
    rows.append(("residual", qb - sum(vb.values()), qc - sum(vc.values()), (qc - qb) - explained))
    df = pd.DataFrame(rows, columns=["layer", "baseline_s", "candidate_s", "delta_s"])
    d = qc - qb
    df["share"] = df["delta_s"] / d if d else math.nan
    return df


def _window_means(bd: pd.DataFrame, metric: str, q: float) -> dict[str, float]:
    v = bd[f"{metric}_s"].to_numpy(np.float64)
    ok = ~np.isnan(v)
    if not ok.any():  # no request has this metric (e.g. TPOT of one-token outputs)
        return {layer: math.nan for layer in COMPONENTS}
    lo, hi = WINDOWS.get(q, (max(q - 0.05, 0.0), min(q + 0.05, 1.0)))
    ranks = pd.Series(v[ok]).rank(pct=True, method="first").to_numpy()
    sel = (ranks >= lo) & (ranks <= hi)
    if sel.sum() < 5:  # too few requests: the 5 nearest the quantile
        target = np.nanquantile(v[ok], q)
        sel = np.zeros(ok.sum(), bool)
        sel[np.argsort(np.abs(v[ok] - target))[:5]] = True
    rows = bd[ok][sel]
    return {layer: float(rows[col(metric, layer)].mean()) for layer in COMPONENTS}


def throughput_components(a: RunAnalysis) -> dict[str, float]:
    """Seconds of wall time per output token, by step phase, plus ``idle`` (no step
    running: waiting for requests). Sums to 1 / output_tokens_per_s."""
    s = a.run.steps
    st = a.steps
    tokens = a.indicators["output_tokens"]
    reps = max(a.indicators["num_replicas"], 1)
    if not tokens or a.busy_s <= 0:
        return {k: math.nan for k in (*STEP_PHASES, "idle")}
    fwd = np.nan_to_num(s["forward_s"].to_numpy(np.float64))
    coll = fwd * st["collective_frac"].to_numpy()
    parts = {
        "engine.schedule": float(st["host_s"].sum()),
        "model.forward": float((fwd - coll).sum() + np.nansum(s["sample_s"])),
        "parallel.collective": float(coll.sum()),
        "engine.output": float(np.nansum(s["output_s"])),
    }
    out = {k: v / reps / tokens for k, v in parts.items()}
    out["idle"] = a.busy_s / tokens - sum(out.values())
    return out


def ms(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x * 1e3:.3g} ms" if abs(x) < 1 else f"{x:.3g} s"


def pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


class Causes:
    """Cause rules for one baseline/candidate pair (both runs' analyses + their diffs)."""

    def __init__(self, a: RunAnalysis, b: RunAnalysis, changed_keys: set[str], workload_changed: bool,
                 hardware_changed: bool, same_machine: bool = False, machine: dict | None = None):
        self.a, self.b = a, b
        self.same_machine = same_machine  # machine evidence recorded in both runs says it did not differ
        self.machine = machine or {}  # machine.machine_diff of the two runs (the run's own CPU wait)
        self.ia, self.ib = a.indicators, b.indicators
        self.keys = changed_keys
        self.workload_changed = workload_changed
        self.hardware_changed = hardware_changed
        self._overlap: float | None = None
        self.phase = self._phase_deltas()
        self.uniform = self._uniform_factor()
        base_step = self.ia.get("step_s_mean") or math.nan
        self._base_step = base_step

    # ---- per-step service time at equal batch composition ----
    def _phase_deltas(self) -> dict[str, float]:
        """Per-step change of each phase at equal batch size: the candidate's mean minus what the
        baseline's least-squares fit (on batch tokens for forward, on sequences for host and
        output time) predicts for the candidate's batches."""
        ia, ib = self.ia, self.ib
        sa, sb = self.a.run.steps, self.b.run.steps
        fit = self.a.forward_fit
        tokens_b = float(sb["num_batched_tokens"].mean()) if len(sb) else math.nan
        fwd_b = ib.get("forward_s_mean", math.nan) - _z(ib.get("collective_s_mean"))
        if not math.isnan(fit["per_token_s"]):
            expected = fit["intercept_s"] + fit["per_token_s"] * tokens_b
        else:
            expected = ia.get("forward_s_mean", math.nan) - _z(ia.get("collective_s_mean"))

        def seqs(s):
            return (s["num_prefill_seqs"].fillna(0) + s["num_decode_seqs"].fillna(0)).to_numpy(np.float64)

        seqs_b = float(seqs(sb).mean()) if len(sb) else math.nan
        host_exp = _fit_at(seqs(sa), self.a.steps["host_s"].to_numpy(), seqs_b)
        out_exp = _fit_at(seqs(sa), sa["output_s"].to_numpy(np.float64), seqs_b)
        host_b = float(self.b.steps["host_s"].mean()) if len(self.b.steps) else math.nan
        self.expected = {"host": host_exp, "model": expected, "output": out_exp}
        return {
            "engine.schedule": _z(host_b - host_exp),
            "model.forward": _z(fwd_b - expected) + _z(ib.get("sample_s_mean", 0) - ia.get("sample_s_mean", 0)),
            "parallel.collective": _z(_z(ib.get("collective_s_mean")) - _z(ia.get("collective_s_mean"))),
            "engine.output": _z(ib.get("output_s_mean", 0) - out_exp),
        }

    def phase_ratios(self) -> dict[str, float]:
        """Candidate / baseline time per step of each phase at equal batch size (host, model,
        output; collective with TP). NaN where the baseline has none."""
        e = self.expected
        r = {"host": (e["host"] + self.phase["engine.schedule"]) / e["host"] if e["host"] > 0 else math.nan,
             "model": (e["model"] + self.phase["model.forward"]) / e["model"] if e["model"] > 0 else math.nan,
             "output": (e["output"] + self.phase["engine.output"]) / e["output"] if e["output"] > 0 else math.nan}
        ca, cb = _z(self.ia.get("collective_s_mean")), _z(self.ib.get("collective_s_mean"))
        if ca > 0:  # with TP, collectives must have scaled alike too
            r["collective"] = cb / ca
        return r

    def step_ratio(self) -> float:
        """Candidate / baseline time of a whole step (host + model + output) at equal batch size;
        NaN without a baseline step time."""
        e = self.expected
        base = e["host"] + e["model"] + e["output"]
        if not base > 0:
            return math.nan
        moved = sum(_z(self.phase.get(k)) for k in STEP_LAYERS)
        return (base + moved) / base

    def standout_phase(self, worse: bool, factor: float = 1.5, min_share: float = 0.1) -> dict | None:
        """A step phase that changed (in the direction ``worse``: slower) by ``factor`` beyond the
        median phase's factor and by at least ``min_share`` of the baseline's step time: what a
        software change does, and a machine that is uniformly slower or busier does not.
        {phase, ratio, others} or None."""
        r = {k: v for k, v in self.phase_ratios().items() if v > 0 and not math.isnan(v)}
        if len(r) < 2:
            return None
        logs = {k: math.log(v) for k, v in r.items()}
        names = {"host": "engine.schedule", "model": "model.forward", "output": "engine.output",
                 "collective": "parallel.collective"}
        step = self.ia.get("step_s_mean") or math.nan
        for k, lv in sorted(logs.items(), key=lambda kv: -kv[1] if worse else kv[1]):
            rest = [x for j, x in logs.items() if j != k]
            base = float(np.median(rest))
            beyond = (lv - base) if worse else (base - lv)
            delta = self.phase.get(names[k], math.nan) if k != "collective" else self.phase["parallel.collective"]
            if beyond >= math.log(factor) and step > 0 and abs(delta) >= min_share * step:
                return {"phase": names[k], "ratio": r[k], "others": math.exp(base)}
        return None

    def batch_overlap(self) -> float:
        """How alike the two runs' batches were: the overlap of their distributions of batch
        tokens per step (sum over power-of-two bins of the smaller share; 1 = the same mix)."""
        def shares(x: RunAnalysis) -> np.ndarray:
            t = x.run.steps["num_batched_tokens"].to_numpy(np.float64)
            t = t[~np.isnan(t)]
            if not len(t):
                return np.zeros(64)
            return np.bincount(np.log2(np.maximum(t, 1)).astype(np.int64), minlength=64)[:64] / len(t)

        if self._overlap is None:
            self._overlap = float(np.minimum(shares(self.a), shares(self.b)).sum()) \
                if len(self.a.run.steps) and len(self.b.run.steps) else 1.0
        return self._overlap

    def _uniform_factor(self) -> dict[str, float] | None:
        """Host, model and output time per step (at equal batch size) all scaled by about the
        same factor, with no config or workload change: the machine was slower or busier.
        {phase: ratio} or None."""
        r = self.phase_ratios()
        vals = [v for v in r.values() if not math.isnan(v)]
        if len(vals) < 3 or self.keys or self.workload_changed or self.same_machine:
            return None
        return r if _common_factor(vals) else None

    def routing_policies(self) -> set[str]:
        default = CONFIG_DEFAULTS["router_policy"]
        return {self.a.cfg("router_policy", default), self.b.cfg("router_policy", default)}

    def routing_load_independent(self) -> bool:
        """Both runs routed with a policy that the replicas' speed does not steer: a share that
        moved was the routing's doing, not a consequence of how fast the replicas ran."""
        return self.routing_policies() <= set(LOAD_INDEPENDENT_ROUTING)

    def routing_shared_cpus(self, s: float = 1.0) -> list[str] | None:
        """The routing moved load between replicas that share the machine's CPUs, and that changed
        how fast every step ran: the busiest replica's share moved (either way), every step phase
        moved by about one factor in the direction ``s`` (slower: s > 0), and the run's own threads
        waited for a CPU more (s > 0) or less of the time, with nothing else changed (no config key
        but the router's, same workload) and a routing the replicas' speed does not steer. One
        replica taking most of a burst, on a machine where the replicas, the gateway and the client
        share the cores, gets a core to itself: its steps run faster although the routing is worse
        balanced (and spreading the load makes them compete). Evidence lines, or None."""
        if (not self.routing_moved() or self.workload_changed or self.keys - {"router_policy"}
                or not self.routing_load_independent()):
            return None
        r = self.phase_ratios()
        vals = [v for v in r.values() if not math.isnan(v)]
        if len(vals) < 3 or not _common_factor(vals) or (vals[0] > 1) != (s > 0):
            return None
        wait = self.machine.get("run_wait_share")
        if not wait or any(w is None or math.isnan(w) for w in wait) or s * (wait[1] - wait[0]) < MIN_WAIT_MOVE:
            return None
        p = self.machine.get("run_wait_p_value")
        return self.router_evidence() + [
            "per step at equal batch size: " + ", ".join(f"{k} x{v:.2f}" for k, v in r.items() if not math.isnan(v)),
            f"the run's own threads waited for a CPU {wait[0]:.0%} -> {wait[1]:.0%} of the time they were runnable"
            + (f" (p={p:.2g})" if p is not None and not math.isnan(p) else "")]

    def slowdown(self, s: float = 1.0) -> float:
        """How much slower (s > 0) or faster (s < 0) the step phases got at equal batch size, as a
        share of the baseline's step time (only the phases that moved that way)."""
        moved = sum(max(s * v, 0.0) for v in self.phase.values())
        return moved / self._base_step if self._base_step and self._base_step > 0 else 0.0

    def router_skewed(self, s: float = 1.0) -> bool:
        """The busiest replica's share grew (s > 0) or shrank (s < 0, the baseline was skewed)."""
        ia, ib = self.ia, self.ib
        return (max(ia["num_replicas"], ib["num_replicas"]) > 1
                and s * (ib["replica_share_max"] - ia["replica_share_max"]) >= ROUTER_SHARE_MOVE)

    def routing_moved(self) -> bool:
        """The busiest replica's share moved, either way."""
        return self.router_skewed(1.0) or self.router_skewed(-1.0)

    def explain(self, layer: str, delta_s: float, metric: str, from_slowdown: bool = False) -> list[Part]:
        """Blame ``delta_s`` seconds measured in ``layer`` on the layer(s) that caused it: the first rule of
        ``rules.RULES`` that applies (``from_slowdown``: one phase of a per-step slowdown)."""
        return dispatch(RULES, Ask(self, layer, delta_s, metric, from_slowdown))

    # ---- measures the queue rules read ----
    def kv_worse(self, s: float) -> bool:
        """The run the limit bound (the candidate for s > 0) ran out of KV blocks more often."""
        x, y = (self.ia, self.ib) if s > 0 else (self.ib, self.ia)
        return (y["kv_exhausted_frac"] - x["kv_exhausted_frac"] >= 0.05
                or y["num_preemptions"] > 2 * x["num_preemptions"] + 5)

    def capped(self, key: str, s: float) -> bool:
        """The share of steps at a cap (``seqs_capped_frac`` | ``budget_capped_frac``) rose by 10 points."""
        x, y = (self.ia, self.ib) if s > 0 else (self.ib, self.ia)
        return y[key] - x[key] >= 0.1

    def capped_text(self, key: str, what: str) -> str:
        return f"{what} {pct(self.ia[key])} -> {pct(self.ib[key])} of steps"

    def waiting_text(self) -> str:
        return f"steps with requests waiting {pct(self.ia['waiting_frac'])} -> {pct(self.ib['waiting_frac'])}"

    def phase_evidence(self, layer: str) -> list[str]:
        e = self.expected[PHASE_OF[layer]]
        what = "host time" if PHASE_OF[layer] == "host" else "output phase"
        return [f"{what} per step at equal batch size {ms(e)} -> {ms(e + self.phase[layer])}"]

    def host_share_text(self) -> str:
        return f"host share of step time {pct(self.ia['host_share'])} -> {pct(self.ib['host_share'])}"

    @staticmethod
    def ratio_text(ratios: dict[str, float]) -> str:
        return ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items())

    def slowdown_parts(self, d: float, effect: str) -> list[Part]:
        """Split ``d`` over the step phases that got slower (d > 0) or faster (d < 0) at equal batch size."""
        s = 1.0 if d >= 0 else -1.0
        up = {k: v for k, v in self.phase.items() if s * v > 0}
        total = sum(up.values())
        parts = []
        for layer, v in sorted(up.items(), key=lambda kv: -kv[1]):
            if v / total < 0.05:
                continue
            for p in self.explain(layer, d * v / total, "step", from_slowdown=True):
                p.cause = f"every step got slower, so {effect} ({p.cause})"
                p.evidence = [f"{layer} {'+' if v >= 0 else ''}{ms(v)} per step at equal batch size"] + p.evidence
                parts.append(p)
        if parts:
            scale = d / sum(p.delta_s for p in parts)
            for p in parts:
                p.delta_s *= scale
        return parts

    def more_steps(self, d: float, layer: str) -> list[Part]:
        """Per-step costs grew because requests took part in more steps (smaller prefill chunks,
        recomputation, longer outputs), not because a step got slower."""
        ia, ib = self.ia, self.ib
        per_step = self.phase[layer] / (self.expected[PHASE_OF[layer]] or math.nan)
        s = 1.0 if d >= 0 else -1.0
        sa, sb = ia.get("steps_per_request", math.nan), ib.get("steps_per_request", math.nan)
        ca, cb = ia.get("prefill_chunks_per_request", math.nan), ib.get("prefill_chunks_per_request", math.nan)
        more, more_chunks = (sb >= 1.2 * sa, cb >= 1.2 * ca) if s > 0 else (sa >= 1.2 * sb, ca >= 1.2 * cb)
        if not more or s * per_step >= 0.1:
            return []
        ev = [f"steps per request {sa:.1f} -> {sb:.1f}; prefill chunks per request {ca:.1f} -> {cb:.1f}",
              f"{layer} per step unchanged at equal batch size"]
        if more_chunks:
            for key, lyr in (("max_num_batched_tokens", "engine.queue"), ("enable_chunked_prefill", "engine.schedule"),
                             ("max_num_seqs", "engine.queue")):
                if key in self.keys:
                    return [Part(lyr, d, f"prompts are prefilled in more, smaller chunks ({key} changed): every "
                                 "chunk pays a step", ev)]
        if s * (ib["recomputed_token_frac"] - ia["recomputed_token_frac"]) >= 0.05:
            return [Part("engine.kv", d, "preempted requests recompute their KV in extra steps", self.kv_evidence() + ev)]
        if self.workload_changed:
            return [Part("workload", d, "requests take part in more steps: the offered load changed", ev)]
        return []

    def steps_per_work(self, d: float, layer: str, metric: str) -> list[Part]:
        """Time in a per-step phase moved although the phase per step at equal batch size did not
        move that way: the batches changed. Per output token (throughput), smaller batches pay
        the per-step costs more often; per request (latencies), larger batches make each step's
        phase longer."""
        s = 1.0 if d >= 0 else -1.0
        ia, ib = self.ia, self.ib
        per = "host time" if PHASE_OF[layer] == "host" else "output phase"
        exp = self.expected[PHASE_OF[layer]]
        unchanged = f"{per} per step at equal batch size {ms(exp)} -> {ms(exp + self.phase[layer])} (did not move this way)"
        if metric != "output_tokens_per_s" and not metric.startswith("goodput"):
            sa, sb = self.a.run.steps, self.b.run.steps
            ra = float((sa["num_prefill_seqs"].fillna(0) + sa["num_decode_seqs"].fillna(0)).mean()) if len(sa) else math.nan
            rb = float((sb["num_prefill_seqs"].fillna(0) + sb["num_decode_seqs"].fillna(0)).mean()) if len(sb) else math.nan
            ev = [f"requests per step {ra:.2f} -> {rb:.2f}", unchanged]
            if not s * (rb - ra) > 0:
                return [Part(layer, d, f"time in {layer} per request changed with no per-step or batch-size change "
                             "to explain it", [unchanged])]
            comp = self._composition(d)
            parts = comp if isinstance(comp, list) else [comp]
            for p in parts:
                if p.layer == FORWARD:  # (_composition's default speaks of forwards)
                    p.layer, p.cause = layer, "more requests share each step (larger batches), so each step's " \
                                              f"{per} is longer"
                p.evidence = ev + [e for e in p.evidence if not e.startswith("batch tokens per step")]
            return parts
        ta = ia["output_tokens"] / ia["num_steps"] if ia["num_steps"] else math.nan
        tb = ib["output_tokens"] / ib["num_steps"] if ib["num_steps"] else math.nan
        ev = [f"output tokens per step {ta:.2f} -> {tb:.2f}", unchanged]
        if not s * (ta - tb) > 0:
            return [Part(layer, d, f"time in {layer} per output token changed with no per-step or batch-size change "
                         "to explain it", [unchanged])]
        x, y = (ia, ib) if s > 0 else (ib, ia)
        for key, lyr in (("max_num_seqs", "engine.queue"), ("max_num_batched_tokens", "engine.queue"),
                         ("enable_chunked_prefill", "engine.schedule"), ("num_kv_blocks", "engine.kv"),
                         ("resolved.num_kv_blocks", "engine.kv"), ("block_size", "engine.kv")):
            if key in self.keys:
                return [Part(lyr, d, f"steps carry fewer tokens each ({key} changed), so the per-step costs are "
                             "paid more often", ev)]
        if y["kv_exhausted_frac"] - x["kv_exhausted_frac"] >= 0.05 or y["num_preemptions"] > 2 * x["num_preemptions"] + 5:
            return [Part("engine.kv", d, "KV cache exhausted: smaller batches, so the per-step costs are paid more "
                         "often", self.kv_evidence() + ev)]
        if self.workload_changed:
            return [Part("workload", d, "steps carry fewer tokens each: the offered load changed", ev)]
        return [Part(layer, d, "steps carry fewer tokens each, so the per-step costs are paid more often", ev)]

    # ---- model time ----
    def forward(self, d: float, from_slowdown: bool = False) -> list[Part]:
        """Model time changed by ``d`` (s): the first of ``rules.FORWARD_RULES`` that explains it. Symmetric:
        for d < 0 every rule looks for the row, gap or cost that got faster (the baseline's limit)."""
        return dispatch(FORWARD_RULES, Ask(self, FORWARD, d, "step", from_slowdown))

    def sampler_parts(self, d: float) -> list[Part]:
        p = self._sampler(d)
        return [p] if p is not None else []

    def forward_from_batches(self, s: float) -> bool:
        """Steps are not slower (faster) per token: they carry more (fewer) tokens. Or the work per
        token changed where a line on batch tokens cannot follow it, so "at equal batch size" is
        no measure: prefix-cache hits dropped (each prefill token attends over the context that
        was cached: attention's cost grows with context, not with the step's tokens), or a config
        that shapes the batch changed and the two runs ran mostly unlike batches (the baseline's
        line carried into batches it never ran). Unlike batches with no such change come from the
        steps' own speed (slower steps gather more requests): the fit stays the measure there."""
        base_fwd = self.ia.get("forward_s_mean") or math.nan
        normalized = self.phase[FORWARD] / base_fwd if base_fwd > 0 else 0.0
        return bool(s * normalized < 0.1 or self.prefix_lost(s)
                    or (self.keys & BATCH_SHAPING_KEYS and self.batch_overlap() < MIN_BATCH_OVERLAP))

    def composition_parts(self, d: float, from_slowdown: bool) -> list[Part]:
        if from_slowdown:
            return [Part(FORWARD, d, "model time per step grew with the batch")]
        comp = self._composition(d)
        return comp if isinstance(comp, list) else [comp]

    def one_row(self, d: float) -> list[Part]:
        """One layer row (the same row of the other layers did not move alike) explains the change."""
        s = 1.0 if d >= 0 else -1.0
        fa = self.a.forward_fit
        scale = 1.0
        if not math.isnan(fa["per_token_s"]):
            ta, tb = model.timed_tokens_mean(self.a.run), model.timed_tokens_mean(self.b.run)
            ea, eb = fa["intercept_s"] + fa["per_token_s"] * ta, fa["intercept_s"] + fa["per_token_s"] * tb
            scale = eb / ea if ea > 0 else 1.0
        shown = model.layer_row_deltas(self.a.run, self.b.run, scale)
        shown = shown[shown["name"] != "sampler"]
        rows = _toward(shown, s)
        if rows.empty:
            return []
        pos = rows[rows["delta_s"] > 0]
        total = pos["delta_s"].sum()
        top = rows.iloc[0]
        m = re.fullmatch(r"layers\.\d+\.(\w+)", top["name"])
        sib = rows[rows["name"].str.fullmatch(rf"layers\.\d+\.{m.group(1)}") & (rows["name"] != top["name"])] \
            if m else rows.iloc[1:]
        sib_max = max(float(sib["delta_s"].max()), 0.0) if len(sib) else 0.0
        others = rows.iloc[1:]["ratio"].dropna()
        sib_ratio = float(sib["ratio"].max()) if len(sib) and sib["ratio"].notna().any() else 1.0
        # localized: the same row of the other layers did not grow alike, in seconds or (when
        # everything got slower around an injected delay, as on a shared CPU) as a factor
        by_delta = top["delta_s"] >= 3 * sib_max
        by_ratio = (len(others) > 0 and top["ratio"] >= 3 * float(others.median())
                    and top["ratio"] >= 3 * sib_ratio)
        if (total > 0 and top["delta_s"] >= 0.3 * total and top["delta_s"] >= 0.3 * top["baseline_s"]
                and (by_delta or by_ratio)):
            named = shown.set_index("name").loc[list(pos.head(3)["name"])]
            ev = [f"{name} {ms(r.baseline_s)} -> {ms(r.candidate_s)} per timed step (at equal batch size)"
                  for name, r in named.iterrows()]
            return [Part(FORWARD, d, f"one layer row got slower: {top['name']}", ev)]
        return []

    def kernel_parts(self, d: float) -> list[Part]:
        """From profiler windows in both runs: launch gaps against time inside kernels/ops, and whether
        the changed ops fit a fixed time per call or a common factor."""
        s = 1.0 if d >= 0 else -1.0
        word = "grew" if s > 0 else "shrank"
        fwd_slow = self.phase[FORWARD]
        ka, kb = self.a.kernel_summary, self.b.kernel_summary
        if not (ka["num_steps"] and kb["num_steps"]):
            return []
        # idle gaps per forward barely depend on the batch; compute does, so take it from the
        # forward slowdown at equal batch size minus the gap change. Ops that all gained the
        # same time per call (not the same factor) are launch overhead booked inside the op.
        dg = s * (kb["gap_s"] - ka["gap_s"])  # in the direction of d
        dc = s * fwd_slow - max(dg, 0.0)
        ops = model.op_change_kind(_toward(model.kernel_op_deltas(self.a.run, self.b.run), s))
        ev = [f"launch gaps per profiled forward {ms(ka['gap_s'])} -> {ms(kb['gap_s'])} "
              f"({pct(ka['gap_share'])} -> {pct(kb['gap_share'])} of forward)",
              f"kernel compute per profiled forward {ms(ka['compute_s'])} -> {ms(kb['compute_s'])}; "
              f"forward {'+' if fwd_slow >= 0 else ''}{ms(fwd_slow)} per step at equal batch size"]
        gained = "gained" if s > 0 else "lost"
        ambiguous = ops["kind"] is not None and _cannot_tell(ops)
        if ambiguous:
            ev.append(f"{ops['num_ops']} ops each {gained} about {ms(ops['per_op_s'])} per call, about "
                      f"{ops['factor'] if s > 0 else 1 / ops['factor']:.2f}x; the two models fit alike "
                      f"(spread {ops['cv_additive']:.2f} for a fixed time per call, {ops['cv_multiplicative']:.2f}"
                      f" for a common factor; the ops' own sizes vary by {ops['cv_size']:.2f})")
            return [Part("model.forward", d, f"time inside the kernels/ops {word}: a fixed cost per call or a "
                         "proportional slowdown, which these measurements cannot tell apart", ev,
                         alternatives=_KERNEL_ALTERNATIVES(s, ops))]
        if ops["kind"] == "additive":
            ev.append(f"{ops['num_ops']} ops each {gained} about {ms(ops['per_op_s'])} per call whatever their "
                      f"size (spread {ops['cv_additive']:.2f} vs {ops['cv_multiplicative']:.2f} for a common "
                      "factor): a fixed cost per launch")
            dg, dc = max(dg, 0.0) + max(dc, 0.0), 0.0
        elif ops["kind"] == "multiplicative":
            f = ops["factor"] if s > 0 else 1 / ops["factor"]
            ev.append(f"{ops['num_ops']} ops each got about {f:.2f}x {'slower' if s > 0 else 'faster'} (spread "
                      f"{ops['cv_multiplicative']:.2f} vs {ops['cv_additive']:.2f} for a fixed extra time)")
        up = max(dc, 0) + max(dg, 0)
        if up > 0:
            parts = []
            if dg > 0 and dg / up >= 0.1:
                parts.append(Part("kernel.launch_gap", d * dg / up, "device idle between kernels/ops grew"
                                  if ops["kind"] != "additive" else "a fixed cost per kernel/op launch grew", ev))
            if dc > 0 and dc / up >= 0.1:
                parts.append(self._compute_part(d * dc / up, "time inside kernels/ops grew", ev))
            if parts:
                scale = d / sum(p.delta_s for p in parts)
                for p in parts:
                    p.delta_s *= scale
                return parts
        return []

    def fit_parts(self, d: float) -> list[Part]:
        """Without profiler windows: the forward's line on batch tokens, fixed cost against cost per token."""
        s = 1.0 if d >= 0 else -1.0
        word = "grew" if s > 0 else "shrank"
        fa, fb = self.a.forward_fit, self.b.forward_fit
        if not math.isnan(fa["per_token_s"]) and not math.isnan(fb["per_token_s"]) and fa["intercept_s"] > 0 \
                and fb["intercept_s"] > 0:
            r_int = (fb["intercept_s"] / fa["intercept_s"]) ** s
            r_tok = (fb["per_token_s"] / fa["per_token_s"]) ** s if fa["per_token_s"] > 0 and fb["per_token_s"] > 0 \
                else math.nan
            ev = [f"forward fixed cost {ms(fa['intercept_s'])} -> {ms(fb['intercept_s'])} per step; per batch token "
                  f"{fa['per_token_s'] * 1e6:.3g} -> {fb['per_token_s'] * 1e6:.3g} us "
                  "(no profiler window in both runs: inferred from forward time vs batch tokens)"]
            spread = min(self._token_spread(self.a), self._token_spread(self.b))
            if spread < 0.2 and (r_int >= 1.2 or (not math.isnan(r_tok) and r_tok >= 1.1)):
                ev.append(f"batch tokens per step barely vary (CV {spread:.2f}): a fixed cost per step and a cost "
                          "per token cannot be told apart")
                return [Part("model.forward", d, f"model forward time per step {word}: a fixed cost per forward or "
                             "a proportional slowdown, which these measurements cannot tell apart", ev,
                             alternatives=_KERNEL_ALTERNATIVES(s, None))]
            if r_int >= 1.2 and (math.isnan(r_tok) or r_tok < 1 + 0.25 * (r_int - 1)):
                return [Part("kernel.launch_gap", d, "a fixed cost per forward grew, not the cost per token "
                             "(launch gaps or per-op overhead)", ev)]
            if not math.isnan(r_tok) and r_tok >= 1.1:
                if self.prefix_lost(s):  # the work grew because prompts are prefilled in full (longer contexts)
                    return [Part("engine.kv", d, "prefix-cache hits dropped: prompts are prefilled in full, so each "
                                 "forward computes more and longer prefills", self.prefix_evidence() + ev)]
                return [self._compute_part(d, "forward time grew in proportion to the work", ev)]
        return []

    @staticmethod
    def _token_spread(x: RunAnalysis) -> float:
        """Coefficient of variation of batch tokens over a run's steps (how well a fit separates
        a fixed cost per step from a cost per token)."""
        t = x.run.steps["num_batched_tokens"].to_numpy(np.float64)
        t = t[~np.isnan(t)]
        return float(t.std() / t.mean()) if len(t) > 2 and t.mean() > 0 else 0.0

    def _compute_part(self, d: float, cause: str, ev: list[str]) -> Part:
        if self.hardware_changed and not self.keys:
            return Part("hardware", d, f"{cause} on different hardware, with no config change", ev)
        return Part("kernel.compute", d, cause, ev)

    def _composition(self, d: float) -> Part | list[Part]:
        ia, ib = self.ia, self.ib
        ev = [f"prefill tokens per request {ia['prefill_tokens_per_request']:.0f} -> "
              f"{ib['prefill_tokens_per_request']:.0f}",
              f"batch tokens per step {self.a.run.steps['num_batched_tokens'].mean():.1f} -> "
              f"{self.b.run.steps['num_batched_tokens'].mean():.1f}"]
        s = 1.0 if d >= 0 else -1.0
        if self.prefix_lost(s):
            if "router_policy" in self.keys:  # where requests land decides what each replica has cached
                return Part("gateway.route", d, "prefix-cache hits dropped with the routing (router_policy changed), "
                            "so more of each prompt is prefilled", self.prefix_evidence() + self.router_evidence() + ev)
            return Part("engine.kv", d, "prefix-cache hits dropped, so more of each prompt is prefilled",
                        self.prefix_evidence() + ev)
        if s * (ib["recomputed_token_frac"] - ia["recomputed_token_frac"]) >= 0.05:
            return Part("engine.kv", d, "preempted requests recompute their KV", self.kv_evidence() + ev)
        for key, layer in BATCH_SHAPING.items():
            if key in self.keys:
                return Part(layer, d, f"steps carry a different batch ({key} changed)",
                            (self.kv_evidence() if layer in KV_LAYERS else []) + ev)
        # the run with the smaller batches ran out of KV blocks: the pool shaped the batch
        small, large = (ia, ib) if s > 0 else (ib, ia)
        if small["kv_exhausted_frac"] - large["kv_exhausted_frac"] >= 0.05:
            return Part("engine.kv", d, "more requests fit in the KV pool at once (larger batches, each step longer)",
                        self.kv_evidence() + ev)
        if self.workload_changed:
            return Part("workload", d, "steps carry more tokens: the offered load changed", ev)
        if self.slowdown(s) >= 0.1:
            parts = self.slowdown_parts(d, "more requests share each step (larger batches)")
            if parts:
                return parts
        return Part("model.forward", d, "steps carry more tokens per forward (batch composition)", ev)

    def _sampler(self, d: float) -> Part | None:
        """The sampler (model.forward's sampling row, timed apart from the forward) got slower
        (s > 0) or faster per sampled row by >= 25%, and by >= 10% of the baseline's step: the
        forward's own time is then not what moved (sampling is booked with the model step)."""
        s = 1.0 if d >= 0 else -1.0

        def per_row(x: RunAnalysis) -> float:
            st = x.run.steps
            rows = float((st["num_decode_seqs"].fillna(0) + st["num_prefill_seqs"].fillna(0)).sum())
            return float(st["sample_s"].fillna(0).sum()) / rows if rows > 0 else math.nan

        ra, rb = per_row(self.a), per_row(self.b)
        ma, mb = self.ia.get("sample_s_mean") or 0.0, self.ib.get("sample_s_mean") or 0.0
        base = self._base_step
        if not (ra > 0 and rb > 0 and base and base > 0):
            return None
        if s * (rb / ra - 1) >= 0.25 and s * (mb - ma) >= 0.1 * base:
            return Part("model.forward", d, "the sampler got slower per sampled row",
                        [f"sampling time per sampled row {ms(ra)} -> {ms(rb)}",
                         f"sampling time per step {ms(ma)} -> {ms(mb)} (step {ms(base)})"])
        return None

    # ---- evidence helpers ----
    def prefix_lost(self, s: float = 1.0) -> bool:
        """Prefix-cache hits dropped with more prefill per request (s > 0), or rose with less (s < 0)."""
        x, y = (self.ia, self.ib) if s > 0 else (self.ib, self.ia)
        ha, hb = x["prefix_hit_rate"], y["prefix_hit_rate"]
        ca, cb = x["cached_token_frac"], y["cached_token_frac"]
        # hits down 10 points, or the uncached share of the prompts up 10% of itself (at a 90% hit
        # rate, 88% -> 92% is a third less prefill)
        lost = (not math.isnan(ha) and (math.isnan(hb) or ha - hb >= 0.1)) or (
            not math.isnan(ca) and not math.isnan(cb) and (ca - cb >= 0.1 or (1 - cb) >= 1.1 * (1 - ca) > 0))
        return bool(lost) and y["prefill_tokens_per_request"] >= 1.1 * x["prefill_tokens_per_request"]

    def prefix_evidence(self) -> list[str]:
        ev = [f"prefix-cache hit rate {pct(self.ia['prefix_hit_rate'])} -> {pct(self.ib['prefix_hit_rate'])}",
              f"cached prompt tokens {pct(self.ia['cached_token_frac'])} -> {pct(self.ib['cached_token_frac'])}"]
        if "enable_prefix_caching" in self.keys:
            ev.append(f"enable_prefix_caching {self.a.cfg('enable_prefix_caching')} -> "
                      f"{self.b.cfg('enable_prefix_caching')}")
        return ev

    def kv_evidence(self) -> list[str]:
        ia, ib = self.ia, self.ib
        return [f"KV free blocks at 0 on {pct(ia['kv_exhausted_frac'])} -> {pct(ib['kv_exhausted_frac'])} of steps",
                f"preemptions {ia['num_preemptions']:.0f} -> {ib['num_preemptions']:.0f}",
                f"KV tokens dropped by preemption {pct(ia['recomputed_token_frac'])} -> "
                f"{pct(ib['recomputed_token_frac'])} of the tokens computed"]

    def busiest_replica_share(self) -> tuple[float, float]:
        """The busiest replica's share of requests in the baseline and the candidate (0..1)."""
        ia, ib = self.ia, self.ib
        return (ia["replica_share_max"] / max(ia["num_replicas"], 1),
                ib["replica_share_max"] / max(ib["num_replicas"], 1))

    def router_evidence(self) -> list[str]:
        ia, ib = self.ia, self.ib
        if ib["num_replicas"] <= 1:
            return []
        was, now = self.busiest_replica_share()
        ev = [f"busiest replica gets {now:.0%} of requests (was {was:.0%}; fair share {1 / ib['num_replicas']:.0%})"]
        if "replica_queue_s_max" in ib:
            ev.append(f"engine.queue per replica at TTFT: {ms(ib['replica_queue_s_min'])} .. "
                      f"{ms(ib['replica_queue_s_max'])}")
        return ev

    def collective_evidence(self) -> list[str]:
        ev = [f"collective time per step {ms(self.ia.get('collective_s_mean'))} -> "
              f"{ms(self.ib.get('collective_s_mean'))}"]
        cr = self.b.collective_ranks
        if not cr.empty and len(cr) > 1:
            slow = cr.loc[cr["wait_share"].idxmin()]
            fast = cr.loc[cr["wait_share"].idxmax()]
            ev.append(f"rank {int(fast['rank'])} waits {pct(fast['wait_share'])} of each collective for rank "
                      f"{int(slow['rank'])} (skew: one slow rank)")
        return ev

    def req_p50(self, layer: str) -> str:
        c = col("ttft", layer)
        return f"p50 {ms(float(self.a.ok[c].median()))} -> {ms(float(self.b.ok[c].median()))} per request"


def _toward(deltas: pd.DataFrame, s: float) -> pd.DataFrame:
    """A deltas table (baseline_s, candidate_s, delta_s, ratio) seen in the direction ``s``: for
    s < 0 the runs swap, so the rules written for "got slower" find what got faster."""
    if s > 0 or deltas.empty:
        return deltas
    out = deltas.copy()
    out["baseline_s"], out["candidate_s"] = deltas["candidate_s"], deltas["baseline_s"]
    out["delta_s"] = -deltas["delta_s"]
    out["ratio"] = out["candidate_s"] / out["baseline_s"].where(out["baseline_s"] > 0)
    return out.sort_values("delta_s", ascending=False).reset_index(drop=True)


def _cannot_tell(ops: dict) -> bool:
    """The changed ops fit a fixed time per call and a common factor about equally (spreads
    within 1.25x of each other), or their sizes vary too little for the two models to differ
    beyond the measurements' own scatter: per-call overhead and proportional slowdown cannot be
    told apart. (The two models' predictions differ by the ops' size spread ``cv_size``: a
    fixed time per call leaves the ratios spread like the sizes, a common factor the deltas.
    The better model's spread is the scatter left over; the size spread must be at least twice
    that to separate them.)"""
    a, m = ops.get("cv_additive", math.nan), ops.get("cv_multiplicative", math.nan)
    if math.isnan(a) or math.isnan(m):
        return False
    close = max(a, m) <= 1.25 * max(min(a, m), 1e-9)
    return bool(close or _sizes_alike(ops))


def _sizes_alike(ops: dict) -> bool:
    """The changed ops' sizes spread less than twice the better model's scatter (``_cannot_tell``)."""
    return ops.get("cv_size", math.inf) < 2 * min(ops.get("cv_additive", math.inf), ops.get("cv_multiplicative",
                                                                                              math.inf))


def _KERNEL_ALTERNATIVES(s: float, ops: dict | None) -> list[dict]:  # noqa: N802 (a table, built per call)
    word = "grew" if s > 0 else "shrank"
    reason = ("the ops that changed are all of about one size, so the same time per call and the same factor give "
              "the same deltas" if ops is not None and _sizes_alike(ops) else
              "both models fit the per-op deltas about equally" if ops is not None else
              "the batches are all of about one size, so a fixed cost per step and a cost per token give the same "
              "forward times")
    return [{"layer": "kernel.launch_gap", "cause": f"a fixed cost per kernel/op launch {word}", "reason": reason},
            {"layer": "kernel.compute", "cause": f"time inside kernels/ops {word} in proportion to the work",
             "reason": reason}]


def _fit_at(x: np.ndarray, y: np.ndarray, at: float) -> float:
    """Least-squares line y = a + b x evaluated at ``at`` (the mean of y when x does not vary)."""
    ok = ~np.isnan(x) & ~np.isnan(y)
    x, y = x[ok], y[ok]
    if not len(y):
        return math.nan
    if len(y) < 3 or np.ptp(x) == 0 or math.isnan(at):
        return float(y.mean())
    b, a = np.polyfit(x, y, 1)
    return float(max(a + b * at, 0.0))


def _common_factor(ratios: list[float]) -> bool:
    """Per-step phase ratios (candidate / baseline) that all moved one way by about one factor:
    all >= 1.25 or all <= 0.8, and the largest within x1.8 of the smallest."""
    up = all(v >= 1.25 for v in ratios) or all(v <= 0.8 for v in ratios)
    return up and max(ratios) / min(ratios) <= 1.8


def _z(x) -> float:
    return 0.0 if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)
