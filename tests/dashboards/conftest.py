"""Fixtures for the dashboards tests: the Prometheus binaries (Debian's ``prometheus`` package).

They are installed by ``scripts/setup.sh --system`` (which ``scripts/test.sh`` and CI run).
A missing binary fails the test that needs it, with how to install it; it never skips.
"""

from __future__ import annotations

import shutil

import pytest

INSTALL_HINT = ("install Debian's prometheus package (it ships prometheus and promtool): "
                "`bash scripts/setup.sh --system`, or `apt-get install prometheus`")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH; {INSTALL_HINT}", pytrace=False)
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary("promtool")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return _binary("prometheus")
