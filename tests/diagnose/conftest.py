"""Synthetic bundles for diagnose tests, generated once per session and cached by spec."""

import pytest

BASE = dict(num_requests=400, arrival_rate_per_s=80.0)


@pytest.fixture(scope="session")
def synth(tmp_path_factory, synth_factory):
    return synth_factory(tmp_path_factory.mktemp("synth"), **BASE)
