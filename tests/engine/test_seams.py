"""The seams between packages: the gateway reaches probes only through the engine's recorder
interface, and the engine holds its executor through the Executor protocol."""

from __future__ import annotations

from layerscope.engine.config import EngineConfig


def test_gateway_process_imports_neither_probes_nor_torch(modules_after):
    mods = modules_after("import layerscope.engine.gateway.server, layerscope.engine.gateway.cli")
    assert not {m for m in mods if m.startswith("layerscope.probes") or m == "torch"}


def test_a_gateway_without_recorders_builds_no_metrics(tiny_model):
    from layerscope.engine.gateway.gateway import Gateway
    from layerscope.engine.recorder import GatewayRecorder

    gw = Gateway(EngineConfig.from_overrides(model=str(tiny_model)), record=True)
    assert type(gw.recorder) is GatewayRecorder and not gw.recording
    assert gw.recorder.metric_families() == []


def test_probes_off_records_nothing_and_keeps_only_exposed_metrics(tiny_model):
    from layerscope.engine.llm import LLM
    from layerscope.engine.sampling_params import SamplingParams
    from layerscope.probes.metrics import METRICS, exposed_by
    from layerscope.probes.serving import recorders

    factory = recorders("off")
    gw = factory.gateway("m", keep_requests=True)
    assert not gw.enabled and gw.export() is None  # nothing recorded for a bundle
    rec = factory.engine(0, "m")
    assert not rec.enabled
    with LLM(model=str(tiny_model), recorder=rec) as llm:
        llm.generate(["hello world", "a b c"], SamplingParams(max_tokens=3, ignore_eos=True))
        fams = {f.name: f for f in rec.metric_families(llm.engine.stats())}
    replica_names = {m.name.removesuffix("_total") for m in METRICS if exposed_by(m) in ("replica", "both")}
    assert set(fams) == replica_names
    success = {s.labels.get("finished_reason"): s.value for s in fams["layerscope_request_success"].samples
               if s.name.endswith("_total")}
    assert success["length"] == 2
    gen = [s.value for s in fams["layerscope_generation_tokens"].samples if s.name.endswith("_total")]
    assert gen == [6]


def test_gateway_recorder_holds_only_gateway_metrics():
    from layerscope.probes.metrics import METRICS, exposed_by
    from layerscope.probes.serving import recorders

    rec = recorders("default").gateway("m", keep_requests=False)
    names = {fam.name for fam in rec.metric_families()}
    want = {m.name.removesuffix("_total") for m in METRICS if exposed_by(m) in ("gateway", "both")}
    assert names == want and "layerscope_step_phase_seconds" not in names


def test_executors_implement_the_protocol(tiny_model):
    from layerscope.engine.executor import Executor
    from layerscope.engine.llm_engine import LLMEngine
    from layerscope.engine.model_runner import ModelRunner

    engine = LLMEngine(EngineConfig.from_overrides(model=str(tiny_model)))
    assert isinstance(engine.executor, ModelRunner) and isinstance(engine.executor, Executor)
    assert engine.resolved.num_parameters == engine.executor.num_parameters > 0
    engine.shutdown()
