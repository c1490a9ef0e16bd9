from __future__ import annotations

import pytest

from tests.bench.stub_server import StubServer


@pytest.fixture
def stub():
    """A fresh stub server per test (its counters start at zero)."""
    with StubServer(ttft=0.05, itl=0.01) as server:
        yield server
