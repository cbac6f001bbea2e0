"""Every vendored external pair, both ways: the verdict and the metric that leads (docs/diagnose.md §2.8).

The server's TPOT histogram was made a compared metric, and a stand-in for an unmeasurable client TPOT,
after seeing the small cap pair (layerscope-dialect-cap); these are the pairs it was not written for,
pinned so that a later rule's effect on them shows. Each row: (baseline, candidate) -> (verdict, primary
metric or None)."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerscope.cli import main
from layerscope.diagnose.external.analysis import compare_external

DATA = Path(__file__).resolve().parents[1] / "data" / "external"
AA, CAP = DATA / "layerscope-dialect-burst-aa", DATA / "layerscope-dialect-cap"
V0101, V032, V085 = DATA / "vllm-0.10.1.1-cpu-v1", DATA / "vllm-0.32.0-cpu", DATA / "vllm-0.8.5-cpu-v0"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The /metrics-only and `bench serve` imports of the vendored recordings, made once."""
    root = tmp_path_factory.mktemp("vendored")

    def metrics(name: str, rec: Path, after: str, log: Path | None = None) -> Path:
        argv = ["import", "metrics", str(rec / "metrics_before.prom"), str(rec / after), "--out", str(root / name)]
        assert main(argv + (["--server-log", str(log)] if log else [])) == 0
        return root / name

    def bench(name: str, rec: Path) -> Path:
        assert main(["import", "vllm-bench", str(rec / "bench_serve.json"), "--out", str(root / name), "--metrics",
                     str(rec / "metrics_after.prom"), str(rec / "metrics_bench_serve_after.prom"), "--server-log",
                     str(rec / "server.log")]) == 0
        return root / name

    return {"aa-a": metrics("aa-a", AA / "a", "metrics.prom"), "aa-b": metrics("aa-b", AA / "b", "metrics.prom"),
            "m0101": metrics("m0101", V0101, "metrics_after.prom", V0101 / "server.log"),
            "m032": metrics("m032", V032, "metrics_after.prom", V032 / "server.log"),
            "b0101": bench("b0101", V0101), "b085": bench("b085", V085)}


PAIRS = [  # (a, b, verdict a->b, primary metric a->b, verdict b->a, primary metric b->a)
    (AA / "a", AA / "b", "no_change", None, "no_change", None),
    ("aa-a", "aa-b", "regression", "server_prefill_time_mean_s", "improvement", "server_prefill_time_mean_s"),
    ("m0101", "m032", "regression", "server_tpot_mean_s", "improvement", "server_decode_time_mean_s"),
    ("b0101", "b085", "no_change", None, "no_change", None),
    (CAP / "default", CAP / "seqs2", "mixed", "server_queue_time_mean_s", "regression", "server_tpot_mean_s"),
]


@pytest.mark.parametrize("a,b,v_ab,p_ab,v_ba,p_ba", PAIRS, ids=["aa-clients", "aa-metrics", "vllm-0.10-0.32-metrics",
                                                                "vllm-0.10-0.8.5-bench", "small-cap-clients"])
def test_each_vendored_pair_both_ways(imported, a, b, v_ab, p_ab, v_ba, p_ba):
    a, b = imported.get(a, a), imported.get(b, b)
    for x, y, verdict, lead in ((a, b, v_ab, p_ab), (b, a, v_ba, p_ba)):
        d = compare_external(x, y)
        table = {k: (round(v["delta_pct"]), v["significant"]) for k, v in d["metrics"].items() if v["significant"]}
        assert d["verdict"] == verdict, (Path(x).name, Path(y).name, table)
        assert (d["primary"] or {}).get("metric") == lead, (d["primary"], table)
