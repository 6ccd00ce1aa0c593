"""The fake OpenAI-compatible server the bench-serve tests run against: one per module, reset per test."""
from __future__ import annotations

import pytest

from tests.benchmarks.fake_openai import running_fake_server


@pytest.fixture(scope="module")
def server():
    with running_fake_server() as fake:
        yield fake


@pytest.fixture
def fake(server):
    server.reset()
    return server
