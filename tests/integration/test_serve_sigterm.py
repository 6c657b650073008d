"""Integration: `specpool serve` stops on SIGTERM as on Ctrl-C (what a Kubernetes pod's termination
sends): a request already streaming is answered (finished or a clean status, never a hang), the
process exits 0 without a traceback, and nothing answers on its ports afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from specpool.core.errors import SpecpoolError
from specpool.services.client import SpecPoolClient

pytestmark = pytest.mark.integration

from redis_helpers import connect_or_skip
from serve_helpers import free_port as _free_port


def test_sigterm_drains_and_exits_zero(tmp_path):
    connect_or_skip().close()
    port, http_port = _free_port(), _free_port()
    log = tmp_path / "serve.err"
    with open(log, "w") as err:
        server = subprocess.Popen(
            [sys.executable, "-m", "specpool.cli.main", "serve", "--pool", "ngram", "--port", str(port),
             "--http-port", str(http_port), "--metrics-port", "0"],
            stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            if "serving specpool.v1.SpecPool" in line or server.poll() is not None:
                break
        assert server.poll() is None, log.read_text()[-2000:]

        outcome: dict = {}

        def stream() -> None:
            try:
                with SpecPoolClient(f"127.0.0.1:{port}") as client:
                    for chunk in client.generate_stream("Count from one to fifty.", max_new_tokens=48, timeout=120):
                        outcome["tokens"] = outcome.get("tokens", 0) + len(chunk.token_ids)
                        outcome["finish"] = chunk.finish_reason  # set on the last message only
            except SpecpoolError as exc:  # cancelled by the grace period's end: a clean status
                outcome["status"] = exc.code

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(3)  # the request is running
        server.send_signal(signal.SIGTERM)
        reader.join(timeout=120)
        assert not reader.is_alive(), "the running request hung after SIGTERM"
        # finished (its last message says why: the model's end token or the length) or a clean status
        assert outcome.get("finish") in ("stop", "length") or outcome.get("status") in ("CANCELLED", "UNAVAILABLE"), outcome
        code = server.wait(timeout=120)
        err = log.read_text()
        assert code == 0, err[-2000:]
        assert "Traceback" not in err, err[-2000:]
        assert "shutting down" in err and "stopped" in err
        with pytest.raises(grpc.FutureTimeoutError):  # nothing listens any more
            grpc.channel_ready_future(grpc.insecure_channel(f"127.0.0.1:{port}")).result(timeout=3)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
