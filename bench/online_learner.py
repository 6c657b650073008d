"""``--learner-process``: each learning system's ``specpool learner`` as its own process on this
machine, fed through its own Redis stream, niced, with few torch threads, and paused (SIGSTOP)
except while its system serves, so each system's tokens/s is net of its learning.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from bench.online_args import learner_cost_flags
from specpool.core.errors import InvalidArgument


def delete_streams(url: str, streams: list[str]) -> None:
    """Drop a run's feedback streams (each run has its own), so Redis keeps nothing of it."""
    client = redis.Redis.from_url(url)
    try:
        for stream in streams:  # and every tenant's stream of it (one per tenant, listed in STREAM:_tenants)
            tenants = [t.decode() for t in client.smembers(f"{stream}:_tenants")]
            client.delete(stream, f"{stream}:_tenants", *(f"{stream}:{t}" for t in tenants))
    except redis.RedisError:
        pass
    finally:
        client.close()


def _die_with_parent() -> None:
    """Linux: the learner gets SIGKILL when the benchmark dies (a paused learner would otherwise
    wait for a SIGCONT forever); elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


class LearnerProcess:
    """One learning system's ``specpool learner`` process (``--learner-process``), on this
    machine: niced, with few torch threads, and paused (SIGSTOP) except while its system serves."""

    def __init__(self, system: str, args: argparse.Namespace, stream: str, store: str, target: str, log_path: Path,
                 home: Path):
        command = [sys.executable, "-m", "specpool.cli.main", "learner", "--redis", args.learner_process, "--stream", stream,
                   "--group", "bench", "--store", store, "--algo", system, "--drafters", args.drafter,
                   "--lr", str(args.lr), "--hedge-lrs", args.hedge_lrs, "--precondition", args.precondition,
                   "--grow-vocab", str(args.grow_vocab), "--copy-window", str(args.copy_window),
                   *learner_cost_flags(args), "--batch-records", str(args.batch_records), "--supervision", args.supervision,
                   "--publish-every", str(args.publish_every), "--commit-after-s", str(args.commit_after_s),
                   "--no-progress", "--report-every-s", "30",
                   "--target", target, "--device", args.device]
        threads = str(args.learner_threads)
        root = str(Path(__file__).resolve().parents[1])  # this checkout's specpool/, whether installed or not
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, SPECPOOL_HOME=str(home),
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.log_path = log_path
        self._log = log_path.open("w")
        nice, idle = args.learner_nice, args.learner_idle

        def setup() -> None:  # in the child, before exec
            if nice:
                os.nice(nice)
            if idle:  # a nice value still lets the learner hold a core until the scheduler's next tick
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            _die_with_parent()

        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=setup)
        self.paused = False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until the learner says it reads its stream (imports done); a learner that exits is an error."""
        deadline = time.monotonic() + timeout_s
        while "reading" not in self.log_path.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise InvalidArgument(f"the learner process did not start; its log {self.log_path}:\n"
                                      f"{self.log_path.read_text()[-2000:]}")
            time.sleep(0.2)

    def check_alive(self) -> None:
        """A learner that died would leave its system serving stale versions: the run stops instead."""
        if self.process.poll() is not None:
            raise InvalidArgument(f"the learner process exited with code {self.process.returncode}; its log "
                                  f"{self.log_path}:\n{self.log_path.read_text()[-2000:]}")

    def pause(self) -> None:
        if not self.paused and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGSTOP)
            self.paused = True
            deadline = time.monotonic() + 2.0  # the signal lands asynchronously: wait until it has
            while self.state() not in ("T", "t", "Z", "") and time.monotonic() < deadline:
                time.sleep(0.001)

    def resume(self) -> None:
        if self.paused and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.paused = False

    def _stat(self) -> list[str]:
        """/proc/PID/stat after the command name; [] once the process is gone."""
        try:
            return Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError):
            return []

    def state(self) -> str:
        """The process state letter (T: stopped), "" once gone."""
        fields = self._stat()
        return fields[0] if fields else ""

    def cpu_s(self) -> float:
        """CPU seconds the process has used (all its threads), from /proc."""
        fields = self._stat()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0  # utime + stime

    def stop(self, timeout_s: float = 600.0) -> str:
        """SIGTERM (the learner commits what it applied, then exits); returns its last log line."""
        self.resume()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        lines = self.log_path.read_text().strip().splitlines()
        return lines[-1] if lines else ""
