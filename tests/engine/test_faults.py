"""Faults and --set: bad input is an error naming what exists, before anything starts; each fault
acts through its wrapper."""

from __future__ import annotations

import statistics
import time

import pytest

from layerscope.engine.config import ConfigError, EngineConfig, config_keys, parse_set_args
from layerscope.engine.faults import FAULTS, FaultError, Faults, model_rows


# ---- parsing ----------------------------------------------------------------------------------
def test_unknown_fault_lists_every_fault():
    with pytest.raises(FaultError) as e:
        Faults.parse(["model.delay=3"])
    assert "unknown fault 'model.delay'" in str(e.value)
    for key in FAULTS:
        assert key in str(e.value)


@pytest.mark.parametrize("item, words", [
    ("kernel.slowdown=fast", ["kernel.slowdown", "'fast'", "factor"]),
    ("model.layer_delay=3", ["model.layer_delay", "ROW:MS"]),
    ("output.delay_ms", ["KEY=VALUE", "output.delay_ms"]),
    ("kernel.slowdown=0.5", ["kernel.slowdown must be >= 1"]),
    ("router.skew=2", ["router.skew must be in [0, 1]"]),
    ("gateway.delay_ms=-5", ["gateway.delay_ms must be >= 0"]),
])
def test_bad_fault_value_says_what_is_expected(item, words):
    with pytest.raises(FaultError) as e:
        Faults.parse([item])
    for w in words:
        assert w in str(e.value)


def test_round_trip_through_the_manifest_dict():
    f = Faults.parse(["model.layer_delay=layers.1.mlp:6", "kernel.slowdown=4", "router.skew=0.5"])
    assert f.to_dict() == {"router.skew": 0.5, "model.layer_delay": {"layers.1.mlp": 6.0}, "kernel.slowdown": 4.0}
    assert Faults.from_dict(f.to_dict()) == f


# ---- checked against the run ------------------------------------------------------------------
def test_layer_row_the_model_lacks_lists_its_rows():
    f = Faults.parse(["model.layer_delay=layers.7.mlp:6"])
    with pytest.raises(FaultError) as e:
        f.check(tp_size=1, num_layers=2)
    msg = str(e.value)
    assert "no row 'layers.7.mlp'" in msg
    for row in model_rows(2):
        assert row in msg
    f.check(tp_size=1, num_layers=8)  # that model has it


def test_collective_fault_without_tp():
    with pytest.raises(FaultError, match=r"collective.delay_ms needs tensor parallelism .*tp_size=1"):
        Faults(collective_delay_ms=4).check(tp_size=1)
    Faults(collective_delay_ms=4).check(tp_size=2)


def test_router_skew_with_one_replica():
    with pytest.raises(FaultError, match=r"router.skew needs two or more replicas .*this run has 1"):
        Faults(router_skew=0.9).check(tp_size=1, num_replicas=1)
    Faults(router_skew=0.9).check(tp_size=1, num_replicas=2)


def test_engine_refuses_a_row_its_model_lacks(tiny_model):
    from layerscope.engine.llm_engine import LLMEngine

    with pytest.raises(FaultError, match="layers.0.attn"):
        LLMEngine(EngineConfig.from_overrides(model=str(tiny_model)),
                  faults=Faults.parse(["model.layer_delay=layers.99.attn:1"]))


@pytest.mark.parametrize("kw, match", [
    (dict(faults=["router.skew=0.9"]), "needs two or more replicas"),
    (dict(faults=["collective.delay_ms=4"]), "needs tensor parallelism"),
    (dict(faults=["model.layer_delay=layers.99.mlp:6"]), "layers.0.mlp"),
    (dict(faults=["engine.overhead_ms=8"]), "engine.step_overhead_ms"),
])
def test_gateway_refuses_before_starting_a_replica(tiny_model, kw, match):
    from layerscope.engine.gateway.cli import build_gateway

    t0 = time.monotonic()
    with pytest.raises(FaultError, match=match):
        build_gateway(str(tiny_model), **kw)
    assert time.monotonic() - t0 < 30  # no replica process was started


def test_model_that_is_not_a_directory(tmp_path):
    from layerscope.engine.gateway.cli import build_gateway

    from layerscope.engine.models.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="nope: no such directory .*not a hub id"):
        build_gateway(str(tmp_path / "nope"))


# ---- --set ------------------------------------------------------------------------------------
def test_set_values_are_typed_at_the_edge():
    got = parse_set_args(["max_num_seqs=8", "enable_prefix_caching=off", "gateway.request_timeout_s=5",
                          "router_policy=least_loaded"])
    assert got == {"max_num_seqs": 8, "enable_prefix_caching": False, "gateway.request_timeout_s": 5.0,
                   "router_policy": "least_loaded"}
    assert [type(v) for v in got.values()] == [int, bool, float, str]


def test_set_unknown_key_lists_the_keys():
    with pytest.raises(ConfigError) as e:
        parse_set_args(["max_num_seq=4"])
    msg = str(e.value)
    assert "unknown config key 'max_num_seq'" in msg and "did you mean max_num_seqs" in msg
    for key in config_keys():
        assert key in msg


@pytest.mark.parametrize("item, words", [
    ("max_num_seqs=many", ["max_num_seqs", "expects int", "'many'"]),
    ("enable_prefix_caching=maybe", ["enable_prefix_caching", "expects bool", "true"]),
    ("gateway.max_queue=x", ["gateway.max_queue", "expects int"]),
    ("max_num_seqs", ["KEY=VALUE", "max_num_seqs", "block_size"]),
    ("router_policy=random", ["router_policy", "round_robin", "least_loaded", "prefix_affinity"]),
    ("max_num_seqs=0", ["max_num_seqs must be > 0", "got 0"]),  # bounds checked by the config when parsed
    ("block_size=12", ["block_size must be a power of two"]),
])
def test_set_bad_value_says_what_is_expected(item, words):
    with pytest.raises(ConfigError) as e:
        parse_set_args([item])
    for w in words:
        assert w in str(e.value)


# ---- the wrappers act -------------------------------------------------------------------------
def test_engine_faults_land_in_their_step_phase(tiny_model):
    from layerscope.engine.llm import LLM
    from layerscope.engine.recorder import ListRecorder
    from layerscope.engine.sampling_params import SamplingParams

    def phases(faults):
        rec = ListRecorder()
        with LLM(model=str(tiny_model), recorder=rec, faults=faults) as llm:
            llm.generate(["hello world"] * 2, SamplingParams(max_tokens=4, ignore_eos=True))
        steps = rec.steps[1:]  # past the first step's warm-up
        return (min(s.schedule_ns for s in steps) / 1e6, min(s.output_ns for s in steps) / 1e6)

    sched_ms, out_ms = phases(Faults(engine_step_overhead_ms=20, output_delay_ms=30))
    assert 20 <= sched_ms < 20 + 15 and 30 <= out_ms < 30 + 15
    base_sched_ms, base_out_ms = phases(Faults())
    assert base_sched_ms < 10 and base_out_ms < 10


def test_cli_bad_fault_and_set_exit_with_the_list(tiny_model):
    import subprocess
    import sys

    for extra, words in ((["--fault", "router.skew=0.5"], ["router.skew needs two or more replicas"]),
                         (["--set", "max_num_seq=4"], ["unknown config key 'max_num_seq'", "max_num_seqs"]),
                         (["--fault", "nope=1"], ["unknown fault 'nope'", "collective.delay_ms"])):
        p = subprocess.run([sys.executable, "-m", "layerscope", "serve", "--model", str(tiny_model), "--port", "0",
                            *extra], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        assert "starting" not in p.stderr  # refused before any replica started
        for w in words:
            assert w in p.stderr


def test_every_fault_matrix_case_passes_the_checks(tiny_model):
    """The fault matrix's candidates are runs that have what their faults name (and inject the same faults)."""
    from layerscope.api import _fault_items
    from layerscope.engine.gateway.cli import build_gateway
    from layerscope.regressions import fault_matrix as fm

    checked = set()
    for case in fm.CASES:
        kw = {**case.baseline, **case.candidate}
        gateway = build_gateway(tiny_model, config=kw.get("config"), faults=_fault_items(kw.get("faults")),
                                replicas=kw.get("replicas", 1), tp=kw.get("tp", 0))  # not started: only checked
        checked.update(gateway.faults.to_dict())
    assert checked == set(FAULTS)  # every fault is in the matrix, and each passed its checks


def test_layer_delay_lands_inside_its_row(tiny_model):
    from layerscope.engine.llm import LLM
    from layerscope.engine.sampling_params import SamplingParams
    from layerscope.probes.recorder import ProbeRecorder

    rec = ProbeRecorder("default", model_name="tiny", layer_timing_interval=1)
    with LLM(model=str(tiny_model), recorder=rec, faults=Faults.parse(["model.layer_delay=layers.1.mlp:15"])) as llm:
        llm.generate(["hello world"], SamplingParams(max_tokens=3, ignore_eos=True))
    rows = [dict(times) for _, times in rec.recorded_since(0, 0).layer_times]
    assert rows and all(r["layers.1.mlp"] >= 15e6 for r in rows)  # the delay is inside its row, every time
    # ... and not in its neighbour's (medians: the first, cold step may be slow all over on a busy machine)
    assert statistics.median(r["layers.0.mlp"] for r in rows) < statistics.median(r["layers.1.mlp"] for r in rows) - 10e6
