"""A default-probes offline run writes a complete, self-consistent bundle; broken bundles fail clearly."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layerscope.probes import schema
from layerscope.probes.bundle import BundleError, read_bundle
from layerscope.probes.metrics import METRICS, exposed_by
from tests.probes.conftest import ENGINE

LIFECYCLE = ("engine_arrival_ns", "engine_scheduled_ns", "engine_first_token_ns", "engine_finished_ns")


@pytest.fixture(scope="module")
def bundle(default_run):
    return read_bundle(default_run.bundle, full=True)


def test_manifest(bundle, default_run):
    m = bundle.manifest
    assert tuple(m) == schema.MANIFEST_KEYS
    assert m["schema_version"] == schema.SCHEMA_VERSION and m["probes"] == "default"
    assert m["config"]["max_num_batched_tokens"] == ENGINE["max_num_batched_tokens"]
    assert m["config"]["gateway"]["max_queue"] == 256  # defaults included
    assert m["resolved"]["num_kv_blocks"] == ENGINE["num_kv_blocks"]
    assert m["workload"] == {"name": "probes-test", "seed": 0}
    assert m["versions"]["torch"] and m["versions"]["python"] and m["hardware"]["cores"] >= 1
    s = m["summary"]
    assert s["requests"] == len(default_run.outputs) and s["num_steps"] == default_run.num_steps
    assert s["output_tokens"] == sum(len(o.token_ids) for o in default_run.outputs)
    assert s["ttft_s"]["count"] == s["requests"] and s["ttft_s"]["p50"] <= s["ttft_s"]["p99"]
    assert m["start_ns"] <= m["end_ns"]


def test_requests_lifecycle_and_counts(bundle, default_run):
    rq = bundle.requests.set_index("request_id")
    assert len(rq) == len(default_run.outputs)
    for out in default_run.outputs:
        r = rq.loc[out.request_id]
        ts = [int(r[c]) for c in LIFECYCLE]
        assert ts == sorted(ts), (out.request_id, ts)
        assert r.engine_arrival_ns == out.arrival_ns and r.engine_first_token_ns == out.first_token_ns
        assert r.num_output_tokens == len(out.token_ids) and r.num_prompt_tokens == len(out.prompt_token_ids)
        assert r.num_preemptions == out.num_preemptions and r.num_cached_tokens == out.num_cached_tokens
        assert r.status == "finished_length" and r.finish_reason == "length"
        assert r.ttft_s == pytest.approx((out.first_token_ns - out.arrival_ns) / 1e9)
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1))
        assert r.itl_mean_s == pytest.approx(r.tpot_s) and r.itl_max_s >= r.itl_mean_s
        assert r.replica == 0 and r.num_steps >= r.num_output_tokens
        assert r.num_prefill_chunks >= 1
    # the workload was built to exercise these paths
    assert rq.num_preemptions.sum() > 0 and rq.num_cached_tokens.sum() > 0 and rq.num_prefill_chunks.max() > 1


def test_ttft_components_sum_to_ttft(bundle):
    rq = bundle.requests
    cols = [c for _, c in schema.TTFT_COMPONENTS] + ["ttft_residual_s"]
    total = rq[cols].sum(axis=1)
    assert ((total - rq.ttft_s).abs() <= 0.01 * rq.ttft_s).all()
    assert (rq[cols[:-1]] >= 0).all().all()
    assert (rq.ttft_gateway_queue_s == 0).all() and (rq.ttft_gateway_route_s == 0).all()  # offline
    # the breakdown labels every instant of the engine's window: nothing is left over
    assert (rq.ttft_residual_s.abs() < 1e-9).all()
    assert (rq.ttft_model_forward_s > 0).all() and (rq.ttft_engine_queue_s > 0).any()


def test_every_step_is_recorded(bundle, default_run):
    st = bundle.steps
    assert len(st) == default_run.num_steps
    assert list(st.step_id) == list(range(1, default_run.num_steps + 1))
    assert (st.end_ns >= st.start_ns).all() and (st.step_s > 0).all()
    phases = st[["schedule_s", "prepare_s", "forward_s", "sample_s", "output_s"]].sum(axis=1)
    assert (phases <= st.step_s * 1.001 + 1e-6).all()
    assert (st.num_batched_tokens == st.num_prefill_tokens + st.num_decode_tokens).all()
    assert (st.num_batched_tokens <= ENGINE["max_num_batched_tokens"]).all()
    assert (st.request_num_tokens.map(sum) == st.num_batched_tokens).all()
    assert (st.num_kv_blocks_total == ENGINE["num_kv_blocks"]).all()
    assert st.num_preemptions.sum() == bundle.requests.num_preemptions.sum()
    # every request's num_steps matches its membership in steps.request_ids
    counts = st.explode("request_ids").request_ids.value_counts()
    rq = bundle.requests.set_index("request_id")
    assert (counts.reindex(rq.index) == rq.num_steps).all()


def test_sampled_layer_times(bundle, default_run):
    ly = bundle.layers
    sampled = sorted(ly.step_id.unique())
    assert sampled == [s for s in range(1, default_run.num_steps + 1) if (s - 1) % ENGINE["layer_timing_interval"] == 0]
    names = set(ly.name)
    assert {"embed", "layers.0.attn", "layers.0.mlp", "layers.1.mlp", "norm", "lm_head", "sampler"} <= names
    assert (ly.duration_s > 0).all()


def test_one_trace_per_request(bundle):
    sp, rq = bundle.spans, bundle.requests
    assert set(sp.request_id) == set(rq.request_id)
    assert (sp.groupby("request_id").trace_id.nunique() == 1).all()
    assert (sp.groupby("trace_id").request_id.nunique() == 1).all()
    assert sp.trace_id.nunique() == len(rq)
    assert dict(zip(rq.request_id, rq.trace_id)) == dict(zip(sp.request_id, sp.trace_id))
    roots = sp[sp.parent_span_id.isna()]
    assert len(roots) == len(rq) and set(roots.name) == {"request"}
    kids = sp[sp.parent_span_id.notna()]
    assert set(kids.parent_span_id) <= set(roots.span_id)
    assert set(kids.layer) <= set(schema.LAYERS)
    assert {"engine.queue", "prefill", "decode"} <= set(kids.name)
    assert (sp.end_ns >= sp.start_ns).all()
    assert set(kids[kids.name == "engine.kv"].request_id) == set(rq[rq.num_preemptions > 0].request_id)
    for attrs in sp.attributes:
        assert isinstance(json.loads(attrs), dict)


def test_metrics_prom_holds_every_metric(bundle, default_run):
    text = bundle.metrics_text
    for m in METRICS:  # an offline run has no gateway: every metric an engine replica exposes, and only those
        assert (f"# TYPE {m.name} {m.type}" in text) == (exposed_by(m) != "gateway"), m.name
    n = len(default_run.outputs)
    assert f'layerscope_request_success_total{{finished_reason="length",model_name="tiny",replica="0"}} {n}.0' in text
    out_tokens = sum(len(o.token_ids) for o in default_run.outputs)
    assert f'layerscope_generation_tokens_total{{model_name="tiny",replica="0"}} {out_tokens}.0' in text
    assert f'layerscope_time_to_first_token_seconds_count{{model_name="tiny",replica="0"}} {n}.0' in text


def test_off_records_nothing(tiny_model, tmp_path):
    from layerscope.probes.offline import run_offline
    from tests.probes.conftest import params, prompts

    run = run_offline(tiny_model, prompts(3), params(3), tmp_path / "off", "off", **ENGINE)
    b = read_bundle(run.bundle, full=True)
    assert b.manifest["probes"] == "off"
    assert all(b.table(name).num_rows == 0 for name in schema.TABLES)
    assert len(run.outputs) == 3


# ---- broken bundles -------------------------------------------------------------------------------
@pytest.fixture
def copy(default_run, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(default_run.bundle, dst)
    return dst


def test_truncated_parquet(copy):
    f = copy / "steps.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(BundleError, match=r"steps\.parquet.*(corrupt|truncated)"):
        read_bundle(copy)


def test_missing_manifest(copy):
    (copy / "manifest.json").unlink()
    with pytest.raises(BundleError, match=r"manifest\.json: missing"):
        read_bundle(copy)


def test_future_schema_version(copy):
    m = json.loads((copy / "manifest.json").read_text())
    m["schema_version"] = schema.SCHEMA_VERSION + 1
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=r"manifest\.json: schema_version \d+ is newer"):
        read_bundle(copy)


def test_missing_table_and_column(copy):
    (copy / "layers.parquet").unlink()
    with pytest.raises(BundleError, match=r"layers\.parquet: missing table"):
        read_bundle(copy)
    t = pq.read_table(copy / "steps.parquet").drop_columns(["forward_s"])
    pq.write_table(t, copy / "layers.parquet")
    pq.write_table(t, copy / "steps.parquet")
    with pytest.raises(BundleError, match=r"steps\.parquet: column 'forward_s' is missing"):
        read_bundle(copy)


def test_bad_manifest_json_and_keys(copy):
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match=r"manifest\.json: corrupt manifest"):
        read_bundle(copy)
    (copy / "manifest.json").write_text(json.dumps({"format": schema.BUNDLE_FORMAT, "schema_version": 1}))
    with pytest.raises(BundleError, match=r"manifest\.json: missing keys run_id"):
        read_bundle(copy)


def test_not_a_directory(tmp_path):
    with pytest.raises(BundleError, match="nope: no such run bundle"):
        read_bundle(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(BundleError, match="file: not a directory"):
        read_bundle(tmp_path / "file")
    assert issubclass(BundleError, ValueError)


def test_duplicate_request_ids(copy):
    t = pq.read_table(copy / "requests.parquet")
    pq.write_table(pa.concat_tables([t, t.slice(0, 1)]), copy / "requests.parquet")
    with pytest.raises(BundleError, match="duplicate request ids"):
        read_bundle(copy, full=True)


def test_recorded_components_are_the_breakdown_diagnose_derives(default_run):
    """The writer stores what diagnose computes from the written tables: every stored component
    (ttft_*/e2e_*/tpot_* per layer, residuals, decode composition) equals what the breakdown derives
    from the steps' memberships (one function, not two that agree by luck)."""
    import numpy as np

    from layerscope.diagnose.decompose import request_breakdown
    from layerscope.diagnose.load import load_run
    from layerscope.probes.breakdown import STORED_COLUMNS, TTFT_COLUMNS
    from layerscope.probes.bundle import read_bundle

    stored = read_bundle(default_run.bundle).requests
    assert not np.isnan(stored[TTFT_COLUMNS].to_numpy(np.float64)).any()
    run = load_run(default_run.bundle)  # diagnose reads the requests without the stored columns
    derived = request_breakdown(run)
    assert not derived["ttft_recorded"].any()
    assert list(derived["request_id"]) == list(stored["request_id"])
    want = stored[STORED_COLUMNS].to_numpy(np.float64)
    assert not np.isnan(want).all(axis=0).any()  # every stored column holds values
    np.testing.assert_allclose(derived[STORED_COLUMNS].to_numpy(np.float64), want, rtol=0, atol=1e-12)


def test_write_refuses_to_clobber(tmp_path, default_run):
    from layerscope.probes.bundle import BundleWriter

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("mine")
    with pytest.raises(FileExistsError):
        BundleWriter(tmp_path / "x").write()
    assert (tmp_path / "x" / "keep").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    path = BundleWriter(tmp_path / "x", overwrite=True).write()
    assert not (path / "keep").exists() and read_bundle(path).manifest["summary"]["requests"] == 0
