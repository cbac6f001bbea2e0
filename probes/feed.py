"""MetricsFeed: puts what a ProbeRecorder recorded into its Prometheus metrics, in batches.

The step loop touching a dozen histograms once per step (cold in cache after the
forward pass) cost more than the rest of the recorder, so steps and finished
requests are fed every ``every_steps`` steps, when the engine goes idle, and before
any scrape (a collector registered first in the registry flushes). Flushes come
from the step loop and from scrape threads, hence the lock. A flush does one bulk
update per histogram: step columns read with one ``itemgetter`` per step, buckets
counted by numpy, the inter-token gaps of every finished request at once (each step's token
time kept in one array as the steps are fed, so a gap is two array reads).
"""

from __future__ import annotations

import threading
from collections import deque
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
from prometheus_client import CollectorRegistry

from layerscope.contract import FINISH_REASON, tpot_s
from layerscope.engine.recorder import StepRecord
from layerscope.probes.metrics import STEP_PHASES, MetricSet, histogram_parts, observe_many
from layerscope.probes.requests import first_timestamps

if TYPE_CHECKING:
    from layerscope.engine.recorder import CollectiveRecord
    from layerscope.probes.drain import ReplicaDrain


class Recorded(NamedTuple):
    """What a recorder recorded after a point: the feed's view of it."""

    steps: "list[StepRecord]"
    num_sampled: int  # output tokens sampled in those steps
    layer_times: list[tuple[int, list[tuple[str, int]]]]  # (step_id, [(row, ns), ...]) per timed step


class RecordSource(Protocol):
    """What the feed reads of its recorder (``ProbeRecorder``)."""

    num_steps: int

    def recorded_since(self, num_steps: int, num_layer_samples: int) -> Recorded: ...

    def gateway_fields(self, request_id: str) -> dict[str, Any] | None: ...

    def index_requests(self) -> None:
        """Fill finished requests' ``step_idx`` / ``sampled_idx`` up to the last recorded step."""

_PHASE_NS = tuple(f"{p}_ns" for p in STEP_PHASES)  # StepRecord fields, in STEP_PHASES order
_OUTPUT = _PHASE_NS.index("output_ns")
_COLUMN_FIELDS = (*_PHASE_NS, "num_prefill_tokens", "num_decode_tokens", "num_prefix_queries", "num_prefix_hits",
                  "num_preemptions", "end_ns")  # end_ns last: _steps reads cols[:, -1]
_STEP_COLUMNS = itemgetter(*map(StepRecord._fields.index, _COLUMN_FIELDS))
_NUM_COLUMNS = len(_COLUMN_FIELDS)
_REQUEST_HISTOGRAMS = {
    "queue": "layerscope_request_queue_time_seconds",
    "ttft": "layerscope_time_to_first_token_seconds",
    "prefill": "layerscope_request_prefill_time_seconds",
    "e2e": "layerscope_e2e_request_latency_seconds",
    "decode": "layerscope_request_decode_time_seconds",
    "tpot": "layerscope_time_per_output_token_seconds",
    "itl": "layerscope_inter_token_latency_seconds",
}


def observe_array(child, values: np.ndarray) -> None:
    """``metrics.observe_many`` for a numpy array (the feed's bulk updates: batch sizes, inter-token gaps,
    request latencies)."""
    observe_columns([child], values.reshape(-1, 1))


def observe_columns(children: list, values: np.ndarray) -> None:
    """``metrics.observe_many`` of column j of ``values`` ([n, k]) into ``children[j]``, for k children
    of one histogram family (the step phases): the same buckets (first bound >= value), searched and
    counted by numpy in one pass for all of them."""
    parts = [histogram_parts(c) for c in children]
    bounds = parts[0][0] if parts[0] is not None else None
    if bounds is None or any(p is None or p[0] != bounds for p in parts):
        for j, child in enumerate(children):
            observe_many(child, values[:, j].tolist())
        return
    nb = len(bounds)
    idx = np.searchsorted(np.asarray(bounds, dtype=np.float64), values, side="left")
    idx += np.arange(len(children)) * nb  # column j's buckets at j * nb
    counts = np.bincount(idx.ravel(), minlength=nb * len(children))
    for (_, _, total), value in zip(parts, values.sum(axis=0).tolist()):
        if value:
            total.inc(value)
    for i in np.flatnonzero(counts).tolist():
        parts[i // nb][1][i % nb].inc(int(counts[i]))


class _FlushOnCollect:
    """Registered first in the recorder's registry: a scrape flushes the pending steps first."""

    def __init__(self, feed: "MetricsFeed", recorder: RecordSource):
        self.feed, self.recorder = feed, recorder

    def describe(self):
        return []

    def collect(self):
        self.feed.flush(self.recorder)
        return []


class MetricsFeed:
    def __init__(self, registry: CollectorRegistry | None, model_name: str, replica: str | int, every_steps: int,
                 recorder: RecordSource | None, lock: "threading.RLock | None" = None):
        """``recorder``: the recorder this feed reads in its process (flushed before any scrape); None for
        a feed of another process's drains (``feed_drain``: a gateway's feed of a replica)."""
        registry = registry if registry is not None else CollectorRegistry()
        if recorder is not None:
            registry.register(_FlushOnCollect(self, recorder))
        self.metrics = m = MetricSet(registry, model_name, replica, scope="replica")
        self.every_steps = max(1, every_steps)
        self._flushed = 0  # steps already fed
        # each fed step's token time (the end of its sampling): _tok_ns[:_tok_len], grown by doubling
        self._tok_ns = np.empty(1024, dtype=np.int64)
        self._tok_len = 0
        self._tok_base = 0  # the recorded step index of _tok_ns[0] (drop_steps_before moves it)
        self._layers_flushed = 0
        self._pending: deque = deque()  # finished requests (appended by the engine thread)
        self._lock = lock if lock is not None else threading.RLock()  # the recorder's, which cuts its steps
        self._phase = [m.child("layerscope_step_phase_seconds", p) for p in STEP_PHASES]
        self._batch = m.child("layerscope_batch_tokens")
        self._running = m.child("layerscope_num_requests_running")
        self._waiting = m.child("layerscope_num_requests_waiting")
        self._kv = m.child("layerscope_kv_cache_usage_perc")
        self._queries = m.child("layerscope_prefix_cache_queries_total")
        self._hits = m.child("layerscope_prefix_cache_hits_total")
        self._preempt = m.child("layerscope_num_preemptions_total")
        self._gen = m.child("layerscope_generation_tokens_total")
        self._prompt = m.child("layerscope_prompt_tokens_total")
        self._req = {k: m.child(name) for k, name in _REQUEST_HISTOGRAMS.items()}
        self._layer: dict[str, Any] = {}

    # ---- called by the recorder ----
    def step_recorded(self, num_steps: int, idle: bool, recorder: RecordSource) -> None:
        if idle or num_steps - self._flushed >= self.every_steps:
            self.flush(recorder)

    def request_finished(self, st, idle: bool, recorder: RecordSource) -> None:
        self._pending.append(st)
        if idle:  # the engine has nothing left: publish now, it may stay idle
            self.flush(recorder)

    def collectives(self, records: "list[CollectiveRecord]") -> None:
        m = self.metrics
        for r in records:
            m.child("layerscope_collective_seconds", r.op).observe(r.duration_ns * 1e-9)
            m.child("layerscope_collective_wait_seconds").observe(r.wait_ns * 1e-9)

    def engine_state(self, stats) -> None:
        """Set the engine gauges from ``LLMEngine.stats()`` (the state now)."""
        with self._lock:  # after any step fed meanwhile, which sets them from its last step
            self._running.set(stats["num_running"])
            self._waiting.set(stats["num_waiting"])
            self._kv.set(stats["kv_cache_usage"])

    def launch_gap_ratio(self, ratio: float) -> None:
        self.metrics.child("layerscope_launch_gap_ratio").set(ratio)

    def flush(self, recorder: RecordSource) -> None:
        """Feed the recorder's steps, layer times and finished requests recorded since the last flush."""
        with self._lock:
            finished = []
            while self._pending:
                finished.append(self._pending.popleft())
            # steps first: the finished requests' inter-token gaps read the steps' token times
            if self._flushed < recorder.num_steps:
                self._steps(recorder.recorded_since(self._flushed, self._layers_flushed))
            if finished:
                recorder.index_requests()
                get = recorder.gateway_fields
                self._requests([(st.rid, st.info, st.events, st.sampled_idx, get(st.rid)) for st in finished],
                               self._tok_ns, self._tok_base)

    def feed_drain(self, d: "ReplicaDrain") -> None:
        """Feed a replica's ``drain()`` (another process's: ``ProbeRecorder(ship_records=True)``): its new
        steps and layer times, its finished requests (their inter-token gaps from the drain's steps, which
        hold every step of each), its collectives and launch-gap ratio. Drains of one replica in order."""
        from layerscope.probes.drain import unpack_drain

        u = unpack_drain(d)
        with self._lock:
            new = u.steps[u.new_from:]
            if new:
                self._steps(Recorded(new, sum(len(s.sampled_ids) for s in new), d.layer_times), keep_tokens=False)
            if u.requests:
                cols = np.fromiter(chain.from_iterable((s.end_ns, s.output_ns) for s in u.steps), dtype=np.int64,
                                   count=2 * len(u.steps)).reshape(-1, 2)
                self._requests([(rid, info, evs, sampled, outer) for rid, info, evs, _, sampled, outer, _ in u.requests],
                               cols[:, 0] - cols[:, 1], 0)
            if d.collectives:
                self.collectives(d.collectives)
            if d.launch_gap_ratio is not None:
                self.launch_gap_ratio(d.launch_gap_ratio)

    def drop_steps_before(self, index: int) -> None:
        """The recorder dropped its steps before recorded index ``index`` (a drain): no request still to
        be fed took part in them, so their token times go too. Call with the lock held, after a flush."""
        cut = min(index - self._tok_base, self._tok_len)
        if cut > 0:
            self._tok_ns = self._tok_ns[cut:]  # a view: the next growth copies only what is kept
            self._tok_len -= cut
            self._tok_base += cut

    def _add_token_times(self, t: np.ndarray) -> None:
        n = self._tok_len + len(t)
        if n > len(self._tok_ns):
            buf = np.empty(max(n, 2 * len(self._tok_ns)), dtype=np.int64)
            buf[:self._tok_len] = self._tok_ns[:self._tok_len]
            self._tok_ns = buf
        self._tok_ns[self._tok_len:n] = t
        self._tok_len = n

    # ---- feeding ----
    def _steps(self, new: Recorded, keep_tokens: bool = True) -> None:
        steps, sampled = new.steps, new.num_sampled
        self._flushed += len(steps)
        # one [steps, columns] array (attribute reads in C), then one bulk update per histogram
        cols = np.fromiter(chain.from_iterable(map(_STEP_COLUMNS, steps)), dtype=np.int64,
                           count=len(steps) * _NUM_COLUMNS).reshape(len(steps), _NUM_COLUMNS)
        k = len(_PHASE_NS)
        observe_columns(self._phase, cols[:, :k] * 1e-9)
        # a token's time: the end of its step's sampling phase (the step's end minus its output phase)
        if keep_tokens:
            self._add_token_times(cols[:, -1] - cols[:, _OUTPUT])  # end_ns is the last column
        observe_array(self._batch, (cols[:, k] + cols[:, k + 1]).astype(np.float64))
        queries, hits, preempt = (int(v) for v in cols[:, k + 2:k + 5].sum(axis=0))
        if queries:
            self._queries.inc(queries)
            self._hits.inc(hits)
        if preempt:
            self._preempt.inc(preempt)
        if sampled:
            self._gen.inc(sampled)
        last = steps[-1]
        self._running.set(last.num_running)
        self._waiting.set(last.num_waiting)
        total = last.num_kv_blocks_total
        self._kv.set((total - last.num_kv_blocks_free) / total if total else 0.0)
        by_row: dict[str, list[float]] = {}
        for _, rows in new.layer_times:
            for name, ns in rows:
                by_row.setdefault(name, []).append(ns * 1e-9)
        for name, values in by_row.items():
            child = self._layer.get(name)
            if child is None:
                child = self._layer[name] = self.metrics.child("layerscope_layer_forward_seconds", name)
            observe_many(child, values)
        self._layers_flushed += len(new.layer_times)

    def _requests(self, finished: list[tuple], tok_ns: np.ndarray, tok_base: int) -> None:
        """Request-level metrics of finished requests, one bulk update per histogram: ``finished`` as
        (request id, info, events, sampled step indices, gateway fields or None); ``tok_ns[i - tok_base]``
        the token time of step index i."""
        vals: dict[str, list[float]] = {k: [] for k in _REQUEST_HISTOGRAMS if k != "itl"}
        success: dict[str, int] = {}
        prompt_tokens = 0
        itl_idx: list[int] = []  # the steps that sampled each request's 2nd..last token, requests one after another
        itl_first: list[int] = []  # each such request's first-token time (ns)
        itl_len: list[int] = []  # and how many of itl_idx are its
        for _rid, info, events, sampled_idx, outer in finished:
            ev = first_timestamps(events)
            arrival, sched, first, fin = ev.get("arrival"), ev.get("scheduled"), ev.get("first_token"), ev.get("finished")
            # server-side latencies run from the gateway arrival when the gateway told us about it
            start = outer["gateway_arrival_ns"] if outer and outer.get("gateway_arrival_ns") else arrival
            reason = FINISH_REASON.get(info["status"], "abort")
            success[reason] = success.get(reason, 0) + 1
            prompt_tokens += info["num_prompt_tokens"]
            if arrival is not None and sched is not None:
                vals["queue"].append((sched - arrival) * 1e-9)
            if first is None or start is None:
                continue
            ttft = (first - start) * 1e-9
            vals["ttft"].append(ttft)
            if sched is not None:
                vals["prefill"].append((first - sched) * 1e-9)
            if fin is None:
                continue
            e2e = (fin - start) * 1e-9
            vals["e2e"].append(e2e)
            vals["decode"].append((fin - first) * 1e-9)
            n = info["num_output_tokens"]
            if n >= 2:
                vals["tpot"].append(tpot_s(e2e, ttft, n))
                if len(sampled_idx) > 1:
                    itl_idx += sampled_idx[1:]
                    itl_first.append(first)
                    itl_len.append(len(sampled_idx) - 1)
        for key, values in vals.items():
            if values:
                observe_array(self._req[key], np.array(values, dtype=np.float64))
        if itl_idx:
            self._itl(itl_idx, itl_first, itl_len, tok_ns, tok_base)
        for reason, n in success.items():
            self.metrics.child("layerscope_request_success_total", reason).inc(n)
        if prompt_tokens:
            self._prompt.inc(prompt_tokens)

    def _itl(self, idx: list[int], first_ns: list[int], lengths: list[int], tok_ns: np.ndarray, tok_base: int) -> None:
        """Inter-token gaps of requests, from the steps that sampled their tokens: a token's time is the
        end of its step's sampling phase, the first token's its FIRST_TOKEN event; a gap below 0 counts 0."""
        t = tok_ns[np.asarray(idx, dtype=np.int64) - tok_base]
        prev = np.empty_like(t)
        prev[1:] = t[:-1]
        lens = np.asarray(lengths, dtype=np.int64)
        prev[np.cumsum(lens) - lens] = first_ns  # each request's first gap runs from its first token
        observe_array(self._req["itl"], np.maximum(t - prev, 0) * 1e-9)
