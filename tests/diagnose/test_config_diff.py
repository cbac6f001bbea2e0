"""Config diff: the engine's config and diagnose read one key table (layerscope.contract); diffs name
key, values, layer."""

import json

from layerscope.diagnose.config_diff import CONFIG_DEFAULTS, CONFIG_LAYERS, config_diff, diff_records
from layerscope.diagnose.load import load_run


def test_engine_config_and_contract_cover_the_same_keys():
    """The engine builds its fields from the contract's table: every field has a row, every row a field."""
    from layerscope.engine.config import EngineConfig, config_keys, flatten_config  # the test may import it

    assert CONFIG_LAYERS == {k: v["layer"] for k, v in config_keys().items()}
    assert CONFIG_DEFAULTS == flatten_config(EngineConfig().to_dict())


def _with_config(path, **changes):
    m = json.loads((path / "manifest.json").read_text())
    for k, v in changes.items():
        if k.startswith("gateway."):
            m["config"]["gateway"][k.split(".", 1)[1]] = v
        else:
            m["config"][k] = v
    (path / "manifest.json").write_text(json.dumps(m))


def test_changed_default_names_key_values_and_layer(synth, tmp_path):
    import shutil
    from pathlib import Path

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(synth(seed=1), a)
    shutil.copytree(synth(seed=1), b)
    _with_config(b, max_num_batched_tokens=512)  # the new version's default; neither command line sets it
    rows = diff_records(config_diff(a, b))
    assert rows == [{"kind": "config", "key": "max_num_batched_tokens", "baseline": 2048, "candidate": 512,
                     "layer": "engine.queue", "baseline_source": "default", "candidate_source": "default",
                     "consistent": None}]
    assert Path(a).exists()


def test_gateway_keys_and_versions_and_hardware(synth, tmp_path):
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(synth(seed=1), a)
    shutil.copytree(synth(seed=1), b)
    _with_config(b, **{"gateway.max_concurrency": 8})
    m = json.loads((b / "manifest.json").read_text())
    m["versions"]["torch"] = "2.13.0"
    m["hardware"]["cpu"] = "other"
    (b / "manifest.json").write_text(json.dumps(m))
    df = config_diff(load_run(a), load_run(b)).set_index("key")
    assert df.loc["gateway.max_concurrency", "layer"] == "gateway.queue"
    assert df.loc["torch", "kind"] == "version" and df.loc["torch", "layer"] == "kernel.compute"
    assert df.loc["cpu", "kind"] == "hardware"


def test_config_files_json_and_toml(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"max_num_seqs": 64, "gateway": {"max_queue": 10}}))
    (tmp_path / "b.toml").write_text('max_num_seqs = 32\nenable_prefix_caching = false\n[gateway]\nmax_queue = 10\n')
    df = config_diff(tmp_path / "a.json", tmp_path / "b.toml").set_index("key")
    assert set(df.index) == {"max_num_seqs", "enable_prefix_caching"}
    assert df.loc["enable_prefix_caching", "baseline_source"] == "default"
    assert df.loc["enable_prefix_caching", "candidate_source"] == "set"
    assert df.loc["max_num_seqs", "layer"] == "engine.queue"


def test_unknown_key_in_config_file_is_an_error(tmp_path):
    import pytest

    from layerscope.diagnose.errors import RunError

    (tmp_path / "a.json").write_text(json.dumps({"max_num_seq": 64}))
    with pytest.raises(RunError, match="max_num_seq"):
        config_diff(tmp_path / "a.json", tmp_path / "a.json")


def test_manifest_config_layers_take_precedence(synth, tmp_path):
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(synth(seed=1), a)
    shutil.copytree(synth(seed=1), b)
    _with_config(b, max_num_seqs=8)
    m = json.loads((b / "manifest.json").read_text())
    m["config_layers"] = {"max_num_seqs": "engine.schedule"}  # a future engine moved the key
    (b / "manifest.json").write_text(json.dumps(m))
    assert config_diff(a, b).set_index("key").loc["max_num_seqs", "layer"] == "engine.schedule"


def test_change_text_says_where_each_value_came_from():
    from layerscope.diagnose.config_diff import change_text, source_text

    row = {"key": "block_size", "baseline": 16, "candidate": 128, "baseline_source": "default",
           "candidate_source": "default"}
    assert change_text(row) == "block_size 16 -> 128 (default changed)"
    assert change_text({**row, "baseline_source": "set"}) == "block_size 16 -> 128 (set -> default)"
    # a resolved value has no source: None from JSON, NaN from a DataFrame; neither is printed
    for missing in (None, float("nan")):
        resolved = {"key": "num_kv_blocks", "baseline": 32, "candidate": 4, "baseline_source": missing,
                    "candidate_source": missing}
        assert change_text(resolved) == "num_kv_blocks 32 -> 4"
        assert source_text(missing, missing) == ""


def test_kernel_choice_is_config_its_timings_are_not():
    """resolved.kernels: the measured choice is diffed (layer kernel.compute); the timings, the cache
    key and the CPU record behind it vary run to run and are not (same-software runs stay the same)."""
    from layerscope.diagnose.config_diff import config_diff

    def manifest(plan, choice, us, key):
        return {"resolved": {"kernels": {"plan": plan, "key": key, "cpu": {"model": key},
                                         "linear_decode_total_us": {"native": us},
                                         "ops": {"linear.qkv": {"choice": choice, "decode_us": {"native": us}}}}}}

    same = config_diff(manifest("native stack", "native", 3.0, "k1"), manifest("native stack", "native", 5.0, "k2"))
    assert same.empty
    d = config_diff(manifest("native stack", "native", 3.0, "k1"), manifest("per shape", "onednn", 3.0, "k1"))
    assert set(d["key"]) == {"kernels.plan", "kernels.ops.linear.qkv.choice"}
    assert set(d["layer"]) == {"kernel.compute"}
