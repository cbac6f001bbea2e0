"""The per-layer breakdown of each request's time: ONE function, ``request_breakdown``.

The bundle writer calls it to store the ``ttft_*`` components of requests.parquet, and diagnose
calls it (``layerscope.diagnose.decompose``) for TTFT, E2E and TPOT; both from the same tables
(requests, steps and their memberships, spans), so the two can never disagree. Probes record
only raw events and intervals; every gap rule lives here. The rules (which interval of a
request's timeline goes to which layer, the TTFT / E2E / decode windows clipped out of it, and
how recorded TTFT components and preemptions are used) are docs/diagnose.md section 1.

All durations in seconds; vectorised over memberships (one row per request per step), so 10,000
requests take well under a second. Torch-free (numpy, pandas, pyarrow).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import pandas as pd
import pyarrow as pa

from layerscope.contract import BREAKDOWN_LAYERS, component_column
from layerscope.probes.schema import DECODE_COLUMNS, STORED_COMPONENT_COLUMNS

COMPONENTS: tuple[str, ...] = BREAKDOWN_LAYERS
_IDX = {layer: i for i, layer in enumerate(COMPONENTS)}
col = component_column
TTFT_COLUMNS = [col("ttft", layer) for layer in COMPONENTS] + ["ttft_residual_s"]
# what the writer stores per request (schema version 2): every column of request_breakdown that
# needs the steps' memberships; diagnose reads them back with ``stored_breakdown``
STORED_COLUMNS = list(STORED_COMPONENT_COLUMNS)


class Tables(Protocol):
    """What the breakdown reads: the bundle's requests, steps and spans tables as DataFrames
    (``layerscope.probes.bundle.frame``) and the steps' memberships (``memberships``)."""

    requests: pd.DataFrame
    steps: pd.DataFrame
    spans: pd.DataFrame
    memberships: pd.DataFrame


def memberships(steps: pa.Table, request_ids: np.ndarray | pd.Series) -> pd.DataFrame:
    """One row per (step, request computed in it): step_row (row in ``steps``), request_row
    (position in ``request_ids``, -1 if unknown), num_tokens. Kept in Arrow: fast for 1M rows."""
    empty = pd.DataFrame({"step_row": np.zeros(0, np.int64), "request_row": np.zeros(0, np.int64),
                          "num_tokens": np.zeros(0, np.int64)})
    if not steps.num_rows:
        return empty
    ids = steps.column("request_ids").combine_chunks()
    toks = steps.column("request_num_tokens").combine_chunks()
    step_row = np.asarray(ids.value_parent_indices().to_numpy() if len(ids) else np.zeros(0, np.int64), np.int64)
    flat_ids = ids.flatten()
    flat_toks = toks.flatten() if len(toks.flatten()) == len(flat_ids) else None
    enc = flat_ids.dictionary_encode()
    index = pd.Index(np.asarray(request_ids))
    pos = index.get_indexer(enc.dictionary.to_pandas())
    request_row = pos[enc.indices.to_numpy(zero_copy_only=False)] if len(enc.dictionary) else np.zeros(0, np.int64)
    num_tokens = flat_toks.to_numpy(zero_copy_only=False) if flat_toks is not None else np.ones(len(flat_ids), np.int64)
    return pd.DataFrame({"step_row": step_row, "request_row": request_row.astype(np.int64),
                         "num_tokens": np.asarray(num_tokens, dtype=np.int64)})


def seconds(values: pd.Series | np.ndarray, origin: float) -> np.ndarray:
    """Monotonic ns timestamps as seconds after ``origin`` (ns); NaN stays NaN."""
    return (np.asarray(values, dtype=np.float64) - origin) / 1e9


def step_frame(run: Tables) -> pd.DataFrame:
    """Steps with times in seconds from the run origin and phase boundaries.

    Columns added: t_start_s, t_end_s, b1..b5 (ends of schedule, prepare, forward,
    sample, output), collective_frac (share of forward in collectives), seq (step order
    within its replica), host_s (schedule + prepare + unaccounted remainder).
    """
    s = run.steps
    origin = origin_ns(run)
    out = pd.DataFrame(index=s.index)
    out["t_start_s"] = seconds(s["start_ns"], origin)
    phases = [np.nan_to_num(s[c].to_numpy(np.float64)) for c in ("schedule_s", "prepare_s", "forward_s", "sample_s",
                                                                   "output_s")]
    b = out["t_start_s"].to_numpy()
    for i, ph in enumerate(phases, start=1):
        b = b + ph
        out[f"b{i}"] = b
    out["t_end_s"] = np.maximum(seconds(s["end_ns"], origin), b)
    fwd = phases[2]
    coll = np.nan_to_num(s["collective_s"].to_numpy(np.float64))
    out["collective_frac"] = np.where(fwd > 0, np.clip(coll / np.where(fwd > 0, fwd, 1), 0, 1), 0.0)
    order = np.lexsort((out["t_start_s"].to_numpy(), np.nan_to_num(s["replica"].to_numpy(np.float64))))
    seq = np.empty(len(s), np.int64)
    rep = np.nan_to_num(s["replica"].to_numpy(np.float64))[order]
    first = np.r_[True, rep[1:] != rep[:-1]] if len(order) else np.zeros(0, bool)
    ranks = np.arange(len(order)) - np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    seq[order] = ranks
    out["seq"] = seq
    out["host_s"] = phases[0] + phases[1] + (out["t_end_s"].to_numpy() - b)
    return out


def origin_ns(run: Tables) -> float:
    """The run's first event (ns): earliest gateway/engine arrival or step start."""
    r = run.requests
    cands = [r[c].min() for c in ("gateway_arrival_ns", "engine_arrival_ns") if c in r and r[c].notna().any()]
    if len(run.steps):
        cands.append(run.steps["start_ns"].min())
    return float(min(cands)) if cands else 0.0


def request_breakdown(run: Tables) -> pd.DataFrame:
    """One row per request: metrics and their per-layer components (seconds).

    Columns: request_id, replica, status, num_prompt_tokens, num_cached_tokens,
    num_output_tokens, num_preemptions, arrival_s (from the run's first event), ttft_s,
    tpot_s, e2e_s, client_s (client-observed
    TTFT minus server TTFT), then for metric in ttft/e2e/tpot: one ``{metric}_{layer}_s``
    per layer in COMPONENTS and ``{metric}_residual_s``; the decode phase's composition
    (``schema.DECODE_COLUMNS``: num_decode_steps, num_mixed_steps, mean_batch_seqs, tpot_step_s,
    tpot_prefill_interference_s); ttft_recorded (bool: the TTFT components come from the requests
    table), dominant_layer (largest E2E component). ``STORED_COLUMNS`` are what a writer stores.
    """
    r = run.requests
    n = len(r)
    origin = origin_ns(run)
    gw_arr = seconds(r["gateway_arrival_ns"], origin)
    gw_adm = seconds(r["gateway_admitted_ns"], origin)
    en_arr = seconds(r["engine_arrival_ns"], origin)
    start = np.where(np.isnan(gw_arr), en_arr, gw_arr)
    ttft = r["ttft_s"].to_numpy(np.float64)
    e2e = r["e2e_s"].to_numpy(np.float64)
    first_tok_engine = seconds(r["engine_first_token_ns"], origin)
    first_tok_engine = np.where(np.isnan(first_tok_engine), start + ttft, first_tok_engine)

    mem, si, ntok, first_start, kv = _membership_arrays(run, n, origin, first_tok_engine)
    pre = dict(gw_arr=gw_arr, gw_adm=gw_adm, en_arr=en_arr, start=start, first_start=first_start, kv=kv)

    out = pd.DataFrame({
        "request_id": r["request_id"].to_numpy(), "replica": r["replica"].to_numpy(), "status": r["status"].to_numpy(),
        "num_prompt_tokens": r["num_prompt_tokens"].to_numpy(), "num_cached_tokens": r["num_cached_tokens"].to_numpy(),
        "num_output_tokens": r["num_output_tokens"].to_numpy(), "num_preemptions": r["num_preemptions"].to_numpy(),
        "arrival_s": start, "ttft_s": ttft, "tpot_s": r["tpot_s"].to_numpy(np.float64), "e2e_s": e2e,
        "client_s": r["client_ttft_s"].to_numpy(np.float64) - ttft,
    })
    # the engine's part of a window ends where the engine produced its token; what follows
    # (the token's way out through the gateway) is engine.output
    fin_engine = seconds(r["engine_finished_ns"], origin)
    ttft_c = _window(n, pre, mem, start, start + ttft, first_tok_engine)
    e2e_c = _window(n, pre, mem, start, start + e2e, fin_engine)
    decode_c = _window(n, pre, mem, start + ttft, start + e2e, fin_engine)
    rec = r.reindex(columns=TTFT_COLUMNS).to_numpy(np.float64)  # absent: none recorded
    has_rec = ~np.isnan(rec).any(axis=1)
    ttft_rows = np.c_[ttft_c, ttft - ttft_c.sum(axis=1)]
    ttft_rows[has_rec] = _with_recorded(rec[has_rec], ttft_c[has_rec])
    denom = r["num_output_tokens"].to_numpy(np.float64) - 1
    denom = np.where(denom > 0, denom, np.nan)
    tpot = r["tpot_s"].to_numpy(np.float64)
    tpot_c = decode_c / denom[:, None]
    cols = {}
    for metric, comps, resid in (("ttft", ttft_rows[:, :-1], ttft_rows[:, -1]),
                                 ("e2e", e2e_c, e2e - e2e_c.sum(axis=1)),
                                 ("tpot", tpot_c, tpot - tpot_c.sum(axis=1))):
        for j, layer in enumerate(COMPONENTS):
            cols[col(metric, layer)] = comps[:, j]
        cols[f"{metric}_residual_s"] = resid
    cols.update(_decode(run, mem, si, ntok, first_tok_engine, r["num_output_tokens"].to_numpy(np.float64), n))
    out = pd.DataFrame({**{c: out[c].to_numpy() for c in out.columns}, **cols, "ttft_recorded": has_rec}, copy=False)
    return _finish(out)


def _membership_arrays(run: Tables, n: int, origin: float, first_tok_engine: np.ndarray) -> tuple:
    """Each request's steps in time order (memberships sorted by request, then step start):
    (per-membership arrays for ``_window``, step rows, tokens, each request's first step start,
    recorded preemption intervals or None)."""
    st = step_frame(run)
    m = run.memberships
    m = m[m["request_row"].to_numpy() >= 0]
    ri = m["request_row"].to_numpy()
    si = m["step_row"].to_numpy()
    t0 = st["t_start_s"].to_numpy()[si]
    order = np.lexsort((t0, ri))
    ri, si, t0 = ri[order], si[order], t0[order]
    ntok = m["num_tokens"].to_numpy()[order]
    same_next = np.r_[ri[1:] == ri[:-1], False]
    nxt = np.minimum(np.arange(len(ri)) + 1, max(len(ri) - 1, 0))  # index of the next membership
    next_start = np.where(same_next, t0[nxt], np.inf)
    seq = st["seq"].to_numpy()[si]
    skipped = np.where(same_next, seq[nxt] - seq - 1, 0)
    recompute = (t0 >= first_tok_engine[ri]) & (ntok > 1)
    next_recompute = np.where(same_next, recompute[nxt], False)
    first_start = np.full(n, np.nan)
    if len(ri):
        firsts = np.r_[True, ri[1:] != ri[:-1]]
        first_start[ri[firsts]] = t0[firsts]
    bounds = {k: st[k].to_numpy()[si] for k in ("b1", "b2", "b3", "b4", "b5", "t_end_s")}
    cfrac = st["collective_frac"].to_numpy()[si]
    kv = _preempted_intervals(run, origin)
    if kv is not None:  # recorded preemption intervals replace the guess from recompute steps
        next_recompute = np.zeros_like(next_recompute)
    mem = dict(ri=ri, t0=t0, next_start=next_start, skipped=skipped, recompute=recompute,
               next_recompute=next_recompute, cfrac=cfrac, **bounds)
    return mem, si, ntok, first_start, kv


def _finish(out: pd.DataFrame) -> pd.DataFrame:
    # the largest E2E component, column by column (no [n, k] copy of a million rows)
    best = np.full(len(out), -np.inf)
    dom = np.zeros(len(out), np.int64)
    for j, layer in enumerate(COMPONENTS):
        v = np.nan_to_num(out[col("e2e", layer)].to_numpy(np.float64), nan=-1.0)
        better = v > best
        best = np.where(better, v, best)
        dom[better] = j
    out["dominant_layer"] = np.where(np.isnan(out["e2e_s"].to_numpy(np.float64)), None,
                                     np.asarray(COMPONENTS, dtype=object)[dom])
    return out


def _decode(run: Tables, mem: dict, si: np.ndarray, ntok: np.ndarray, first_tok: np.ndarray,
            num_output: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """The decode phase's composition per request (DECODE_COLUMNS) from its decode memberships
    (one token, at or after the engine's first token)."""
    ri = mem["ri"]
    s = run.steps
    is_decode = (mem["t0"] >= first_tok[ri]) & (ntok == 1)
    sd, rd = si[is_decode], ri[is_decode]

    def per_step(*names: str) -> np.ndarray:
        return np.nan_to_num(sum(s[c].to_numpy(np.float64) for c in names))[sd]

    step_s, ptok, btok = per_step("step_s"), per_step("num_prefill_tokens"), per_step("num_batched_tokens")
    seqs = per_step("num_prefill_seqs", "num_decode_seqs")
    cnt = np.bincount(rd, minlength=n).astype(float)
    denom = np.where(num_output > 1, num_output - 1, np.nan)
    share = np.where(btok > 0, ptok / np.where(btok > 0, btok, 1), 0)
    return {
        "num_decode_steps": cnt.astype(np.int64),
        "num_mixed_steps": np.bincount(rd, weights=(ptok > 0).astype(float), minlength=n).astype(np.int64),
        "mean_batch_seqs": np.bincount(rd, weights=seqs, minlength=n) / np.where(cnt > 0, cnt, np.nan),
        "tpot_step_s": np.bincount(rd, weights=step_s, minlength=n) / denom,
        "tpot_prefill_interference_s": np.bincount(rd, weights=step_s * share, minlength=n) / denom,
    }


def has_stored(requests: pd.DataFrame) -> bool:
    """Whether ``requests`` carries every stored component (STORED_COLUMNS) for every request
    with an E2E: a bundle of schema version 2 whose writer computed them (only the stored columns
    present in ``requests`` are checked: a reader may check a few)."""
    always = [col("e2e", layer) for layer in COMPONENTS] + ["e2e_residual_s", *DECODE_COLUMNS[:2]]
    cols = [c for c in always if c in requests]  # defined for every request with an E2E
    if not cols or "e2e_s" not in requests:
        return False
    e2e = requests["e2e_s"].notna().to_numpy()
    return bool(e2e.any()) and not requests.loc[e2e, cols].isna().any().any()


def stored_breakdown(run: Tables) -> pd.DataFrame:
    """``request_breakdown``'s frame from the components the writer stored (``has_stored``): the
    same columns, read instead of derived, so no step memberships are needed."""
    r = run.requests
    origin = origin_ns(run)
    gw, en = r["gateway_arrival_ns"].to_numpy(np.float64), r["engine_arrival_ns"].to_numpy(np.float64)
    ttft = r["ttft_s"].to_numpy(np.float64)
    out = {c: r[c].to_numpy() for c in ("request_id", "replica", "status", "num_prompt_tokens", "num_cached_tokens",
                                         "num_output_tokens", "num_preemptions")}
    out.update({"arrival_s": seconds(np.where(np.isnan(gw), en, gw), origin), "ttft_s": ttft,
                "tpot_s": r["tpot_s"].to_numpy(np.float64), "e2e_s": r["e2e_s"].to_numpy(np.float64),
                "client_s": r["client_ttft_s"].to_numpy(np.float64) - ttft})
    for c in STORED_COLUMNS:
        out[c] = r[c].to_numpy(np.float64) if c not in DECODE_COLUMNS[:2] else \
            np.nan_to_num(r[c].to_numpy(np.float64)).astype(np.int64)
    recorded = np.ones(len(r), bool)
    for c in TTFT_COLUMNS:
        recorded &= ~np.isnan(out[c])
    out["ttft_recorded"] = recorded
    return _finish(pd.DataFrame(out, copy=False))


def _with_recorded(rec: np.ndarray, derived: np.ndarray) -> np.ndarray:
    """Recorded TTFT components [n, k + 1] (last column: residual), with the recorded residual
    (host time between the phases the engine times, loop gaps) handed to the layers the
    timeline puts more time in than was recorded; DESIGN.md counts host time per step as
    engine.schedule, so the decomposition covers all of TTFT when the timeline does."""
    out = rec.copy()
    resid = np.clip(rec[:, -1], 0.0, None)
    excess = np.clip(derived - rec[:, :-1], 0.0, None)
    tot = excess.sum(axis=1)
    give = np.where(tot > 0, np.minimum(resid, tot), 0.0)
    share = np.divide(excess, tot[:, None], out=np.zeros_like(excess), where=tot[:, None] > 0)
    out[:, :-1] += share * give[:, None]
    out[:, -1] -= give
    return out


def _preempted_intervals(run: Tables, origin: float) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(request_row, start_s, end_s) of every recorded preemption (``engine.kv`` spans), or None."""
    sp = run.spans
    if sp.empty:
        return None
    kv = sp[(sp["layer"] == "engine.kv") & sp["request_id"].notna()]
    if kv.empty:
        return None
    rows = pd.Index(run.requests["request_id"]).get_indexer(kv["request_id"])
    ok = rows >= 0
    return rows[ok], seconds(kv["start_ns"], origin)[ok], seconds(kv["end_ns"], origin)[ok]


def _ov(x0, x1, lo, hi):
    return np.nan_to_num(np.clip(np.minimum(x1, hi) - np.maximum(x0, lo), 0.0, None))


def _window(n: int, pre: dict, mem: dict, a: np.ndarray, b: np.ndarray, engine_end: np.ndarray) -> np.ndarray:
    """Seconds per component of each request's window [a, b]; shape [n, len(COMPONENTS)].

    Steps and gaps count up to ``engine_end`` (the engine's first/last token; nan: b); the
    window's rest after it is engine.output."""
    eb = np.where(np.isnan(engine_end), b, np.minimum(engine_end, b))
    comps = _window_steps(n, pre, mem, a, eb)
    comps[:, _IDX["engine.output"]] += _ov(eb, b, a, b)
    if pre["kv"] is not None:
        # a preempted request is in no step: its preempted time was labelled a stall (engine.queue)
        kri, k0, k1 = pre["kv"]
        kv = np.bincount(kri, weights=_ov(k0, k1, a[kri], b[kri]), minlength=n)
        for src in ("engine.queue", "engine.schedule"):
            moved = np.minimum(kv, comps[:, _IDX[src]])
            comps[:, _IDX[src]] -= moved
            comps[:, _IDX["engine.kv"]] += moved
            kv = kv - moved
    return comps


def _window_steps(n: int, pre: dict, mem: dict, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    comps = np.zeros((n, len(COMPONENTS)))
    ov = _ov

    has_gw = ~np.isnan(pre["gw_arr"]) & ~np.isnan(pre["gw_adm"])
    comps[:, _IDX["gateway.queue"]] += np.where(has_gw, ov(pre["gw_arr"], pre["gw_adm"], a, b), 0.0)
    comps[:, _IDX["gateway.route"]] += np.where(has_gw, ov(pre["gw_adm"], pre["en_arr"], a, b), 0.0)
    # never reached the engine (rejected at the gateway): all of it is gateway.queue
    comps[:, _IDX["gateway.queue"]] += np.where(np.isnan(pre["en_arr"]), ov(pre["start"], b, a, b), 0.0)
    queue_end = np.where(np.isnan(pre["first_start"]), b, pre["first_start"])
    comps[:, _IDX["engine.queue"]] += ov(pre["en_arr"], queue_end, a, b)

    ri = mem["ri"]
    if not len(ri):
        return comps
    lo, hi = a[ri], b[ri]
    t0, b1, b2, b3, b4, b5, end = (mem[k] for k in ("t0", "b1", "b2", "b3", "b4", "b5", "t_end_s"))
    host = ov(t0, b1, lo, hi) + ov(b1, b2, lo, hi) + ov(b5, end, lo, hi)
    fwd = ov(b2, b3, lo, hi)
    samp = ov(b3, b4, lo, hi)
    outp = ov(b4, b5, lo, hi)
    rc = mem["recompute"]
    cf = mem["cfrac"]
    parts = {
        "engine.schedule": np.where(rc, 0.0, host),
        "model.forward": np.where(rc, 0.0, fwd * (1 - cf) + samp),
        "parallel.collective": np.where(rc, 0.0, fwd * cf),
        "engine.output": np.where(rc, 0.0, outp),
        "engine.kv": np.where(rc, host + fwd + samp + outp, 0.0),
    }
    gap = ov(end, mem["next_start"], lo, hi)
    trailing = mem["next_start"] >= hi - 1e-9  # within 1 ns: float seconds from ns clocks
    parts["engine.output"] = parts["engine.output"] + np.where(trailing, gap, 0.0)
    inner = ~trailing
    parts["engine.schedule"] = parts["engine.schedule"] + np.where(inner & (mem["skipped"] <= 0), gap, 0.0)
    stalled = inner & (mem["skipped"] > 0)
    parts["engine.kv"] = parts["engine.kv"] + np.where(stalled & mem["next_recompute"], gap, 0.0)
    parts["engine.queue"] = np.where(stalled & ~mem["next_recompute"], gap, 0.0)
    for layer, v in parts.items():
        comps[:, _IDX[layer]] += np.bincount(ri, weights=v, minlength=n)
    return comps


