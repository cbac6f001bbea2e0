"""Suite files: the shipped suites load; every kind of mistake is a SuiteError naming the key."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from layerscope.regressions.suite import METRICS, SuiteError, load_suite, resolve_suite_path
from layerscope.regressions.load.workloads import load_workload

MINIMAL = """
name = "t"
[[workloads]]
workload = "burst"
"""


def write(tmp_path: Path, text: str, name: str = "suite.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


@pytest.mark.parametrize("name", ["smoke", "full"])
def test_shipped_suites_load(name):
    s = load_suite(name)
    assert s.name == name
    assert s.path == resolve_suite_path(name).resolve()
    assert set(s.thresholds) == set(METRICS)  # every metric is gated in the shipped suites
    assert s.repetitions >= 2 and s.workloads and s.configs
    for w in s.workloads:  # what layerscope run reads builds the same spec
        data = w.spec_data(s.slo)
        base = data.pop("base")
        data.pop("name")
        spec = load_workload(base, **data)
        assert spec.seed == w.seed


def test_minimal_suite_defaults(tmp_path):
    s = load_suite(write(tmp_path, MINIMAL))
    assert (s.model.arch, s.model.preset, s.model.seed, s.model.path) == ("llama", "tiny", 0, None)
    assert s.configs == {"default": {}}
    assert s.repetitions == 2 and s.thresholds == {} and s.slo == {}
    assert [w.name for w in s.workloads] == ["burst"]
    assert len(s.digest) == 12


def test_workload_file_relative_to_suite(tmp_path):
    (tmp_path / "wl").mkdir()
    (tmp_path / "wl" / "mine.toml").write_text('base = "chat"\nnum_requests = 5\n')
    s = load_suite(write(tmp_path, """
        [[workloads]]
        workload = "wl/mine.toml"
        seed = 7
        params = { rate = 3.0 }
        [slo]
        ttft_s = 0.5
    """))
    w = s.workloads[0]
    assert w.name == "mine" and Path(w.workload) == (tmp_path / "wl" / "mine.toml").resolve()
    data = w.spec_data(s.slo)
    assert data == {"base": "chat", "num_requests": 5, "name": "mine", "seed": 7, "rate": 3.0, "slo_ttft_s": 0.5}
    f = tmp_path / "out.json"
    f.write_text(json.dumps(data))
    spec = load_workload(str(f))
    assert (spec.num_requests, spec.seed, spec.rate, spec.slo_ttft_s) == (5, 7, 3.0, 0.5)


@pytest.mark.parametrize("text, message", [
    (MINIMAL + "colour = 1\n", "unknown key 'colour'"),
    (MINIMAL + "[model]\nsize = 3\n", "[model]: unknown key 'size'"),
    (MINIMAL + "[model]\npreset = 'huge'\n", "unknown model llama/huge"),
    (MINIMAL + "[model]\npath = 'nowhere'\n", "not a checkpoint directory"),
    (MINIMAL + "[thresholds]\nttft_p42_s = 10\n", "[thresholds]: unknown key 'ttft_p42_s'"),
    (MINIMAL + "[thresholds]\nttft_p50_s = -1\n", "percentage >= 0"),
    (MINIMAL + "[slo]\nlatency = 1\n", "[slo]: unknown key 'latency'"),
    (MINIMAL + "[configs.x]\nmax_num_seqz = 2\n", "configs.x: unknown config key 'max_num_seqz'"),
    (MINIMAL + "[configs.x]\nmax_num_seqs = 0\n", "max_num_seqs must be > 0"),
    (MINIMAL + "[configs.x]\ngateway = { max_queues = 1 }\n", "unknown config key 'gateway.max_queues'"),
    (MINIMAL + "[run]\nprobes = 'some'\n", "run.probes must be one of"),
    ("repetitions = 0\n" + MINIMAL, "repetitions must be >= 1"),
    ("repetitions = 'two'\n" + MINIMAL, "repetitions: expected int"),
    ('name = "t"\n', "at least one [[workloads]]"),
    ('[[workloads]]\nworkload = "nope.toml"\n', "workload file"),
    ('[[workloads]]\nworkload = "chatty"\n', "does not exist"),
    ('[[workloads]]\nworkload = "chat"\nparams = { num_reqs = 3 }\n', "unknown workload field 'num_reqs'"),
    ('[[workloads]]\nworkload = "chat"\n[[workloads]]\nworkload = "chat"\n', "duplicate workload name"),
    ('[[workloads]]\nworkload = "chat"\nname = "a b"\n', "letters, digits"),
    ("name = [\n", "not valid TOML"),
])
def test_invalid_suites(tmp_path, text, message):
    p = write(tmp_path, text)
    with pytest.raises(SuiteError) as e:
        load_suite(p)
    assert message in str(e.value)
    assert str(p.resolve()) in str(e.value)  # names the file


def test_model_choices_mirror_the_engine():
    from layerscope.engine.models import create
    from layerscope.regressions import suite

    assert set(suite.ARCHS) == set(create.ARCHS) and set(suite.PRESETS) == set(create.PRESETS)


def test_missing_suite_names_shipped_ones():
    with pytest.raises(SuiteError, match="shipped suites: .*smoke"):
        load_suite("no-such-suite")
