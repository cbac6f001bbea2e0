"""A concurrency cap is a trade-off (issue 36): added, TTFT worse and per-token latency better; removed,
the reverse. On our server in vLLM's dialect (tests/data/external/README.md, layerscope-dialect-cap-long:
max_num_seqs 64 -> 2 under one burst of 48 with 64-token outputs), both ways ``mixed``, TTFT's finding on
engine.queue. The per-token side is read from the client where it could measure it, else from the
server's TPOT histogram (external.analysis.STAND_IN: the client's token gaps were bunched). The same pair on a
REAL vLLM 0.32 (vllm-0.32.0-cpu-cap, recorded after that rule was written: a case it was not fitted to) reads
the same way, its per-token side from the server's histogram (99.6 % of the capped run's client gaps were
under 0.1 ms: vLLM's API server, short of CPU, sent each answer in one piece)."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerscope.diagnose.external.analysis import compare_external
from layerscope.diagnose.headline import worse_and_better

DATA = Path(__file__).resolve().parents[1] / "data" / "external"
CAP = DATA / "layerscope-dialect-cap-long"
VLLM_CAP = DATA / "vllm-0.32.0-cpu-cap"


def contradicts(d: dict) -> str | None:
    """Why the headline contradicts the deciding metrics of its own table, or None."""
    worse, better = worse_and_better(d["metrics"], lambda k: d["metrics"][k].get("decides", True))
    want = "mixed" if worse and better else "regression" if worse else "improvement" if better else "no_change"
    return None if d["verdict"] == want else f"{d['verdict']} with worse={worse} better={better}"


def per_token(d: dict) -> tuple[str, dict]:
    """The per-token metric that decided: the client's TPOT p50, or the server's where the client's was not measurable."""
    m = d["metrics"]
    name = "server_tpot_mean_s" if m["tpot_p50_s"].get("unreliable") else "tpot_p50_s"
    assert m[name]["decides"], name
    return name, m[name]


def _table(d: dict) -> dict:
    return {k: (round(v["delta_pct"]), v["significant"], v.get("decides")) for k, v in d["metrics"].items()}


@pytest.mark.parametrize("added", [True, False], ids=["cap-added", "cap-removed"])
def test_a_cap_added_or_removed_is_mixed_with_ttft_on_engine_queue(added):
    a, b = CAP / "default", CAP / "seqs2"
    d = _check_tradeoff(a, b, added)
    ttft = [f for f in d["findings"] if f["metric"] == "ttft_p50_s"]
    assert ttft[0]["cause"].startswith("admission capped" if added else "admission cap lifted"), ttft[0]["cause"]


@pytest.mark.parametrize("added", [True, False], ids=["cap-added", "cap-removed"])
def test_the_same_cap_on_a_real_vllm_is_mixed_with_ttft_on_engine_queue(added):
    d = _check_tradeoff(VLLM_CAP / "default", VLLM_CAP / "seqs2", added)
    assert d["metrics"]["tpot_p50_s"].get("unreliable"), "the client's TPOT was measurable: not the stand-in case"


def test_without_the_stand_in_the_real_vllm_cap_is_one_sided(monkeypatch):
    """What the stand-in decides: with no server measure in place of the client's unmeasurable TPOT, the
    real vLLM pair shows only the cap's cost (a regression) or only its gain (an improvement)."""
    from layerscope.diagnose.external import analysis

    monkeypatch.setattr(analysis, "STAND_IN", {})
    a, b = VLLM_CAP / "default", VLLM_CAP / "seqs2"
    assert compare_external(a, b)["verdict"] == "regression"
    assert compare_external(b, a)["verdict"] == "improvement"


def _check_tradeoff(a: Path, b: Path, added: bool) -> dict:
    d = compare_external(*((a, b) if added else (b, a)))
    m = d["metrics"]
    assert d["verdict"] == "mixed" and contradicts(d) is None, _table(d)
    assert m["ttft_p50_s"]["significant"] and m["ttft_p50_s"]["worse"] is added, _table(d)
    name, tok = per_token(d)
    assert tok["significant"] and tok["worse"] is not added, _table(d)
    ttft = [f for f in d["findings"] if f["metric"] == "ttft_p50_s"]
    assert ttft and ttft[0]["layer"] == "engine.queue", ttft[:1]
    assert "max_num_seqs" in [c["key"] for c in d["config_diff"]]
    # the cost of the trade-off leads: TTFT's queue with the cap, the per-token time without it
    assert d["primary"] == ({"metric": "ttft_p50_s", "layer": "engine.queue"} if added else
                            {"metric": name, "layer": "model.forward"}), d["primary"]
    return d


def test_the_same_checks_fail_on_an_aa_pair():
    """The assertions above can fail: two identical bursts of one server (layerscope-dialect-burst-aa)
    are not a trade-off."""
    aa = DATA / "layerscope-dialect-burst-aa"
    d = compare_external(aa / "a", aa / "b")
    assert d["verdict"] != "mixed" and not d["metrics"]["ttft_p50_s"]["significant"], _table(d)
