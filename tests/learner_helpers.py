"""``specpool learner`` in a process of its own, for the integration tests that kill and restart it."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from specpool.learning.learner_process import PAUSE_BEFORE_ACK_ENV

ROOT = Path(__file__).resolve().parents[1]


class LearnerProcess:
    """``specpool learner`` in a process of its own; its stderr lines collected as they come."""

    def __init__(self, home: Path, args: list[str], pause_before_ack_s: float = 0.0):
        env = {**os.environ, "SPECPOOL_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        if pause_before_ack_s:
            env[PAUSE_BEFORE_ACK_ENV] = str(pause_before_ack_s)
        self.process = subprocess.Popen([sys.executable, "-m", "specpool.cli.main", "learner", *args], cwd=ROOT,
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stderr:
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.seen):
            assert self.process.poll() is None or not self.lines.empty(), "".join(self.seen)
            assert time.monotonic() < deadline, f"no {text!r} in time:\n" + "".join(self.seen)
            try:
                self.seen.append(self.lines.get(timeout=0.5))
            except queue.Empty:
                pass

    def finish(self, timeout: float = 240.0) -> str:
        self.process.wait(timeout)
        time.sleep(0.2)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        assert self.process.returncode == 0, "".join(self.seen)
        return "".join(self.seen)
