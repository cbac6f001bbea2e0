"""Warm-up: run the step shapes a server meets first before it reports ready (issue 18).

A cold engine runs its first benchmark at about half speed (100m bf16: 291 output tok/s
and TTFT p50 4.3 s, then 580-607 tok/s and 0.8 s): first calls of the native kernels and
of torch's ops, the allocator growing to its working set, thread pools starting. vLLM
warms up (and compiles) before it serves; so does a replica here, between loading the
engine and saying ``ready``, so ``/health`` is only ok once the engine is warm.

What runs: one prefill of a full token budget (chunked prefill's largest step), then a
batch of short requests whose lengths are staggered, so that decode steps of every batch
size from ``num_seqs`` down to 1 run once. Afterwards nothing of it remains: the recorder
saw none of it (a no-op recorder stands in), and the prefix cache, the step ids and the
counters the metrics read are reset. ``LAYERSCOPE_WARMUP=0`` in the environment skips it
(to measure a cold start).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

MAX_WARMUP_SEQS = 32  # decode batch sizes 1..min(max_num_seqs, this)


def warm_up(engine, max_seqs: int = MAX_WARMUP_SEQS) -> dict[str, Any]:
    """Warm ``engine`` (an LLMEngine) up; returns ``{"warmup_s", "num_steps", "max_decode_batch",
    "prefill_tokens"}``. Raises what the engine raises."""
    from layerscope.engine.recorder import Recorder
    from layerscope.engine.sampling_params import SamplingParams

    t0 = time.monotonic()
    if os.environ.get("LAYERSCOPE_WARMUP", "1") == "0":
        return {"warmup_s": 0.0, "num_steps": 0, "max_decode_batch": 0, "prefill_tokens": 0}
    cfg, sched, bm = engine.config, engine.scheduler, engine.block_manager
    vocab = engine.spec.vocab_size
    num_seqs = max(1, min(cfg.max_num_seqs, max_seqs))
    prefill = max(1, min(cfg.max_num_batched_tokens, engine.max_model_len - 2))
    # KV room: the budget-sized prefill runs alone first; the short ones must fit together
    short_len = 8
    saved = engine.recorder, getattr(engine.executor, "recorder", None)
    engine.recorder = Recorder()
    if saved[1] is not None:
        engine.executor.recorder = engine.recorder
    num_steps = 0
    try:
        engine.add_request([(7 * k + 11) % vocab for k in range(prefill)],
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), request_id="warmup-prefill")
        num_steps += _drain(engine)
        for i in range(num_seqs):  # request i decodes i + 1 tokens: batch sizes num_seqs, ..., 1
            ids = [(13 * i + 5 * k + 3) % vocab for k in range(short_len)]
            engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=i + 2, ignore_eos=True),
                               request_id=f"warmup-{i}")
        num_steps += _drain(engine)
    finally:
        engine.recorder = saved[0]
        if saved[1] is not None:
            engine.executor.recorder = saved[1]
    bm.reset_prefix_cache()
    bm.num_prefix_queries = bm.num_prefix_hits = 0
    sched.step_id = 0
    sched.num_preemptions = 0
    return {"warmup_s": time.monotonic() - t0, "num_steps": num_steps, "max_decode_batch": num_seqs,
            "prefill_tokens": prefill}


def _drain(engine) -> int:
    n = 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    return n


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now (torch, transformers, the model, the tokenizer:
    ~400k tracked objects with the tiny model) into the collector's permanent generation, as vLLM's
    engine core does at startup (``freeze_gc_heap``). Python's full collection walks every tracked
    object: under load it stalled a step loop here ~150 ms about every 5 s (two full collections in
    9,600 tiny steps, 31 us a step amortized), 3 ms frozen. Call once in a process of its own (a
    replica, a TP worker, the gateway's) when it is ready to serve (``gc.unfreeze()`` when the process
    goes on to other work: ``server.serving``): frozen objects are still freed by reference
    counting, only their cycles never are. Returns how many objects the permanent generation holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
