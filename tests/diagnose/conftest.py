"""Synthetic bundles for diagnose tests, generated once per session and cached by spec."""

import dataclasses
import json

import pytest

from layerscope.testing.synth import SynthSpec, generate

BASE = dict(num_requests=400, arrival_rate_per_s=80.0)


@pytest.fixture(scope="session")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    cache: dict[str, str] = {}

    def make(**kw) -> str:
        spec = SynthSpec(**{**BASE, **kw})
        key = json.dumps(dataclasses.asdict(spec), sort_keys=True)
        if key not in cache:
            cache[key] = str(generate(spec, root / f"run{len(cache)}"))
        return cache[key]

    return make
