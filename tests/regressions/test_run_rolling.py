"""``layerscope run`` with serve's rolling options: the bundle written as the run goes, in parts
that read back with every request (engine, gateway and client sides joined), the same rows as the
one bundle a plain run writes at the end; what was written leaves the recorders (each drain holds
a few requests, not the run); a run killed with SIGKILL leaves a bundle that loads up to its last
part and says it was cut short."""

from __future__ import annotations

import json
import os
import signal
import time

import pyarrow.parquet as pq
import pytest

from benchmarks.serve_soak import start_layerscope
from layerscope.probes.reader import read_bundle
from layerscope.probes.rolling import PART_NAME

N = 48
WORKLOAD = ["--workload", "chat", "--num-requests", str(N), "--rate", "12", "--seed", "5", "--concurrency", "4"]
ENGINE = ["--set", "max_num_seqs=4"]


def _num_rows(drain) -> int:
    """Request records a recorder handed over in one drain (the gateway's: Arrow bytes; a replica's: raw)."""
    from layerscope.probes.bundle import table_from_bytes

    if drain is None:
        return 0
    if isinstance(drain, dict):
        return table_from_bytes(drain["tables"]["requests"]).num_rows
    return len(drain.requests_raw) + len(drain.request_rows)


@pytest.fixture(scope="module")
def rolling_run(tiny_model, tmp_path_factory):
    """A real ``layerscope run`` (in this process) with a part every 0.4 s or 6 requests; every drain
    of the gateway is watched: how many request records each recorder handed over, and how many
    GatewayRecords the gateway kept meanwhile."""
    from layerscope.cli import main
    from layerscope.engine.gateway.gateway import Gateway

    drains: list[tuple[int, int, int]] = []  # (gateway's rows, replicas' rows, len(gateway.records))
    original = Gateway.drain_records

    def watched(self, *a, **kw):
        gw, reps = original(self, *a, **kw)
        drains.append((_num_rows(gw), sum(_num_rows(d) for d in reps), len(self.records)))
        return gw, reps

    out = tmp_path_factory.mktemp("rolling") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Gateway, "drain_records", watched)
        rc = main(["run", "--model", str(tiny_model), *WORKLOAD, *ENGINE, "--out", str(out),
                   "--bundle-interval", "0.4", "--bundle-max-requests", "6"])
    assert rc == 0
    return out, drains


def test_a_rolling_run_writes_parts_that_read_back_with_every_request(rolling_run):
    out, _ = rolling_run
    b = read_bundle(out)
    assert b.complete and b.note is None and b.parts >= 4
    req = b.table("requests").to_pandas()
    assert len(req) == req["request_id"].nunique() == N
    for col in ("client_send_ns", "client_ttft_s", "gateway_arrival_ns", "gateway_finished_ns", "engine_arrival_ns",
                "ttft_s", "ttft_gateway_queue_s", "trace_id"):
        assert req[col].notna().all(), col  # every side joined, the stored components computed
    assert (req["status"] == "finished_length").all() and (req["http_status"] == 200).all()
    # written as the run went: the requests are spread over the parts, not all in the last one
    per_part = [pq.read_metadata(out / "requests.parquet" / PART_NAME.format(k)).num_rows
                for k in range(1, b.parts + 1)]
    assert sum(per_part) == N and sum(n > 0 for n in per_part) >= 3 and per_part[-1] < N // 2
    m = b.manifest
    assert m["summary"]["requests"] == N and m["summary"]["client"]["requests_ok"] == N
    assert "--bundle-interval" in m["command"] and m["machine"]["num_samples"] > 0
    assert (out / "machine.parquet").is_file()


def test_the_recorders_hold_a_few_requests_at_a_time_not_the_run(rolling_run):
    _, drains = rolling_run
    gateway_rows, replica_rows, kept = zip(*drains)
    assert sum(gateway_rows) == sum(replica_rows) == N  # every request left each recorder in some drain ...
    assert max(gateway_rows) <= N // 2 and max(replica_rows) <= N // 2  # ... a few at a time
    assert set(kept) == {0}  # and the gateway kept no per-request record of its own (a plain run: one per request)


def test_the_parts_hold_the_rows_a_plain_run_writes_at_the_end(rolling_run, tiny_model, tmp_path):
    import layerscope

    out, _ = rolling_run
    plain = layerscope.run(model=tiny_model, workload="chat", out=tmp_path / "plain", config={"max_num_seqs": 4},
                           workload_params={"num_requests": N, "rate": 12, "seed": 5, "max_concurrency": 4})
    assert not (plain / "requests.parquet").is_dir()  # the default stays one bundle at the end
    a, b = read_bundle(plain).table("requests").to_pandas(), read_bundle(out).table("requests").to_pandas()
    tokens = ["num_prompt_tokens", "num_output_tokens"]  # the same seeded workload, ignore_eos
    assert sorted(map(tuple, a[tokens].values.tolist())) == sorted(map(tuple, b[tokens].values.tolist()))
    filled = [c for c in a.columns if a[c].notna().all()]
    assert len(filled) > 30 and [c for c in filled if not b[c].notna().all()] == []


def test_a_killed_run_leaves_a_bundle_that_loads_up_to_its_last_part(tiny_model, tmp_path):
    out = tmp_path / "killed"
    proc, lines = start_layerscope(
        ["run", "--model", str(tiny_model), "--workload", "chat", "--num-requests", "2000", "--rate", "10",
         "--seed", "1", "--concurrency", "4", *ENGINE, "--out", str(out), "--bundle-interval", "0.3"],
        ready="rolling bundle")
    try:
        deadline = time.monotonic() + 120
        while True:  # a few parts with requests in them, then the kill
            m = json.loads((out / "manifest.json").read_text())
            if m["parts"] >= 4 and m["summary"]["requests"] >= 5:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-20:])
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its replicas at once: nothing closes the bundle
        proc.wait(30)
    b = read_bundle(out)
    assert not b.complete and b.parts >= 4 and b.note.startswith("still recording or cut short")
    req = b.table("requests").to_pandas()
    assert len(req) == req["request_id"].nunique() == b.manifest["summary"]["requests"] >= 5
    assert req["gateway_finished_ns"].notna().all() and req["client_send_ns"].notna().all()
    assert "client" not in b.manifest["summary"]  # the client's summary comes with the last part only


@pytest.mark.parametrize("extra, words", [
    (["--probes", "off", "--bundle-interval", "1"], "with --probes off there is none"),
    (["--bundle-interval", "0"], "--bundle-interval must be > 0 seconds"),
    (["--bundle-max-requests", "-1"], "--bundle-max-requests must be >= 0"),
    (["--retention", "6 parsecs"], "6h, 30m, 2d"),
])
def test_bad_rolling_options_are_refused_before_anything_starts(tiny_model, tmp_path, capsys, extra, words):
    from layerscope.cli import main

    t0 = time.monotonic()
    assert main(["run", "--model", str(tiny_model), *WORKLOAD, "--out", str(tmp_path / "r"), *extra]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and time.monotonic() - t0 < 20
