"""The TUI's overview from Polars aggregates (diagnose/request_scan.py) against the full report
(report.summarize over the loaded run), and the paged request table against the request table
of the full analysis and against the bundle's files read independently (pyarrow + numpy)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from layerscope.diagnose.analysis import RunAnalysis
from layerscope.diagnose.errors import RunError
from layerscope.diagnose.load import load_run
from layerscope.diagnose.report import summarize
from layerscope.diagnose.request_scan import RequestPages, RequestScan
from layerscope.testing.synth import SynthSpec, generate
from layerscope.diagnose.views import open_run, request_table, sort_requests
from layerscope.diagnose.tui.request_table import SORTABLE

from .conftest import DATA

OVERVIEW_KEYS = ("run", "path", "workload", "requests", "requests_finished", "duration_s", "output_tokens_per_s",
                 "goodput_requests_per_s", "slo", "latency", "client_latency", "time_shares", "slowest")


def _reject(bundle, every: int = 7) -> None:
    """Mark every ``every``-th request of each requests file rejected at the gateway: no E2E, no
    components, no engine times (as a gateway-rejected row has)."""
    files = sorted((bundle / "requests.parquet").glob("part-*.parquet")) if (bundle / "requests.parquet").is_dir() \
        else [bundle / "requests.parquet"]
    for f in files:
        t = pq.read_table(f)
        n = t.num_rows
        hit = np.zeros(n, bool)
        hit[::every] = True
        cols = {}
        for name in t.column_names:
            c = t.column(name)
            if name == "status":
                c = pa.array(np.where(hit, "rejected", c.to_numpy(zero_copy_only=False)), c.type)
            elif name.startswith(("e2e", "tpot", "ttft", "engine_", "client_e2e")) or name in (
                    "num_decode_steps", "num_mixed_steps", "mean_batch_seqs"):
                c = pc.if_else(pa.array(hit), pa.nulls(n, c.type), c)
            cols[name] = c
        pq.write_table(pa.table(cols, schema=t.schema), f)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("scan")
    single = generate(SynthSpec(num_requests=400, arrival_rate_per_s=120.0, num_kv_blocks=120, replicas=2),
                      root / "single", run_id="single")
    parts = generate(SynthSpec(num_requests=600, arrival_rate_per_s=80.0, segment_requests=200), root / "parts",
                     run_id="parts")
    rejected = root / "rejected"
    shutil.copytree(parts, rejected)
    _reject(rejected)
    slo = root / "slo"
    shutil.copytree(single, slo)
    m = json.loads((slo / "manifest.json").read_text())
    m["workload"]["slo_ttft_s"], m["workload"]["slo_e2e_s"] = 0.05, 1.0
    (slo / "manifest.json").write_text(json.dumps(m))
    return {"single": single, "parts": parts, "rejected": rejected, "slo": slo}


def _same(a, b, where="") -> None:
    """Equal up to float rounding (sums may be added in another order), recursively."""
    if isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and (a == pytest.approx(b, rel=1e-9, abs=1e-15)
                                                    or (math.isnan(a) and math.isnan(b))), (where, a, b)
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("name", ["single", "parts", "rejected", "slo"])
def test_overview_from_aggregates_is_the_report(bundles, name):
    fast = RequestScan.open(bundles[name]).overview()
    assert fast is not None and fast["findings"] is None
    full = summarize(RunAnalysis(load_run(bundles[name])))
    _same({k: fast[k] for k in OVERVIEW_KEYS}, {k: full[k] for k in OVERVIEW_KEYS})
    if name == "rejected":
        assert fast["requests"] == 600 and fast["requests_finished"] < 600
    if name == "slo":
        assert fast["slo"] == {"ttft_s": 0.05, "e2e_s": 1.0}
    else:
        assert set(fast["slo"]) == {"ttft_s", "tpot_s"}  # 2x the run's own p90


def test_open_run_is_fast_only_with_stored_components(bundles):
    fast = open_run(bundles["parts"])
    assert fast.scan is not None and not fast.has_summary and fast.overview["requests"] == 600
    assert fast.summary["findings"] is not None and fast.has_summary  # the full report, on first use
    golden = open_run(DATA / "gateway_preemption_tp")  # schema version 1: no stored components
    assert golden.scan is None and golden.has_summary and golden.overview is golden.summary


def test_duplicate_request_ids_fail_at_open(bundles, tmp_path):
    bad = tmp_path / "dup"
    shutil.copytree(bundles["parts"], bad)
    first = bad / "requests.parquet" / "part-000001.parquet"
    second = bad / "requests.parquet" / "part-000002.parquet"
    t1, t2 = pq.read_table(first), pq.read_table(second)
    ids = t2.column("request_id").to_pylist()
    ids[0] = t1.column("request_id")[0].as_py()
    pq.write_table(t2.set_column(t2.schema.get_field_index("request_id"), "request_id", pa.array(ids)), second)
    with pytest.raises(RunError, match="duplicate request ids"):
        open_run(bad)


@pytest.mark.parametrize("name", ["single", "rejected"])
def test_pages_are_the_request_table_in_every_sort(bundles, name):
    pages = RequestScan.open(bundles[name]).pages()
    pages.page_rows = 128
    ref = request_table(RunAnalysis(load_run(bundles[name])))
    assert pages.table.columns == list(ref.columns)
    for column in SORTABLE:
        for descending in (True, False):
            pages.select((column, descending))
            got = [pages.page(i) for i in range(pages.num_pages)]
            want = sort_requests(ref, column, descending)
            assert [len(g) for g in got[:-1]] == [128] * (pages.num_pages - 1)
            ids = [x for g in got for x in g["request_id"]]
            assert ids == want["request_id"].tolist(), (column, descending)
    layer, e2e_ms = ref["dominant_layer"].mode()[0], round(1000 * ref["e2e_s"].median())
    pages.select(("ttft_s", True), f"e2e>{e2e_ms}ms layer:{layer.split('.')[-1]}")
    rows = [x for i in range(pages.num_pages) for x in pages.page(i)["request_id"]]
    want = ref[(ref["e2e_s"] > e2e_ms / 1000) & ref["dominant_layer"].fillna("").str.contains(layer.split(".")[-1])]
    assert rows == sort_requests(want, "ttft_s", True)["request_id"].tolist() and rows


def test_last_page_against_the_files_read_independently(bundles):
    """The slowest-first order and its last page, worked out from the Parquet parts with pyarrow."""
    files = sorted((bundles["rejected"] / "requests.parquet").glob("part-*.parquet"))
    t = pa.concat_tables([pq.read_table(f, columns=["request_id", "e2e_s"]) for f in files])
    ids = np.asarray(t.column("request_id").to_pylist(), dtype=object)
    e2e = t.column("e2e_s").to_numpy(zero_copy_only=False).astype(np.float64)
    known, missing = np.flatnonzero(~np.isnan(e2e)), np.flatnonzero(np.isnan(e2e))
    expected = list(ids[known[np.argsort(-e2e[known], kind="stable")]]) + list(ids[missing])
    pages = RequestPages(RequestScan.open(bundles["rejected"]).pages().table, page_rows=97)
    pages.select(("e2e_s", True))
    last = pages.page(pages.num_pages - 1)
    assert pages.num_pages == -(-600 // 97) and len(last) == 600 - 97 * (pages.num_pages - 1)
    assert last["request_id"].tolist() == expected[97 * (pages.num_pages - 1):]
    assert last["e2e_s"].isna().all()  # the rejected ones: no E2E, last
    order_ids = pages.order()
    assert len(order_ids) == 600 and order_ids[0] == expected[0] and order_ids.index(expected[-1]) == 599
    assert expected[5] in order_ids and "nope" not in order_ids
