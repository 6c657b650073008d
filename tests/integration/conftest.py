"""Fixtures the integration modules share."""

from __future__ import annotations

import pytest

from redis_helpers import connect_or_skip


@pytest.fixture(scope="module")
def raw_redis():
    """The machine's Redis (decoded strings), for reading what a served instance wrote; skips the
    module when none answers."""
    client = connect_or_skip(decode_responses=True)
    yield client
    client.close()
