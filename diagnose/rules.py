"""The cause rules as data: which layer caused the time measured in a layer (docs/diagnose.md §4).

A ``CauseRule`` names the layer it blames, the layers whose measured time it explains (``measured``),
the measures it reads, a predicate and an explanation (``explain``: the parts, with their evidence,
or [] to pass to the next rule). ``RULES`` is read in order, first match wins; ``QUEUE_RULES``
explain queueing (engine.queue, or the engine idle) the same way. Every rule is symmetric: for a
delta < 0 (an improvement) it looks for the limit that bound the baseline. The layer names of the
taxonomy are tested here and only here; ``attribution.Causes`` holds the measures the rules read.
``Finding`` is the typed form of one row of a diagnosis' findings (DESIGN.md, the diagnosis JSON).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

# ---- layer sets the rules and the machine check share ------------------------------------------
STEP_LAYERS = frozenset({"engine.schedule", "model.forward", "engine.output"})  # the phases of a step
FRONT_LAYERS = ("client", "gateway.queue", "gateway.route")  # the gateway and client's process
# layers a busier or slower machine moves (every step phase, and the queues they feed)
MACHINE_LAYERS = frozenset({"engine.schedule", "model.forward", "engine.output", "parallel.collective",
                            "kernel.compute", "kernel.launch_gap", "engine.queue", "hardware"})
KV_LAYERS = frozenset({"engine.kv"})
FORWARD = "model.forward"
ROUTE = "gateway.route"
ADMISSION = "gateway.queue"  # the gateway's admission, a per-request metric row of its own (front.py)
HOST_PHASES = ("engine.schedule", "engine.output")  # a step's own time beside the forward (work.py)
GATEWAY_LAYERS = ("gateway.queue", "gateway.route")  # the front end's own components (not the client)
PHASE_OF = {"engine.schedule": "host", "engine.output": "output", "model.forward": "model"}  # Causes.expected keys
WORKLOAD, HARDWARE, RESIDUAL, IDLE = "workload", "hardware", "residual", "idle"
NOT_SOFTWARE = frozenset({WORKLOAD, HARDWARE})


def within(phase: str) -> set[str]:
    """The layers whose time a step phase holds: the cause rules may name a finer layer (the kernels,
    the launch gaps, the collectives of the forward) than the phase that stood out."""
    return {phase, "kernel.compute", "kernel.launch_gap", "parallel.collective"} if phase == "model.forward" else {phase}


def is_front(layer: str) -> bool:
    return layer in FRONT_LAYERS


def is_step_phase(layer: str) -> bool:
    return layer in STEP_LAYERS or layer == "parallel.collective"


@dataclass
class Part:
    """Part of a component's delta blamed on one layer, with the reason."""

    layer: str
    delta_s: float
    cause: str
    evidence: list[str] = field(default_factory=list)
    # causes that predict the same measurements ("can't tell"): [{layer, cause, reason}]
    alternatives: list[dict] = field(default_factory=list)


@dataclass
class Finding:
    """One finding of a diagnosis: ``share`` of ``metric``'s change (``delta_s`` seconds) is ``layer``'s,
    because of ``cause``, shown by ``evidence``; ``machine_share``: the machine's measured part of the
    step's change where the runs' machines differed (contention.judge), else None."""

    metric: str
    layer: str
    share: float | None
    delta_s: float | None
    cause: str
    evidence: list[str] = field(default_factory=list)
    config_changes: list[str] = field(default_factory=list)
    alternatives: list[dict] = field(default_factory=list)
    machine_share: float | None = None

    def as_dict(self, **private: Any) -> dict[str, Any]:
        """The JSON row (with ``private`` keys, e.g. ``_score``, for the comparison to pop)."""
        return {**asdict(self), **private}


@dataclass(frozen=True)
class Ask:
    """What a rule is asked: explain ``delta_s`` seconds measured in ``layer`` of ``metric``'s change.
    ``c``: the pair's measures (attribution.Causes); ``from_slowdown``: one phase of a per-step
    slowdown being explained (the composition rule must not hand it back to the slowdown rule)."""

    c: Any
    layer: str
    delta_s: float
    metric: str
    from_slowdown: bool = False

    @property
    def s(self) -> float:
        return 1.0 if self.delta_s >= 0 else -1.0


@dataclass(frozen=True)
class CauseRule:
    name: str
    layer: str  # the layer it blames ("(by phase)": the phases that moved, each through RULES again)
    measured: frozenset[str]  # the layers whose measured time it explains; empty: any
    reads: tuple[str, ...]  # the measures it reads (docs/diagnose.md lists them)
    when: Callable[[Ask], bool]
    explain: Callable[[Ask], list[Part]]
    text: str

    def applies(self, q: Ask) -> bool:
        return (not self.measured or q.layer in self.measured) and bool(self.when(q))


def dispatch(rules: tuple[CauseRule, ...], q: Ask) -> list[Part]:
    """The parts of the first rule that applies and explains (a rule may pass with [])."""
    for r in rules:
        if r.applies(q):
            parts = r.explain(q)
            if parts:
                return parts
    return [Part(q.layer, q.delta_s, f"time in {q.layer} changed")]


def _always(q: Ask) -> bool:
    return True


def _fixed(layer: str, cause: str, evidence: Callable[[Ask], list[str]] = lambda q: []):
    return lambda q: [Part(layer, q.delta_s, cause, evidence(q))]


def _more(q: Ask) -> str:
    return "more" if q.s > 0 else "less"


def _slower(q: Ask) -> str:
    return "slower" if q.s > 0 else "faster"


# ---- the top-level table: where time was spent -> what made it go there -----------------------------
QUEUEING = frozenset({"engine.queue", IDLE})
RULES: tuple[CauseRule, ...] = (
    CauseRule("router_skew", "gateway.route",
              frozenset({"engine.queue", "engine.schedule", "model.forward", "engine.output", "engine.kv", IDLE}),
              ("replica_share_max", "num_replicas"), lambda q: q.c.router_skewed(q.s),
              lambda q: [Part("gateway.route", q.delta_s, "the router overloads one replica: its requests wait and "
                              f"its batches grow ({q.layer})", q.c.router_evidence())],
              "the busiest replica's share of requests moved by >= 15 points of a fair share"),
    CauseRule("routing_shared_cpus", "gateway.route", STEP_LAYERS | QUEUEING,
              ("replica_share_max", "router_policy", "phase_ratios", "run_wait_share"),
              lambda q: q.c.routing_shared_cpus(q.s) is not None,
              lambda q: [Part("gateway.route", q.delta_s, "the routing moved requests between replicas that share the "
                              f"machine's CPUs: the run's own processes competed {_more(q)} for a CPU, and every "
                              f"phase of a step ran {_slower(q)} by about one factor ({q.layer})",
                              q.c.routing_shared_cpus(q.s))],
              "the routing moved load between replicas sharing the CPUs; every phase and the run's CPU wait moved"),
    CauseRule("uniform_factor", HARDWARE, STEP_LAYERS | QUEUEING | {"parallel.collective", "engine.kv"},
              ("phase_ratios",), lambda q: bool(q.c.uniform),
              lambda q: [Part(HARDWARE, q.delta_s, "every phase of every step got slower by about the same factor "
                              "with no config change: the machine was slower or busier (or a new version is slower "
                              "everywhere)", [f"per step at equal batch size: {q.c.ratio_text(q.c.uniform)}",
                                              f"time measured in {q.layer}"])],
              "bundles without machine evidence only: every phase x>=1.25 (or <=0.8) within x1.8 of each other"),
    CauseRule("queueing", "(by queue rule)", QUEUEING,
              ("kv_exhausted_frac", "seqs_capped_frac", "budget_capped_frac", "prefix_hit_rate", "slowdown"),
              lambda q: q.layer == "engine.queue" or not q.c.workload_changed, lambda q: dispatch(QUEUE_RULES, q),
              "requests queued: QUEUE_RULES"),
    CauseRule("idle_workload", WORKLOAD, frozenset({IDLE}), (), _always,
              _fixed(WORKLOAD, "the engine sat idle waiting for requests: the offered load changed"),
              "the engine idle with the workload changed"),
    CauseRule("model_time", "(by forward rule)", frozenset({"model.forward"}),
              ("forward_fit", "layer_rows", "kernel_summary", "sample_s", "batch_overlap", "prefix_hit_rate"),
              _always, lambda q: q.c.forward(q.delta_s, q.from_slowdown),
              "model time: sampler, batch composition, one layer row, kernels or launch gaps (Causes.forward)"),
    CauseRule("preemption", "engine.kv", frozenset({"engine.kv"}), ("kv_exhausted_frac", "num_preemptions"), _always,
              lambda q: [Part("engine.kv", q.delta_s, "time lost to preemption (waiting preempted, recomputing)",
                              q.c.kv_evidence())], "time booked to preemption"),
    CauseRule("gateway_admission", "gateway.queue", frozenset({"gateway.queue"}), ("gateway.queue",), _always,
              lambda q: [Part("gateway.queue", q.delta_s, "requests wait longer for admission at the gateway",
                              [f"gateway.queue {q.c.req_p50('gateway.queue')}"])], "time in the gateway's queue"),
    CauseRule("handoff_waits_for_step", "(by phase)", frozenset({"gateway.route"}), ("slowdown",),
              lambda q: q.c.slowdown(q.s) >= 0.1 and not q.from_slowdown,
              lambda q: q.c.slowdown_parts(q.delta_s, "requests wait longer for the replica's step in progress "
                                                      "before the engine takes them"),
              "a replica reads new requests between steps: the hand-off waits for slower steps (>= 10%)"),
    CauseRule("handoff", "gateway.route", frozenset({"gateway.route"}), ("gateway.route", "replica_share_max"), _always,
              lambda q: [Part("gateway.route", q.delta_s, "the router decision / hand-off to the replica got slower",
                              [f"gateway.route {q.c.req_p50('gateway.route')}"] + q.c.router_evidence())],
              "time in routing and the hand-off"),
    CauseRule("more_steps", "(by config / kv / workload)", frozenset({"engine.schedule", "engine.output"}),
              ("steps_per_request", "prefill_chunks_per_request", "recomputed_token_frac"),
              lambda q: not q.from_slowdown, lambda q: q.c.more_steps(q.delta_s, q.layer),
              "requests took part in >= 20% more steps while the phase per step did not move 10%"),
    CauseRule("steps_per_work", "(by batch rule)", frozenset({"engine.schedule", "engine.output"}), ("phase",),
              lambda q: not q.from_slowdown and not q.s * q.c.phase[q.layer] >= 0.1 * q.c.expected[PHASE_OF[q.layer]],
              lambda q: q.c.steps_per_work(q.delta_s, q.layer, q.metric),
              "the phase moved per request or per token but not per step at equal batch size: the batches"),
    CauseRule("host_time", "engine.schedule", frozenset({"engine.schedule"}), ("phase", "host_share"), _always,
              lambda q: [Part("engine.schedule", q.delta_s, "host time per step (scheduling, input preparation) grew",
                              q.c.phase_evidence("engine.schedule") + [q.c.host_share_text()])],
              "host time per step at equal batch size moved"),
    CauseRule("collectives", "parallel.collective", frozenset({"parallel.collective"}),
              ("collective_s_mean", "collective_ranks"), _always,
              lambda q: [Part("parallel.collective", q.delta_s, "tensor-parallel collectives got slower",
                              q.c.collective_evidence())], "collective time per step (and a slow rank's skew)"),
    CauseRule("output_time", "engine.output", frozenset({"engine.output"}), ("phase",), _always,
              lambda q: [Part("engine.output", q.delta_s, "output processing / streaming back got slower",
                              q.c.phase_evidence("engine.output"))], "output phase per step at equal batch size moved"),
)


# ---- queueing: requests waited in the engine's queue (or the engine sat idle) ---------------------------
def _where(q: Ask) -> str:
    return "in the engine's waiting queue" if q.layer == "engine.queue" else "with the engine idle"


def _kv_keys(q: Ask) -> bool:
    return bool({"num_kv_blocks", "block_size", "kv_cache_memory_bytes", "resolved.num_kv_blocks"} & q.c.keys)


QUEUE_RULES: tuple[CauseRule, ...] = (
    CauseRule("kv_exhausted", "engine.kv", QUEUEING, ("kv_exhausted_frac", "num_preemptions", "slowdown"),
              lambda q: q.c.kv_worse(q.s) and (_kv_keys(q) or q.c.slowdown(q.s) < 0.1),
              lambda q: [Part("engine.kv", q.delta_s, f"KV cache exhausted: requests wait {_where(q)} for free blocks "
                              "and get preempted", q.c.kv_evidence())],
              "free KV blocks at 0 on >= 5 points more steps, or preemptions > 2x + 5; a KV key changed or steps "
              "< 10% slower"),
    CauseRule("prefix_lost_routing", "gateway.route", QUEUEING, ("prefix_hit_rate", "cached_token_frac"),
              lambda q: q.c.prefix_lost(q.s) and "router_policy" in q.c.keys,
              lambda q: [Part("gateway.route", q.delta_s, "prefix-cache hits dropped with the routing (router_policy "
                              "changed), so requests wait longer for the busier engine",
                              q.c.prefix_evidence() + q.c.router_evidence())],
              "prefix hits down 10 points (or the uncached share up 10%) with >= 10% more prefill, router changed"),
    CauseRule("prefix_lost", "engine.kv", QUEUEING, ("prefix_hit_rate", "cached_token_frac"),
              lambda q: q.c.prefix_lost(q.s),
              lambda q: [Part("engine.kv", q.delta_s, "prefix-cache hits dropped: more of each prompt is prefilled, "
                              "so requests wait longer for the busier engine", q.c.prefix_evidence())],
              "prefix hits down 10 points (or the uncached share up 10%) with >= 10% more prefill per request"),
    CauseRule("seqs_capped", "engine.queue", QUEUEING, ("seqs_capped_frac", "slowdown"),
              lambda q: q.c.capped("seqs_capped_frac", q.s) and ("max_num_seqs" in q.c.keys or q.c.slowdown(q.s) < 0.1),
              lambda q: [Part("engine.queue", q.delta_s, "admission capped by max_num_seqs: the running batch is full "
                              "while requests wait", [q.c.capped_text("seqs_capped_frac", "running = max_num_seqs "
                                                                      "with requests waiting on")])],
              "steps with running = max_num_seqs and requests waiting up >= 10 points"),
    CauseRule("budget_capped", "engine.queue", QUEUEING, ("budget_capped_frac", "slowdown"),
              lambda q: q.c.capped("budget_capped_frac", q.s) and (
                  "max_num_batched_tokens" in q.c.keys or q.c.slowdown(q.s) < 0.1),
              lambda q: [Part("engine.queue", q.delta_s, "admission capped by the token budget (max_num_batched_tokens)",
                              [q.c.capped_text("budget_capped_frac", "steps at the token budget with requests "
                                                                     "waiting")])],
              "steps at the token budget with requests waiting up >= 10 points"),
    CauseRule("load_changed", WORKLOAD, QUEUEING, ("workload_diff",), lambda q: q.c.workload_changed,
              lambda q: [Part(WORKLOAD, q.delta_s, f"the offered load changed; requests wait {_where(q)}")],
              "the workload differs materially"),
    CauseRule("slower_steps", "(by phase)", QUEUEING, ("phase", "slowdown"), lambda q: q.c.slowdown(q.s) >= 0.1,
              lambda q: q.c.slowdown_parts(q.delta_s, f"requests queue longer {_where(q)}"),
              "the step phases at equal batch size moved by >= 10% of a step: split over them"),
    CauseRule("unexplained_wait", "engine.queue", QUEUEING, ("waiting_frac",), _always,
              lambda q: [Part("engine.queue" if q.layer == "engine.queue" else WORKLOAD, q.delta_s,
                              f"requests wait longer {_where(q)} with no capacity limit or slower step to explain it",
                              [q.c.waiting_text()])],
              "nothing above: the wait itself"),
)


# ---- model time: the forward (and the sampler booked with it) ------------------------------------------
def _across(q: Ask) -> list[Part]:
    ia, ib = q.c.ia, q.c.ib
    return [Part(FORWARD, q.delta_s, "model forward time grew across the model",
                 [f"forward per step {_ms(ia['forward_s_mean'])} -> {_ms(ib['forward_s_mean'])}"])]


def _ms(x: float) -> str:
    return "n/a" if x is None or x != x else (f"{x * 1e3:.3g} ms" if abs(x) < 1 else f"{x:.3g} s")


FORWARD_RULES: tuple[CauseRule, ...] = (
    CauseRule("sampler", FORWARD, frozenset({FORWARD}), ("sample_s", "num_decode_seqs", "num_prefill_seqs"),
              _always, lambda q: q.c.sampler_parts(q.delta_s),
              "sampling time per sampled row moved >= 25% and by >= 10% of a step"),
    CauseRule("batch_composition", "(by composition rule)", frozenset({FORWARD}),
              ("forward_fit", "prefix_hit_rate", "batch_overlap", "config keys"),
              lambda q: q.c.forward_from_batches(q.s), lambda q: q.c.composition_parts(q.delta_s, q.from_slowdown),
              "forward per step at equal batch size moved < 10%, prefix hits dropped, or a batch-shaping key "
              "changed with batch overlap < 0.5: the batches (prefix cache, recomputation, config, workload)"),
    CauseRule("one_row", FORWARD, frozenset({FORWARD}), ("layer_rows",), _always, lambda q: q.c.one_row(q.delta_s),
              "one layer row moved >= 30% of the total and of itself, 3x its siblings (seconds or factor)"),
    CauseRule("kernels", "kernel.compute | kernel.launch_gap", frozenset({FORWARD}),
              ("kernel_summary", "kernel_op_deltas"), _always, lambda q: q.c.kernel_parts(q.delta_s),
              "profiler windows in both runs: gaps vs compute, fixed time per op vs a common factor"),
    CauseRule("forward_fit", "kernel.compute | kernel.launch_gap", frozenset({FORWARD}), ("forward_fit",), _always,
              lambda q: q.c.fit_parts(q.delta_s),
              "no profiler windows: fixed cost per forward vs cost per token from the line on batch tokens"),
    CauseRule("across_model", FORWARD, frozenset({FORWARD}), ("forward_s_mean",), _always, _across,
              "nothing above: forward time as a whole"),
)


def table() -> list[dict[str, str]]:
    """Both tables as rows (name, layer, measured, reads, when) for docs/diagnose.md and the TUI."""
    return [{"table": t, "rule": r.name, "layer": r.layer, "measured": ", ".join(sorted(r.measured)) or "any",
             "reads": ", ".join(r.reads), "when": r.text}
            for t, rules in (("RULES", RULES), ("QUEUE_RULES", QUEUE_RULES), ("FORWARD_RULES", FORWARD_RULES))
            for r in rules]
