"""layerscope diagnose / config-diff: output formats and exit codes."""

import json
import shutil

import pytest

from layerscope.cli import main


def test_single_run_json_and_terminal(synth, capsys):
    run = synth(seed=1, num_kv_blocks=120)
    assert main(["diagnose", run, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["schema"] == "layerscope.run-report/1"
    assert rep["latency"]["ttft_s"]["count"] == 400
    assert {f["detector"] for f in rep["findings"]} >= {"kv_pressure"}
    assert rep["slowest"][0]["dominant_layer"]
    assert main(["diagnose", run]) == 0
    out = capsys.readouterr().out
    assert "where time goes" in out and "KV pressure" in out


def test_pair_json_markdown_and_terminal(synth, capsys):
    a, b = synth(seed=1), synth(seed=1, noise_seed=2, output_delay_s=0.002)
    assert main(["diagnose", a, b, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "regression" and d["primary"]["layer"] == "engine.output"
    assert main(["diagnose", a, b, "--markdown"]) == 0
    md = capsys.readouterr().out
    assert "**verdict: REGRESSION**" in md and "| metric | baseline |" in md
    assert main(["diagnose", a, b]) == 0
    assert "engine.output" in capsys.readouterr().out


def test_slo_options_set_goodput(synth, capsys):
    run = synth(seed=1)
    assert main(["diagnose", run, "--json", "--slo-ttft", "1e-9"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["goodput_requests_per_s"] == 0 and rep["slo"] == {"ttft_s": 1e-9}


@pytest.mark.parametrize("damage", ["missing", "no_manifest", "bad_json", "bad_version", "truncated_parquet",
                                    "missing_table", "wrong_column_type"])
def test_bad_bundle_is_a_clear_error_exit_2(synth, tmp_path, capsys, damage):
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    shutil.copytree(synth(seed=1), run)
    if damage == "missing":
        shutil.rmtree(run)
    elif damage == "no_manifest":
        (run / "manifest.json").unlink()
    elif damage == "bad_json":
        (run / "manifest.json").write_text("{not json")
    elif damage == "bad_version":
        m = json.loads((run / "manifest.json").read_text())
        m["schema_version"] = 99
        (run / "manifest.json").write_text(json.dumps(m))
    elif damage == "truncated_parquet":
        data = (run / "steps.parquet").read_bytes()
        (run / "steps.parquet").write_bytes(data[: len(data) // 2])
    elif damage == "missing_table":
        (run / "layers.parquet").unlink()
    elif damage == "wrong_column_type":
        t = pq.read_table(run / "requests.parquet")
        t = t.set_column(t.column_names.index("ttft_s"), "ttft_s", pa.array([str(x) for x in t["ttft_s"].to_pylist()]))
        pq.write_table(t, run / "requests.parquet")
    assert main(["diagnose", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("layerscope: error: ") and str(run) in err
    assert main(["diagnose", synth(seed=1), str(run), "--json"]) == 2


def test_config_diff_command(synth, tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps({"max_num_seqs": 64}))
    (tmp_path / "b.json").write_text(json.dumps({"max_num_seqs": 8}))
    assert main(["config-diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["config_diff"]
    assert rows[0]["key"] == "max_num_seqs" and rows[0]["layer"] == "engine.queue"
    assert main(["config-diff", synth(seed=1), synth(seed=1, max_num_seqs=8)]) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs" in out and "engine.queue" in out
    assert main(["config-diff", str(tmp_path / "nope.json"), str(tmp_path / "b.json")]) == 2
