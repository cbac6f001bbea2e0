"""The replay: the step-cost fit, the engine's real scheduler on a virtual clock, the exact Shapley
split, what-if. Synthetic bundles (testing.synth) for the splits: their step costs and configs are
known, so the component that changed is known."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from layerscope.cli import main
from layerscope.replay.cost import fit_cost
from layerscope.replay.inputs import Front, Settings, Workload, load_inputs
from layerscope.replay.sim import replay
from layerscope.replay.split import shapley
from layerscope.replay.whatif import predict, scenarios

BASE = dict(num_requests=300, arrival_rate_per_s=80.0)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, synth_factory):
    return synth_factory(tmp_path_factory.mktemp("replay-synth"), **BASE)


def _steps(n: int, rng) -> pd.DataFrame:
    pf = rng.integers(0, 400, n) * (rng.random(n) < 0.3)
    dec = rng.integers(1, 30, n)
    ids = [[f"r{j}" for j in range(k)] for k in dec]
    wall = 0.001 + 0.0005 * (pf > 0) + 2e-5 * pf + 1e-4 * dec  # context: every request gets 1 token a step
    start = np.cumsum(np.r_[0, wall[:-1] + 0.0002]) * 1e9
    return pd.DataFrame({"step_id": np.arange(n), "replica": 0, "start_ns": start, "end_ns": start + wall * 1e9,
                         "num_prefill_tokens": pf, "num_decode_seqs": dec, "num_running": 1, "num_waiting": 0,
                         "collective_s": 0.0, "request_ids": ids, "request_num_tokens": [[1] * len(x) for x in ids]})


def test_cost_fit_recovers_a_known_linear_cost():
    steps = _steps(400, np.random.default_rng(0))
    c = fit_cost(steps)
    a, e, b, d, ctx = c.coef
    assert a == pytest.approx(0.001, rel=1e-3) and e == pytest.approx(0.0005, rel=1e-3)
    assert b == pytest.approx(2e-5, rel=1e-3) and d == pytest.approx(1e-4, rel=1e-3)
    assert abs(ctx) < 1e-9 and c.r2 > 0.999
    assert np.median(c.gap_decode) == pytest.approx(0.0002, rel=1e-3)


def test_cost_fit_takes_the_machines_wait_out_and_a_replay_puts_it_back():
    # a busy spell in the second half: every step there waits 2 ms for a CPU; 1 step in 5 measured it
    steps = _steps(400, np.random.default_rng(0))
    busy = np.arange(400) >= 200
    work_ns = steps["end_ns"] - steps["start_ns"]
    steps["start_ns"] = steps["start_ns"] + np.cumsum(np.r_[0, busy[:-1] * 2e6])
    steps["end_ns"] = steps["start_ns"] + work_ns + busy * 2e6
    steps["wait_ns"] = np.where(np.arange(400) % 5 == 0, busy * 2e6, np.nan)
    c = fit_cost(steps)
    a, e, b, d, _ = c.coef
    assert a == pytest.approx(0.001, rel=1e-3) and d == pytest.approx(1e-4, rel=1e-3)  # the work, not the wait
    t = steps["start_ns"].to_numpy(float) / 1e9
    assert c.wait_at(t[50], False) == 0 and c.wait_at(t[300], False) == pytest.approx(0.002)
    assert c.mean_wait() == pytest.approx(0.001, rel=0.1)
    quiet = fit_cost(steps.assign(wait_ns=np.where(np.arange(400) % 5 == 0, 0.0, np.nan)))
    wl = _workload(40, shared_blocks=0, gap_s=0.04)  # over both halves of the run's clock
    own, swapped = (replay(wl, SETTINGS, 4096, Front(), x) for x in (c, c.with_wait(quiet)))
    assert swapped.figures["tpot_s"]["p50"] < own.figures["tpot_s"]["p50"]  # the quiet machine's wait: faster


def _workload(n: int, shared_blocks: int, prompt: int = 96, out: int = 8, gap_s: float = 0.001) -> Workload:
    hashes = [[1000 + j for j in range(shared_blocks)] + [10 ** 6 * (i + 1) + j for j in range(prompt // 16 -
                                                                                              shared_blocks)]
              for i in range(n)]
    return Workload(arrival_s=np.arange(n) * gap_s, prompt_len=np.full(n, prompt), output_len=np.full(n, out),
                    replica=np.zeros(n, np.int64), hashes=hashes, cached_len=np.zeros(n, np.int64))


SETTINGS = Settings(max_num_seqs=8, max_num_batched_tokens=256, enable_chunked_prefill=True,
                    enable_prefix_caching=True, block_size=16, max_model_len=4096, max_concurrency=1000,
                    max_queue=1000, replicas=1)


def _cost():
    return fit_cost(_steps(200, np.random.default_rng(1)))


def test_replay_runs_the_real_scheduler_prefix_cache_and_preemption():
    wl, cost = _workload(40, shared_blocks=4), _cost()
    r = replay(wl, SETTINGS, 4096, Front(), cost, noise=False)
    assert np.isfinite(r.ttft_s).all() and np.isfinite(r.e2e_s).all()
    # 4 of 6 blocks shared: after the first prompt computed them, the prefix cache serves them
    assert 0.5 < r.figures["prefix_hit_rate"] < 4 / 6 + 1e-9
    off = replay(wl, dataclasses.replace(SETTINGS, enable_prefix_caching=False), 4096, Front(), cost, noise=False)
    assert off.figures["prefix_hit_rate"] == 0 and off.figures["ttft_s"]["p50"] > r.figures["ttft_s"]["p50"]
    # a pool too small for 8 running sequences' growth: the scheduler preempts, and still finishes all
    tight = replay(wl, SETTINGS, 20, Front(), cost, noise=False)
    assert tight.figures["preemptions"] > 0 and np.isfinite(tight.e2e_s).all()
    # max_num_seqs=1 serialises the requests: queueing grows TTFT
    one = replay(wl, dataclasses.replace(SETTINGS, max_num_seqs=1), 4096, Front(), cost, noise=False)
    assert one.figures["ttft_s"]["p90"] > 3 * r.figures["ttft_s"]["p90"]


def test_gateway_admission_queues_and_refuses():
    wl, cost = _workload(30, shared_blocks=0, gap_s=0.0), _cost()
    s = dataclasses.replace(SETTINGS, max_concurrency=4, max_queue=10)
    r = replay(wl, s, 4096, Front(), cost, noise=False)
    assert r.figures["rejected"] == 30 - 4 - 10
    assert np.isfinite(r.ttft_s).sum() == 14


def test_shapley_is_exact_and_residual_is_the_rest(bundles):
    a, b = load_inputs(bundles()), load_inputs(bundles(max_num_seqs=4, step_overhead_s=0.002))
    cf = shapley(a, b, seeds=(0,), workers=1)
    assert {"config", "step_cost"} <= set(cf["components"])
    for s in cf["split"].values():
        assert sum(s["components"].values()) == pytest.approx(s["replayed_delta"], abs=1e-12)
        assert s["residual"] == pytest.approx(s["measured_delta"] - s["replayed_delta"], abs=1e-12)


@pytest.mark.parametrize("change, component, metric", [
    (dict(max_num_seqs=4), "config", "ttft_s:p50"),
    (dict(num_kv_blocks=60), "kv_capacity", "ttft_s:p50"),
    (dict(step_overhead_s=0.004), "step_cost", "tpot_s:p50"),
    (dict(arrival_rate_per_s=160.0, seed=0), "workload", "ttft_s:p90"),
    (dict(gateway_delay_s=0.05), "front", "ttft_s:p50"),
    # the same code on a busier machine: its steps wait for a CPU (wait_ns), their work is unchanged
    (dict(work_columns=True, machine_slowdown=1.5), "cpu_wait", "tpot_s:p50"),
])
def test_split_assigns_the_change_to_the_component_that_changed(bundles, change, component, metric):
    base = dict(arrival_rate_per_s=100.0) if component == "workload" else {}
    base = dict(work_columns=True) if component == "cpu_wait" else base
    a = load_inputs(bundles(**base))
    b = load_inputs(bundles(**{**base, **change}) if component != "workload" else bundles(**change))
    cf = shapley(a, b, seeds=(0,), workers=1)
    s = cf["split"][metric]
    assert abs(s["measured_delta"]) > 0.002  # the change is there to split
    assert s["components"][component] / s["measured_delta"] >= 0.7, s


def test_whatif_same_config_predicts_the_run_and_a_sweep_orders(bundles):
    inp = load_inputs(bundles())
    same = predict(inp, {"max_num_seqs": inp.settings.max_num_seqs}, seeds=(0,))
    for k, v in same["predicted"].items():
        assert v == pytest.approx(same["measured"][k], rel=1e-9)
    shared: dict = {}
    pts = [predict(inp, ch, seeds=(0,), shared=shared) for ch in scenarios(["max_num_seqs=2,8,64"], None)]
    assert pts[2]["replayed"] == predict(inp, {"max_num_seqs": 64}, seeds=(0,))["replayed"]  # shared as-is replay
    ttft = [p["predicted"]["ttft_s:p50"] for p in pts]
    assert ttft[0] > ttft[1] > ttft[2] * 0.999
    with pytest.raises(ValueError, match="max_num_seqs"):
        predict(inp, {"kernel_backend": "torch"})


def test_cli_replay_whatif_and_diagnose_counterfactual(bundles, capsys):
    a, b = bundles(), bundles(max_num_seqs=4)
    assert main(["replay", a]) == 0
    out = capsys.readouterr().out
    assert "measured" in out and "replayed" in out and "fidelity:" in out
    assert main(["whatif", a, "--set", "max_num_seqs=4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["points"][0]["change"] == {"max_num_seqs": "4"}
    assert main(["whatif", a, "--set", "nope=1"]) == 2
    assert "replay cannot change 'nope'" in capsys.readouterr().err
    assert main(["diagnose", a, b, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    cf = d["counterfactual"]
    assert cf["schema"] == "layerscope.counterfactual/1" and "config" in cf["components"]
    assert main(["diagnose", a, b]) == 0
    assert "Counterfactual split" in capsys.readouterr().out
    assert main(["diagnose", a, b, "--json", "--no-counterfactual"]) == 0
    assert "counterfactual" not in json.loads(capsys.readouterr().out)


def test_a_tp_runs_collective_cost_is_its_own_component(bundles):
    a = load_inputs(bundles(tp_size=2))
    b = load_inputs(bundles(tp_size=2, collective_delay_s=0.003))
    cf = shapley(a, b, seeds=(0,), workers=1)
    s = cf["split"]["tpot_s:p50"]
    assert "collective" in cf["components"] and s["measured_delta"] > 0.005
    assert s["components"]["collective"] / s["measured_delta"] >= 0.7
