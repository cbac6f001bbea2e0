"""diagnose reads bundles only: importing it (and running it) must not import the engine, torch or textual."""

import re
from pathlib import Path

DIAGNOSE = Path(__file__).resolve().parents[2] / "diagnose"


def test_import_diagnose_pulls_in_no_engine_torch_or_textual(modules_after):
    mods = modules_after("import layerscope.diagnose")
    for bad in ("torch", "layerscope.engine", "textual"):
        assert bad not in mods


def test_every_diagnose_module_and_a_full_diagnosis_stay_engine_free(tmp_path, modules_after):
    names = [p.stem for p in DIAGNOSE.glob("*.py") if p.stem != "__init__"]
    code = "\n".join(f"import layerscope.diagnose.{n}" for n in names) + f"""
from layerscope.testing.synth import SynthSpec, generate
from layerscope.diagnose import compare, summarize
a = generate(SynthSpec(num_requests=50), {str(tmp_path / 'a')!r})
b = generate(SynthSpec(num_requests=50, step_overhead_s=0.002), {str(tmp_path / 'b')!r})
summarize(str(a)); compare(str(a), str(b))
from layerscope.diagnose.cli import add_parser
"""
    mods = modules_after(code)
    assert not {m for m in mods if m == "torch" or m.startswith(("torch.", "layerscope.engine", "textual"))}


def test_diagnose_never_reads_the_manifest_faults():
    # the key may only be named to drop it (load.py, config_diff.py) or, in synth.py, to write it
    for p in DIAGNOSE.glob("*.py"):
        if p.name == "synth.py":
            continue
        text = p.read_text()
        uses = re.findall(r"""(.{0,6})["']faults["']""", text)
        assert all(u.endswith(".pop(") for u in uses), (p.name, uses)


def test_load_run_drops_faults(tmp_path):
    from layerscope.diagnose.load import load_run
    from layerscope.testing.synth import SynthSpec, generate

    run = load_run(generate(SynthSpec(num_requests=10, gateway_delay_s=0.01), tmp_path / "r"))
    assert "faults" not in run.manifest
    # only whether two runs ran the same injected code survives, as a digest that names nothing
    same = load_run(generate(SynthSpec(num_requests=10, gateway_delay_s=0.01, seed=1), tmp_path / "s"))
    other = load_run(generate(SynthSpec(num_requests=10, gateway_delay_s=0.02), tmp_path / "o"))
    digest = run.manifest["injected_digest"]
    assert digest == same.manifest["injected_digest"] != other.manifest["injected_digest"]
    assert "gateway" not in digest and len(digest) == 16
