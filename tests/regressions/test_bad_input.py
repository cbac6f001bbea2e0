"""Bad input where a user types it: a workload file with an unknown key or a negative value,
and a ``--model`` that is not a model directory. Each error names what exists (issue 18)."""

from __future__ import annotations

import json

import pytest

from layerscope.cli import main
from layerscope.regressions.load.workloads import WorkloadError, load_workload


# ---- workload files ------------------------------------------------------------------------------
def test_a_workload_file_with_an_unknown_key_names_the_key_the_file_and_the_known_keys(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('base = "chat"\nnum_requests = 5\nrat = 2.5\n')
    with pytest.raises(WorkloadError) as e:
        load_workload(str(f))
    msg = str(e.value)
    assert str(f) in msg and "unknown workload field 'rat'" in msg
    assert "did you mean 'rate'?" in msg
    assert "known: name, kind, seed, num_requests, rate," in msg
    f = tmp_path / "nobase.json"
    f.write_text(json.dumps({"num_requests": 2, "max_tokenz": 3, "requests": [{"prompt": "hi"}]}))
    with pytest.raises(WorkloadError, match=r"nobase.json: unknown workload field 'max_tokenz'.*known: "):
        load_workload(str(f))


def test_an_unknown_key_in_a_request_table_lists_the_request_keys(tmp_path):
    f = tmp_path / "explicit.toml"
    f.write_text('[[requests]]\nprompt = "hello"\nmax_token = 3\n')
    with pytest.raises(WorkloadError, match=r"request 0: unknown keys \['max_token'\]; known: prompt, messages, "
                                            r"max_tokens,"):
        load_workload(str(f)).build()


@pytest.mark.parametrize("key, value", [("rate", -1.0), ("ramp_up_s", -2.0), ("max_concurrency", -1),
                                        ("think_time_s", -0.1), ("burst_interval_s", -1.0), ("temperature", -0.5),
                                        ("slo_ttft_s", 0.0), ("rate", float("nan"))])
def test_a_negative_value_in_a_workload_file_is_an_error_naming_the_key(tmp_path, key, value):
    f = tmp_path / "neg.json"
    f.write_text(json.dumps({"base": "chat", key: value}))
    with pytest.raises(WorkloadError) as e:
        load_workload(str(f))
    assert str(e.value).startswith(f"workload file {f}: {key} must be ")
    assert f"got {value}" in str(e.value)


def test_rate_zero_still_means_all_at_once_and_the_message_says_so(tmp_path):
    assert {r.arrival_s for r in load_workload("chat", rate=0, num_requests=4).build()} == {0.0}
    with pytest.raises(WorkloadError, match=r"rate must be >= 0, got -3 \(0 = all requests at t=0\)"):
        load_workload("chat", rate=-3)


def test_a_bad_workload_file_on_the_command_line_is_exit_2_with_the_message(tmp_path, capsys):
    f = tmp_path / "neg.toml"
    f.write_text('base = "chat"\nrate = -4\n')
    rc = main(["bench", "--endpoint", "http://127.0.0.1:9", "--workload", str(f), "--out", str(tmp_path / "o")])
    assert rc == 2
    assert f"layerscope: error: workload file {f}: rate must be >= 0, got -4" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_workload_file_that_is_not_toml_names_the_file(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("rate = = 3\n")
    with pytest.raises(WorkloadError, match=f"workload file {f}: "):
        load_workload(str(f))


# ---- --model ------------------------------------------------------------------------------------
def test_model_that_does_not_exist_says_so_and_lists_the_model_directories_beside_it(tiny_model, capsys):
    missing = tiny_model.parent / "tiny-typo"
    assert main(["generate", "--model", str(missing), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"{missing}: no such directory" in err and "not a hub id" in err
    assert f"model directories in {tiny_model.parent}: tiny" in err
    assert "Repo id" not in err  # the tokenizer's hub-id error no longer surfaces


def test_model_that_looks_like_a_hub_id_is_not_looked_up(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--model", "Qwen/Qwen3-0.6B", "--workload", "chat", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Qwen/Qwen3-0.6B: no such directory (a model is a local Hugging Face-format directory, not a hub id" in err


def test_model_that_is_a_file_or_a_folder_without_config_names_what_is_there(tiny_model, tmp_path, capsys):
    assert main(["generate", "--model", str(tiny_model / "config.json"), "--prompt", "hi"]) == 2
    assert f"is a file, not a model directory (the model directory is {tiny_model}?)" in capsys.readouterr().err
    (tmp_path / "weights.bin").write_text("x")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert f"{tmp_path}: no config.json (expected a Hugging Face-format model directory; it holds: weights.bin)" \
        in capsys.readouterr().err


def test_bench_tokenizer_that_does_not_exist_says_so(tmp_path, capsys):
    rc = main(["bench", "--endpoint", "http://127.0.0.1:9", "--tokenizer", str(tmp_path / "nope"), "--workload",
               "chat", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert f"{tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
