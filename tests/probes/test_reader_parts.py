"""The reader over both layouts: single-file tables and part directories (DESIGN.md, "The run bundle").

A bundle written as parts reads back the same tables as the single-file bundle it was split from; a
bundle cut short (manifest ``complete: false``, a stray higher-numbered part of one table) loads up to
its last complete part and says so; bad part counts are refused naming the manifest.
"""

import json
import shutil

import pyarrow.parquet as pq
import pytest

from layerscope.testing.synth import SynthSpec, generate
from layerscope.probes import schema
from layerscope.probes.reader import PART_NAME, BundleError, read_bundle


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return generate(SynthSpec(num_requests=120, arrival_rate_per_s=80.0, tp_size=2, num_kv_blocks=60),
                    tmp_path_factory.mktemp("r") / "single")


def split(src, dst, parts=3, complete=True, stray=False):
    """``src``'s tables as ``parts`` parts each (rows cut in order), manifest updated."""
    shutil.copytree(src, dst)
    for name in schema.TABLES:
        f = dst / f"{name}.parquet"
        t = pq.read_table(f)
        f.unlink()
        f.mkdir()
        n = t.num_rows
        cuts = [n * i // parts for i in range(parts + 1)]
        for i in range(parts):
            pq.write_table(t.slice(cuts[i], cuts[i + 1] - cuts[i]), f / PART_NAME.format(i + 1))
    m = json.loads((dst / "manifest.json").read_text())
    m.update(parts=parts, complete=complete)
    (dst / "manifest.json").write_text(json.dumps(m))
    if stray:  # a crash after one table's next part was written, before the manifest said so
        shutil.copy(dst / "requests.parquet" / PART_NAME.format(1), dst / "requests.parquet" / PART_NAME.format(parts + 1))
    return dst


def test_parts_read_as_the_single_file(single, tmp_path):
    parted = read_bundle(split(single, tmp_path / "p"))
    whole = read_bundle(single)
    assert parted.parts == 3 and parted.complete and parted.note is None and whole.parts is None
    for name in schema.TABLES:
        assert parted.table(name).equals(whole.table(name)), name
    assert len(parted.files("steps")) == 3 and whole.files("steps") == [single / "steps.parquet"]


def test_projection_and_filter(single):
    b = read_bundle(single)
    t = b.table("steps", columns=["step_id", "start_ns"])
    assert t.column_names == ["step_id", "start_ns"] and t.num_rows == b.table("steps").num_rows
    import pyarrow.dataset as ds

    mid = int(sorted(t.column("start_ns").to_pylist())[t.num_rows // 2])
    late = b.table("steps", filter=ds.field("start_ns") >= mid)
    assert 0 < late.num_rows < t.num_rows and min(late.column("start_ns").to_pylist()) >= mid


def test_cut_short_loads_complete_parts_and_says_so(single, tmp_path):
    d = split(single, tmp_path / "cut", parts=3, complete=False, stray=True)
    m = json.loads((d / "manifest.json").read_text())
    m["parts"] = 2
    (d / "manifest.json").write_text(json.dumps(m))
    b = read_bundle(d)
    whole = read_bundle(single).table("requests")
    n2 = whole.num_rows * 2 // 3
    # part 3 and the stray part 4 of requests are ignored: exactly the first two parts' rows
    assert b.table("requests").column("request_id").to_pylist() == whole.column("request_id").to_pylist()[:n2]
    assert not b.complete
    assert b.note.startswith("still recording or cut short: 2 parts, up to 1970-01-01T00:00:0")


def test_cut_short_diagnoses_and_the_cli_says_so(single, tmp_path):
    import subprocess
    import sys

    d = split(single, tmp_path / "cut2", parts=3, complete=False)
    p = subprocess.run([sys.executable, "-m", "layerscope", "diagnose", str(d), "--json"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "still recording or cut short: 3 parts" in p.stderr
    assert json.loads(p.stdout)["requests"] == 120


def test_bad_parts_count_and_missing_single_file(single, tmp_path):
    d = split(single, tmp_path / "bad", parts=2)
    m = json.loads((d / "manifest.json").read_text())
    m["parts"] = "two"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="parts is 'two'"):
        read_bundle(d)
    d2 = tmp_path / "nosteps"
    shutil.copytree(single, d2)
    (d2 / "steps.parquet").unlink()
    with pytest.raises(BundleError, match="missing table 'steps'"):
        read_bundle(d2)


def test_version_1_bundle_reads_the_new_columns_as_null(single, tmp_path):
    d = tmp_path / "v1"
    shutil.copytree(single, d)
    t = pq.read_table(d / "requests.parquet")
    added = [c for c in t.column_names if c in schema.ADDED]
    assert added
    pq.write_table(t.drop_columns(added), d / "requests.parquet")
    m = json.loads((d / "manifest.json").read_text())
    m["schema_version"] = 1
    (d / "manifest.json").write_text(json.dumps(m))
    r = read_bundle(d).table("requests")
    assert r.column_names == schema.REQUESTS.names and r.column(added[0]).null_count == r.num_rows
    m["schema_version"] = 2
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=f"column {added[0]!r} is missing"):
        read_bundle(d)
