"""The machine's Redis for integration tests: connect, or skip the module with a clear reason."""

from __future__ import annotations

import pytest
import redis

URL = "redis://127.0.0.1:6379/0"


def connect_or_skip(decode_responses: bool = False) -> redis.Redis:
    client = redis.Redis.from_url(URL, decode_responses=decode_responses)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        pytest.skip(f"no Redis at {URL} ({exc}); start redis-server to run these tests")
    return client


def delete_namespace(client: redis.Redis, namespace: str) -> None:
    """Delete every key a test's server wrote under ``namespace`` (its session, tenant and stream keys)."""
    stale = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    if stale:
        client.delete(*stale)
