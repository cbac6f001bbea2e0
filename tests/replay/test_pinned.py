"""The replay's results pinned: figures and splits of recorded pairs (tests/data, schema 2: no prompt
hashes, no CPU columns; tests/data/replay_pinned.json). A speed-up must leave every figure where it
was; a change of the replay's model must regenerate the file and say why. History: written by the
code of commit 1832dc8, and the speed-up left it unchanged; regenerated when the gateway/output path's
samples stopped being filtered to the requests handed to an idle replica (replay/inputs.py ``_front``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from layerscope.replay.inputs import load_inputs
from layerscope.replay.sim import replay
from layerscope.replay.split import shapley

DATA = Path(__file__).resolve().parents[1] / "data"
PINNED = json.loads((DATA / "replay_pinned.json").read_text())
PAIRS = sorted({k.split("/")[0] for k in PINNED})


def _figures(r) -> dict:
    f = r.figures
    return {"ttft": [f["ttft_s"][p] for p in ("p50", "p90", "p99")],
            "tpot": [f["tpot_s"][p] for p in ("p50", "p90", "p99")], "steps": f["num_steps"],
            "pre": f["preemptions"], "hit": f["prefix_hit_rate"], "e2e_sum": float(np.nansum(r.e2e_s))}


@pytest.mark.parametrize("pair", PAIRS)
def test_replays_and_split_are_where_they_were(pair):
    a, b = (load_inputs(str(DATA / pair / x)) for x in ("baseline", "candidate"))
    memo: dict = {}
    for name, inp in (("baseline", a), ("candidate", b)):
        for seed in (0, 1):
            r = replay(inp.workload, inp.settings, inp.num_kv_blocks, inp.front, inp.cost, seed=seed)
            got, want = _figures(r), PINNED[f"{pair}/{name}/{seed}"]
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (name, seed)
            # the block-hash memo a split shares across its replays changes nothing but the time
            again = replay(inp.workload, inp.settings, inp.num_kv_blocks, inp.front, inp.cost, seed=seed,
                           hash_memo=memo)
            for x, y in ((r.ttft_s, again.ttft_s), (r.e2e_s, again.e2e_s), (r.engine_s, again.engine_s)):
                assert np.array_equal(x, y, equal_nan=True)
    cf = shapley(a, b, seeds=(0, 1), workers=1)
    for key, (replayed, comps) in PINNED[f"{pair}/split"].items():
        s = cf["split"][key]
        assert s["replayed_delta"] == pytest.approx(replayed, rel=1e-9, abs=1e-12), key
        assert s["components"] == pytest.approx(comps, rel=1e-9, abs=1e-12), key
        assert sum(s["components"].values()) == pytest.approx(s["replayed_delta"], abs=1e-12)


def test_split_workers_give_the_same_split():
    a, b = (load_inputs(str(DATA / PAIRS[0] / x)) for x in ("baseline", "candidate"))
    one, two = shapley(a, b, seeds=(0,), workers=1), shapley(a, b, seeds=(0,), workers=2)
    assert one["split"] == two["split"]
