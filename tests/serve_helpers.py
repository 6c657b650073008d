"""Helpers the served-mode integration tests share: a free loopback port, polling until a
condition holds, and a call to a Serve deployment's method through its handle."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    """``predicate()``'s first truthy value; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def call(handle, method: str, *args, timeout_s: float = 60):
    return handle.options(method_name=method).remote(*args).result(timeout_s=timeout_s)
