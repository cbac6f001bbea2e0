"""What a replay is made of, read from a run bundle: the workload (arrival trace, lengths, prefix
structure), the settings (config), the KV pool, the front end's fixed latencies, and the step-cost
model (``cost.py``). Each is one component of a counterfactual split (``split.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerscope.probes import schema
from layerscope.probes.reader import Bundle, read_bundle
from layerscope.replay.cost import CostModel, fit_cost

HASH_TOKENS = schema.PREFIX_HASH_TOKENS
UNKNOWN_LEN = 1 << 30  # a context limit the run did not record (its KV pool capped it)
_REQ_COLUMNS = ["request_id", "replica", "status", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens",
                "num_preemptions", "gateway_arrival_ns", "gateway_admitted_ns", "engine_arrival_ns",
                "engine_first_token_ns", "engine_finished_ns", "gateway_first_token_ns", "gateway_finished_ns",
                "ttft_s", "tpot_s", "e2e_s", "itl_mean_s"]


@dataclass
class Workload:
    """The offered load: per request, its gateway arrival (s from the first), prompt and output
    lengths, the replica it went to and its prompt's chained block hashes (None: not recorded)."""

    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    replica: np.ndarray
    hashes: list[list[int]] | None
    cached_len: np.ndarray  # measured prefix hits: the prefix structure when hashes were not recorded

    def __len__(self) -> int:
        return len(self.arrival_s)

    def scaled(self, rate_factor: float) -> "Workload":
        """The same requests arriving ``rate_factor`` times as fast."""
        if not rate_factor > 0:
            raise ValueError(f"--rate takes a factor > 0 (x2 = twice the arrivals per second), got {rate_factor}")
        return dataclasses.replace(self, arrival_s=self.arrival_s / rate_factor)


@dataclass(frozen=True)
class Settings:
    """The config keys the replay acts on (the rest do not change scheduling)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    block_size: int
    max_model_len: int
    max_concurrency: int
    max_queue: int
    replicas: int

    KEYS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
            "block_size", "max_model_len", "gateway.max_concurrency", "gateway.max_queue")

    def set(self, key: str, value: Any) -> "Settings":
        """A copy with ``key`` (a --set key) set; an unknown key is an error naming the known ones."""
        name = key.removeprefix("gateway.")
        if key not in self.KEYS and key != "num_kv_blocks":
            raise ValueError(f"replay cannot change {key!r}; it replays: {', '.join(self.KEYS + ('num_kv_blocks',))}")
        cur = getattr(self, name)
        if isinstance(cur, bool):
            v = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
        else:
            try:
                v = int(value)
            except ValueError:
                raise ValueError(f"{key} takes an integer, got {value!r}") from None
            if v < 1:
                raise ValueError(f"{key} must be >= 1, got {v}")
        return dataclasses.replace(self, **{name: v})


@dataclass(frozen=True)
class Front:
    """Latencies outside the engine's steps, as the run's own per-request samples: the admission
    path's delay, the hand-off to a replica, the first and the last token's way back to the gateway
    (columns of ``samples``). A replay gives each request one run request's row (seeded): a stall on a
    shared machine hits a request's hand-off and its output alike, so they go together. (Drawn by
    arrival time they would count a busy spell twice: the steps' residuals already carry it.)"""

    samples: np.ndarray = field(default_factory=lambda: np.zeros((1, 4)))

    def medians(self) -> tuple[float, float, float]:
        m = np.median(self.samples, axis=0)
        return float(m[0]), float(m[1]), float(m[2])


@dataclass
class Inputs:
    """Everything a replay needs; ``measured`` holds the run's own figures to compare against."""

    name: str
    workload: Workload
    settings: Settings
    num_kv_blocks: int
    front: Front
    cost: CostModel
    measured: dict[str, Any]
    tp_size: int = 1
    notes: tuple[str, ...] = ()


def _resolved(manifest: dict[str, Any]) -> dict[str, Any]:
    r = manifest.get("resolved") or {}
    return r[0] if isinstance(r, list) and r else r if isinstance(r, dict) else {}


def _settings(manifest: dict[str, Any], replicas: int) -> tuple[Settings, int]:
    c, res = manifest.get("config") or {}, _resolved(manifest)
    gw = c.get("gateway") or {}
    s = Settings(
        max_num_seqs=int(c.get("max_num_seqs", 64)), max_num_batched_tokens=int(c.get("max_num_batched_tokens", 2048)),
        enable_chunked_prefill=bool(c.get("enable_chunked_prefill", True)),
        enable_prefix_caching=bool(c.get("enable_prefix_caching", True)),
        block_size=int(res.get("block_size") or c.get("block_size", 16)),
        max_model_len=_max_len(c, res),
        max_concurrency=int(gw.get("max_concurrency", 1 << 30)), max_queue=int(gw.get("max_queue", 1 << 30)),
        replicas=max(replicas, 1))
    return s, int(res.get("num_kv_blocks") or c.get("num_kv_blocks") or 1 << 20)


def _max_len(c: dict[str, Any], res: dict[str, Any]) -> int:
    """The context limit before the KV pool's cap (the replay applies the pool's own cap)."""
    got = int(res.get("max_model_len") or 0)
    pool = int(res.get("num_kv_blocks") or 0) * int(res.get("block_size") or c.get("block_size", 16))
    if got and got == pool and not c.get("max_model_len"):
        return UNKNOWN_LEN  # capped by the pool: the model's own limit is not recorded, and was larger
    return got or int(c.get("max_model_len") or 0) or UNKNOWN_LEN


def _median(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(np.median(a)) if len(a) else 0.0


def _idle_at(steps, replica: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Whether each request's replica ran no step at time ``t`` (its hand-off then waited on no step)."""
    out = np.ones(len(t), bool)
    for rep, st in steps.groupby("replica"):
        st = st.sort_values("start_ns")
        starts, ends = st["start_ns"].to_numpy(float), st["end_ns"].to_numpy(float)
        mine = replica == rep
        k = np.searchsorted(starts, t[mine], "right") - 1
        out[mine] = ~((k >= 0) & (ends[np.maximum(k, 0)] > t[mine]))
    return out


def _front(r, max_concurrency: int, steps) -> Front:
    ns = {c: r[c].to_numpy(float) for c in ("gateway_arrival_ns", "gateway_admitted_ns", "engine_arrival_ns",
                                            "gateway_first_token_ns", "engine_first_token_ns",
                                            "gateway_finished_ns", "engine_finished_ns")}
    g, adm = ns["gateway_arrival_ns"], ns["gateway_admitted_ns"]
    adm = np.where(np.isfinite(adm), adm, g)  # no gateway (offline): no admission, no hand-off
    g = np.where(np.isfinite(g), g, ns["engine_arrival_ns"])
    # a request that found fewer than max_concurrency in flight waited only on the admission path
    done = np.where(np.isfinite(ns["gateway_finished_ns"]), ns["gateway_finished_ns"], np.inf)
    in_flight = np.searchsorted(np.sort(adm), g, "right") - np.searchsorted(np.sort(done), g, "right")
    wait = np.where(in_flight < max_concurrency, (adm - g) / 1e9, np.nan)
    # the engine stamps a request's arrival when its loop takes it in, between steps: a hand-off
    # while a step ran waited for that step, which the replay's own steps account for
    idle = _idle_at(steps, np.nan_to_num(r["replica"].to_numpy(float)).astype(np.int64), adm)
    route = (ns["engine_arrival_ns"] - adm) / 1e9
    if idle.sum() < 5:
        route = np.minimum(route, np.nanpercentile(route, 25)) if np.isfinite(route).any() else route
        idle[:] = True
    # only the hand-off of a request whose replica was busy is unknown (its row's median below): the
    # row itself stays, so the other columns keep every request (idle-at-admission rows are a biased few)
    route = np.where(idle, route, np.nan)
    out_first = (ns["gateway_first_token_ns"] - ns["engine_first_token_ns"]) / 1e9
    out_last = (ns["gateway_finished_ns"] - ns["engine_finished_ns"]) / 1e9
    cols = []
    for a in (wait, route, out_first, out_last):
        a = np.where(np.isfinite(a), np.maximum(a, 0.0), np.nan)
        cols.append(np.where(np.isfinite(a), a, np.nanmedian(a) if np.isfinite(a).any() else 0.0))
    sam = np.column_stack(cols)
    return Front(samples=sam) if len(sam) else Front()


def load_inputs(path: str, bundle: Bundle | None = None) -> Inputs:
    """The replay inputs of the run bundle at ``path`` (a BundleError names what is wrong)."""
    b = bundle or read_bundle(path)
    m = b.manifest
    cols = _REQ_COLUMNS + (["prompt_block_hashes"] if "prompt_block_hashes" in schema.REQUESTS.names else [])
    r = b.df("requests", columns=cols)
    ok = r["status"].astype(str).str.startswith("finished") & r["num_prompt_tokens"].notna()
    rejected = int((r["status"] == "rejected").sum())
    r = r[ok].reset_index(drop=True)
    if not len(r):
        raise ValueError(f"{path}: no finished requests to replay ({len(ok)} rows, {rejected} rejected)")
    g = r["gateway_arrival_ns"].to_numpy(float)
    arr = np.where(np.isfinite(g), g, r["engine_arrival_ns"].to_numpy(float))
    order = np.argsort(arr, kind="stable")
    r = r.iloc[order].reset_index(drop=True)
    arr = arr[order]
    hashes, notes = None, []
    if "prompt_block_hashes" in r and r["prompt_block_hashes"].notna().all():
        hashes = [list(h) for h in r["prompt_block_hashes"]]
    else:
        notes.append("prompt block hashes not recorded: prefix sharing approximated from measured cache hits")
    wl = Workload(arrival_s=(arr - arr[0]) / 1e9, prompt_len=r["num_prompt_tokens"].to_numpy(np.int64),
                  output_len=np.maximum(r["num_output_tokens"].to_numpy(np.int64), 1),
                  replica=np.nan_to_num(r["replica"].to_numpy(float)).astype(np.int64), hashes=hashes,
                  cached_len=np.nan_to_num(r["num_cached_tokens"].to_numpy(float)).astype(np.int64))
    replicas = len((m.get("summary") or {}).get("replicas") or []) or int(wl.replica.max()) + 1
    settings, kv = _settings(m, replicas)
    steps = b.df("steps", columns=["step_id", "replica", "start_ns", "end_ns", "step_s", "num_prefill_tokens",
                                   "num_decode_seqs", "num_running", "num_waiting", "collective_s", "wait_ns",
                                   "request_ids", "request_num_tokens", "num_prefix_hits", "num_prefix_queries"])
    cached = dict(zip(r["request_id"], np.nan_to_num(r["num_cached_tokens"].to_numpy(float)).astype(int)))
    cost = fit_cost(steps, origin_ns=float(arr[0]), cached=cached)
    measured = measured_figures(r, steps, rejected)
    return Inputs(name=m.get("run_id") or str(path), workload=wl, settings=settings, num_kv_blocks=kv,
                  front=_front(r, settings.max_concurrency, steps), cost=cost, measured=measured,
                  tp_size=int((m.get("config") or {}).get("tp_size", 1) or 1), notes=tuple(notes))


def measured_figures(r, steps, rejected: int) -> dict[str, Any]:
    """The run's own figures in the replay's terms (``metrics.figures``' keys)."""
    from layerscope.replay.metrics import figures

    hits = float(np.nansum(steps["num_prefix_hits"].to_numpy(float))) if len(steps) else 0.0
    queries = float(np.nansum(steps["num_prefix_queries"].to_numpy(float))) if len(steps) else 0.0
    return figures(ttft=r["ttft_s"].to_numpy(float), tpot=r["tpot_s"].to_numpy(float), e2e=r["e2e_s"].to_numpy(float),
                   itl=r["itl_mean_s"].to_numpy(float), waiting=steps["num_waiting"].to_numpy(float),
                   preemptions=int(np.nansum(r["num_preemptions"].to_numpy(float))),
                   prefix_hit_rate=hits / queries if queries else 0.0, rejected=rejected, num_steps=len(steps))
