"""Warm-up before ready (engine/warmup.py): the replica runs the first step shapes before
``/health`` is ok, says how long it took, and leaves nothing of it in the run's records."""

from __future__ import annotations

import json
import statistics

import pytest

from layerscope.cli import main


def test_run_warms_up_before_serving_and_records_none_of_it(tiny_model, tmp_path, capsys):
    from layerscope.probes.bundle import read_bundle

    out = tmp_path / "run"
    assert main(["run", "--model", str(tiny_model), "--workload", "chat", "--num-requests", "6", "--rate", "0",
                 "--set", "max_num_seqs=4", "--set", "enable_prefix_caching=true", "--out", str(out),
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "layerscope run: warmed up in " in err and "decode batches 1..4)" in err
    b = read_bundle(out, full=True)
    steps = b.steps
    assert steps.step_id.min() == 1  # the step counter starts again after the warm-up
    ids = {rid for row in steps.request_ids for rid in row}
    assert ids and not any(rid.startswith("warmup") for rid in ids)
    assert set(b.requests.request_id) >= ids and len(b.requests) == 6
    assert steps.num_preemptions.sum() == 0
    # the prefix cache starts empty: the warm-up's prompts left no cached blocks or counts behind
    assert b.requests.num_cached_tokens.fillna(0).sum() == 0
    assert _counter(b.metrics_text, "layerscope_prefix_cache_hits_total") == 0


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_serve_reports_the_warm_up_and_health_waits_for_it(tiny_model):
    from layerscope.engine.config import EngineConfig
    from layerscope.engine.gateway.cli import warmup_line
    from layerscope.engine.gateway.gateway import Gateway

    gateway = Gateway(EngineConfig.from_overrides(model=str(tiny_model), max_num_seqs=3), num_replicas=1,
                      recorders=None)
    try:
        assert not gateway.is_healthy
        gateway.start()
        (w,) = gateway.warmup
        assert w["num_steps"] >= 1 + 3 and w["max_decode_batch"] == 3 and w["warmup_s"] > 0
        assert w["prefill_tokens"] == min(gateway.config.max_num_batched_tokens, gateway.max_model_len - 2)
        # the replica's startup heap (torch, transformers, the model) is out of the full collections' walk
        assert w["gc_frozen_objects"] > 100_000, w
        assert warmup_line(gateway).startswith("layerscope serve: warmed up in ")
        json.dumps(w)  # crosses the process boundary and goes to the terminal as plain data
    finally:
        gateway.shutdown()


def _busy_cores() -> float:
    """CPU seconds the whole machine has spent busy (every core, every process)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_cpu(root) -> float:
    """CPU seconds of ``root`` and its live children (the test process, its replica, its threads)."""
    import psutil

    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            c = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += c.user + c.system
    return total


def _three_runs(tiny_model) -> list[tuple[float, float]]:
    """Three identical runs against one fresh server: (output tok/s, cores other processes kept busy)."""
    import time

    import psutil

    from layerscope.engine.config import EngineConfig
    from layerscope.engine.gateway.gateway import Gateway
    from layerscope.engine.gateway.server import serving
    from layerscope.regressions.load.loadgen import run_load, server_in_process
    from layerscope.regressions.load.workloads import builtin

    gateway = Gateway(EngineConfig.from_overrides(model=str(tiny_model), num_kv_blocks=512), num_replicas=1,
                      recorders=None, served_model_name="tiny")
    # runs of ~1 s: a 0.1 s run (24 x 24 tokens) moved 2x from one repetition to the next here
    spec = builtin("offline", num_requests=96, output_len=48)
    me = psutil.Process()
    out = []
    with serving(gateway) as url:
        reqs = spec.build(gateway.tokenizer)
        with server_in_process():
            for _ in range(3):
                w0, b0, o0 = time.monotonic(), _busy_cores(), _own_cpu(me)
                tps = run_load(url, spec, reqs).summary()["output_tokens_per_s"]
                wall = time.monotonic() - w0
                out.append((tps, max(_busy_cores() - b0 - (_own_cpu(me) - o0), 0.0) / wall))
    return out


@pytest.mark.slow
def test_first_and_third_run_of_a_workload_are_within_noise(tiny_model):
    """The cold start the issue saw (the first run at half speed) is gone: the first of three
    identical runs against one server is within noise of the third (loose bound: a shared,
    busy machine moves tiny-model figures by tens of percent).

    A full garbage collection in the gateway's process (here the test's: ~400k objects and up, 150 ms and
    more per pass, every request in flight waiting on the event loop) made one run in a few ~35% slower,
    and one first run in CI at 0.42x: ``serving`` now freezes the startup heap, as ``serve`` does.
    Other processes' CPU use is measured during each run (the machine's busy time less this test's
    process tree's): a first run slow while something else held the CPU says nothing of the cold
    start, so the three runs are repeated against a fresh server, at most twice; a first run slow on
    a machine as quiet as in the other runs fails at once."""
    for attempt in range(3):
        runs = _three_runs(tiny_model)
        tps = [t for t, _ in runs]
        others = [o for _, o in runs]
        print(f"\noutput tok/s of three identical runs after warm-up: {[round(t) for t in tps]}; "
              f"cores busy with other processes: {[round(o, 2) for o in others]}")
        if tps[0] > 0.5 * statistics.median(tps[1:]):
            return
        if others[0] < max(others[1:]) + 0.5:  # the machine was no busier: the cold start is back
            break
    pytest.fail(f"first run at {tps[0] / statistics.median(tps[1:]):.2f}x the others' median "
                f"(tok/s {[round(t) for t in tps]}, other processes' cores {[round(o, 2) for o in others]}; "
                f"{attempt + 1} attempt(s))")
