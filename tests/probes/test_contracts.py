"""Import contracts: reading a bundle needs neither torch nor the engine; the engine never imports probes."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_bundle_reader_is_light():
    mods = _modules_after("from layerscope.probes.bundle import read_bundle, BundleWriter")
    assert "torch" not in mods
    assert not [m for m in mods if m.startswith("layerscope.engine")]


def test_engine_does_not_import_probes():
    mods = _modules_after("import layerscope.engine.llm")
    assert not [m for m in mods if m.startswith("layerscope.probes")]
