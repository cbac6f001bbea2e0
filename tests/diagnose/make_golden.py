"""Write the golden bundles under tests/data/<scenario>/ (run: python tests/diagnose/make_golden.py).

Each scenario is a handful of requests and steps with round timestamps (ms), so the
expected decomposition in tests/data/<scenario>/expected.json could be worked out by
hand on paper (the derivations are in the comments below). The bundles are committed;
this script documents how they were made.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from layerscope.diagnose.config_diff import CONFIG_DEFAULTS
from layerscope.probes import schema

DATA = Path(__file__).resolve().parents[1] / "data"
ORIGIN = 10**12  # ns


def ns(ms: float | None) -> int | None:
    return None if ms is None else ORIGIN + int(round(ms * 1e6))


def table(sch: pa.Schema, rows: list[dict]) -> pa.Table:
    return pa.Table.from_pydict({f.name: [r.get(f.name) for r in rows] for f in sch}, schema=sch)


def step(step_id, start, *, sched, prep, fwd, samp, out, ids, toks, coll=None, preempt=0, prefill=0, decode=0):
    end = start + sched + prep + fwd + samp + out
    return dict(step_id=step_id, replica=0, start_ns=ns(start), end_ns=ns(end), schedule_s=sched / 1e3,
                prepare_s=prep / 1e3, forward_s=fwd / 1e3, sample_s=samp / 1e3, output_s=out / 1e3,
                step_s=(end - start) / 1e3, num_prefill_seqs=prefill, num_decode_seqs=decode,
                num_prefill_tokens=sum(t for t in toks if t > 1), num_decode_tokens=sum(t for t in toks if t == 1),
                num_batched_tokens=sum(toks), num_running=len(ids), num_waiting=0, num_kv_blocks_free=10,
                num_kv_blocks_total=16, num_preemptions=preempt, num_prefix_queries=0, num_prefix_hits=0,
                collective_s=None if coll is None else coll / 1e3, request_ids=ids, request_num_tokens=toks)


def request(rid, *, prompt, output, arrival, sched, first, fin, gw=None, preemptions=0, recomputed=0,
            preempted_ms=0.0, steps=0, chunks=1):
    """Times in ms. ``gw``: (gateway arrival, admitted, routed, first token out, finished out) or None."""
    r = dict(request_id=rid, replica=0, status="finished_length", finish_reason="length", num_prompt_tokens=prompt,
             num_cached_tokens=0, num_output_tokens=output, num_preemptions=preemptions,
             num_recomputed_tokens=recomputed, num_steps=steps, num_prefill_chunks=chunks,
             engine_arrival_ns=ns(arrival), engine_scheduled_ns=ns(sched), engine_first_token_ns=ns(first),
             engine_finished_ns=ns(fin), preempted_s=preempted_ms / 1e3)
    if gw:
        g_arr, adm, routed, g_first, g_fin = gw
        r.update(client_send_ns=ns(g_arr - 1), gateway_arrival_ns=ns(g_arr), gateway_admitted_ns=ns(adm),
                 gateway_routed_ns=ns(routed), gateway_first_token_ns=ns(g_first), gateway_finished_ns=ns(g_fin),
                 client_first_token_ns=ns(g_first + 1), client_done_ns=ns(g_fin + 1), http_status=200)
        start, first_out, fin_out = g_arr, g_first, g_fin
        r.update(client_ttft_s=(first_out - start + 2) / 1e3, client_e2e_s=(fin_out - start + 2) / 1e3)
    else:
        start, first_out, fin_out = arrival, first, fin
    r.update(ttft_s=(first_out - start) / 1e3, e2e_s=(fin_out - start) / 1e3)
    if output > 1:
        r["tpot_s"] = (fin_out - first_out) / (output - 1) / 1e3
        r["itl_mean_s"] = r["tpot_s"]
    return r


def write(name: str, requests: list[dict], steps: list[dict], layers=(), kernels=(), collectives=(), spans=(),
          gateway: bool = False) -> None:
    out = DATA / name
    out.mkdir(parents=True, exist_ok=True)
    for tname, rows in (("requests", requests), ("steps", steps), ("layers", layers), ("kernels", kernels),
                        ("collectives", collectives), ("spans", spans)):
        pq.write_table(table(schema.TABLES[tname], list(rows)), out / f"{tname}.parquet")
    (out / "metrics.prom").write_text("")
    config = {k: v for k, v in CONFIG_DEFAULTS.items() if not k.startswith("gateway.")}
    config["gateway"] = {k.split(".", 1)[1]: v for k, v in CONFIG_DEFAULTS.items() if k.startswith("gateway.")}
    manifest = {"format": schema.BUNDLE_FORMAT, "schema_version": schema.SCHEMA_VERSION, "run_id": name,
                "command": ["layerscope", "run", "--model", "golden"], "config": config, "resolved": {},
                "workload": {"name": name, "seed": 0}, "faults": {"never": "read"},
                "versions": {"layerscope": "0.1.0"}, "hardware": {"cpu": "golden"},
                "probes": "default", "start_ns": ORIGIN, "end_ns": ns(60), "start_time": "", "summary": {}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def offline_two_requests() -> None:
    # every step: schedule 1, prepare 0, forward 3, sample 1, output 1 (6 ms); 1 ms host gap between steps
    # s0 [2,8] A prefill 4 tok (A's first token at sample end, 7); s1 [9,15] A decode + B prefill (B first 14);
    # s2 [16,22] A decode (A finishes at 21), B decode (B finishes at 21)
    kw = dict(sched=1, prep=0, fwd=3, samp=1, out=1)
    steps = [step(0, 2, ids=["A"], toks=[4], prefill=1, **kw),
             step(1, 9, ids=["A", "B"], toks=[1, 2], prefill=1, decode=1, **kw),
             step(2, 16, ids=["A", "B"], toks=[1, 1], decode=2, **kw)]
    reqs = [request("A", prompt=4, output=3, arrival=0, sched=2, first=7, fin=21, steps=3),
            request("B", prompt=2, output=2, arrival=1, sched=9, first=14, fin=21, steps=2)]
    write("offline_two_requests", reqs, steps)


def gateway_preemption_tp() -> None:
    # every step: schedule 1, prepare 1, forward 4 (of which 2 collectives), sample 1, output 1 (8 ms); 1 ms gaps
    # s0 [5,13] C prefill 3; s1 [14,22] D prefill 2 (C not scheduled: a stall); s2 [23,31] C, D decode;
    # s3 [32,40] E prefill 4 (C preempted at 32, resumed at 41); s4 [41,49] C recomputes 5 tokens, finishes
    kw = dict(sched=1, prep=1, fwd=4, samp=1, out=1, coll=2)
    steps = [step(0, 5, ids=["C"], toks=[3], prefill=1, **kw),
             step(1, 14, ids=["D"], toks=[2], prefill=1, **kw),
             step(2, 23, ids=["C", "D"], toks=[1, 1], decode=2, **kw),
             step(3, 32, ids=["E"], toks=[4], prefill=1, preempt=1, **kw),
             step(4, 41, ids=["C"], toks=[5], prefill=1, **kw)]
    reqs = [request("C", prompt=3, output=3, arrival=4, sched=5, first=12, fin=48, gw=(1, 3, 3.5, 14, 50),
                    preemptions=1, recomputed=5, preempted_ms=9, steps=3),
            request("D", prompt=2, output=2, arrival=5, sched=14, first=21, fin=30, gw=(2, 4, 4.5, 23, 32), steps=2),
            request("E", prompt=4, output=1, arrival=25, sched=32, first=39, fin=39, gw=(22, 24, 24.5, 41, 41),
                    steps=1)]
    spans = [dict(span_id="kv-C", name="preempted", layer="engine.kv", request_id="C", start_ns=ns(32),
                  end_ns=ns(41), attributes="{}")]
    # layer rows timed on s0; kernels profiled on s0 (3 ops of 1 ms, two 0.5 ms gaps); collectives on s0
    layers = [dict(step_id=0, replica=0, name=n, duration_s=d / 1e3) for n, d in
              (("embed", 0.5), ("layers.0.attn", 1.5), ("layers.0.mlp", 1.5), ("norm", 0.1), ("lm_head", 0.4),
               ("sampler", 1.0))]
    kernels = [dict(window=0, step_id=0, replica=0, name=n, category="compute", start_ns=ns(t), duration_s=1e-3,
                    gap_before_s=g) for n, t, g in (("rms_norm", 7, None), ("matmul", 8.5, 5e-4),
                                                     ("matmul", 10, 5e-4))]
    collectives = [dict(step_id=0, replica=0, rank=rank, op="all_reduce", name="layers.0.mlp", num_bytes=4096,
                        start_ns=ns(9), duration_s=1e-3, wait_s=w) for rank, w in ((0, 5e-4), (1, 0.0))]
    write("gateway_preemption_tp", reqs, steps, layers, kernels, collectives, spans, gateway=True)


if __name__ == "__main__":
    offline_two_requests()
    gateway_preemption_tp()
    print(f"wrote golden bundles under {DATA}", file=sys.stderr)
