"""Import contracts: reading a bundle needs neither torch nor the engine; the engine never imports probes."""

from __future__ import annotations


def test_bundle_reader_is_light(modules_after):
    mods = modules_after("from layerscope.probes.bundle import read_bundle, BundleWriter")
    assert "torch" not in mods
    assert not [m for m in mods if m.startswith("layerscope.engine")]


def test_engine_does_not_import_probes(modules_after):
    mods = modules_after("import layerscope.engine.llm")
    assert not [m for m in mods if m.startswith("layerscope.probes")]
