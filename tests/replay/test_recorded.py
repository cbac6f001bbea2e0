"""The replay on a run recorded here (tiny model, the real gateway and engine): its prompt hashes,
its fidelity at a stated test tolerance, and one bounded ``whatif --verify`` end to end.

The tolerance here (a factor of 2.5, TTFT and E2E) is far looser than the fidelity benchmark's (docs/replay.md: p50
10 %, p90 20 %): this test records 18 requests on a shared 2-core machine, where one busy spell moves
a p50 by tens of percent (the benchmark's table shows 20-60 % misses under such load). What it must
catch is a replay wrong in kind (units, a lost phase, no prefix cache)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from layerscope.cli import main
from layerscope.probes import schema
from layerscope.probes.reader import read_bundle, read_manifest
from layerscope.replay.inputs import load_inputs
from layerscope.replay.metrics import mean_figures
from layerscope.replay.sim import replay

TEST_FACTOR = 2.5  # p50s of TTFT and E2E: replayed within a factor of 2.5 of measured


@pytest.fixture(scope="module")
def recorded(tiny_model, tmp_path_factory):
    from layerscope.api import run

    out = tmp_path_factory.mktemp("replay-recorded") / "run"
    return str(run(model=tiny_model, workload="agentic", out=out, workload_params={"num_sessions": 6,
                                                                                   "turns_per_session": 3}))


def test_prompt_hashes_are_recorded_and_shared_where_prompts_are(recorded):
    r = read_bundle(recorded).df("requests", columns=["num_prompt_tokens", "num_cached_tokens",
                                                      "prompt_block_hashes"])
    hashes = [list(h) for h in r["prompt_block_hashes"]]
    assert [len(h) for h in hashes] == list(r["num_prompt_tokens"] // schema.PREFIX_HASH_TOKENS)
    # agentic sessions share their agent's system prompt: first chunks repeat across requests
    firsts = [h[0] for h in hashes if h]
    assert len(set(firsts)) < len(firsts)
    # a request served from the prefix cache shares at least that many tokens' chunks with an earlier one
    seen: set[int] = set()
    for h, cached in zip(hashes, r["num_cached_tokens"]):
        if cached >= schema.PREFIX_HASH_TOKENS:
            assert h[0] in seen
        seen.update(h)


def test_replay_of_a_recorded_run_is_within_the_test_tolerance(recorded):
    inp = load_inputs(recorded)
    assert not inp.notes  # hashes recorded: no approximation
    figs = mean_figures([replay(inp.workload, inp.settings, inp.num_kv_blocks, inp.front, inp.cost, seed=k).figures
                         for k in range(3)])
    # TPOT is left out: the tiny model's per-token time is ~1 ms, and under load the gateway receives a
    # stalled first token late and the rest in a burst, which the replay's per-request output delays do
    # not model (docs/replay.md); its TPOT p50 has missed by x4 here
    for m in ("ttft_s", "e2e_s"):
        meas, rep = inp.measured[m]["p50"], figs[m]["p50"]
        assert meas / TEST_FACTOR <= rep <= meas * TEST_FACTOR, (m, meas, rep)
    assert abs(figs["prefix_hit_rate"] - inp.measured["prefix_hit_rate"]) < 0.05
    assert figs["preemptions"] == inp.measured["preemptions"] == 0


@pytest.mark.slow
def test_whatif_verify_runs_the_change_for_real(recorded, tmp_path, capsys):
    rc = main(["whatif", recorded, "--set", "max_num_seqs=2", "--verify", "--verify-out", str(tmp_path),
               "--seeds", "1", "--json"])
    point = json.loads(capsys.readouterr().out)["points"][0]
    v = point["verify"]
    assert rc == (0 if v["ok"] else 1)
    m = read_manifest(v["out"])
    base = read_manifest(recorded)
    assert m["config"]["max_num_seqs"] == 2 and m["workload"] == base["workload"]
    got = load_inputs(v["out"]).measured
    for row in v["rows"]:
        assert row["measured"] == pytest.approx(got[row["metric"]][row["pct"]])
        assert row["predicted"] == pytest.approx(point["predicted"][f"{row['metric']}:{row['pct']}"])
        assert np.isfinite(row["predicted"]) and row["predicted"] > 0
