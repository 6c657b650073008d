"""Run a served-mode Serve config on this machine: a local Ray cluster, Serve with its gRPC proxy,
and the applications of a ``ServePlan``. Used by `specpool serve`, the integration tests and
`specpool bench-served`.

Logical CPUs: Ray schedules replicas by the ``num_cpus`` they ask for, and that number also sets
each model replica's torch threads. On a small machine the replicas together may ask for more
CPUs than it has (the target alone takes all cores for its forward passes, while drafters and the
router mostly wait on it), so the local cluster advertises max(cores, what the plan asks for).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import signal
import socket
import time
from dataclasses import dataclass
from typing import Callable

from specpool.core.errors import InvalidArgument, ModelUnavailable, StoreUnavailable
from specpool.router.session_store import RedisSessionStore, redact_url
from specpool.services.serve_config import DEFAULT_GRPC_HOST, DEFAULT_METRICS_PORT, SERVE_ENV, RouterArgs, ServePlan

# Ray's processes that serve no request, by a fragment of their command line: the GCS, the
# dashboard head and agent, the autoscaler monitor, the log monitor, the runtime-env agent and the
# Serve controller. Not the raylet (it forks the workers, which would inherit its niceness), not the
# proxy (every client request and streamed message passes through it), not the replicas.
RAY_DAEMONS = {
    "/gcs/gcs_server": "gcs_server",
    "dashboard/dashboard.py": "dashboard",
    "ray::DashboardAgent": "dashboard agent",
    "autoscaler/_private/monitor.py": "autoscaler monitor",
    "_private/log_monitor.py": "log monitor",
    "ray::RuntimeEnvAgent": "runtime-env agent",
    "ray::ServeController": "Serve controller",
}


@dataclass
class LocalServe:
    """A running local deployment; ``shutdown()`` stops Serve and the Ray cluster."""

    plan: ServePlan
    address: str  # HOST:PORT of the gRPC API
    metrics_url: str | None  # Prometheus text format (Ray's metrics agent)
    http_url: str | None = None  # base URL of the OpenAI-compatible HTTP API (None: router arg http_api false)
    _owns_ray: bool = True

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()


def check_port_free(port: int, what: str) -> None:
    """Fail before starting anything when ``port`` is taken (Serve's proxy would only log it)."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            # As servers bind (gRPC sets it too): connections of a server that stopped a moment ago
            # linger in TIME_WAIT on the port for a minute; only a listening socket means taken.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InvalidArgument(f"port {port} ({what}) is already in use; pick another (--port / --metrics-port) "
                                      "or stop what holds it") from None
        finally:
            sock.close()
        return


def check_redis(url: str, namespace: str = "specpool") -> None:
    """Unreachable Redis is a clear error before Ray starts (StoreUnavailable)."""
    try:
        RedisSessionStore(url, namespace=namespace).close()
    except StoreUnavailable as exc:
        reason = str(exc).split(" (", 1)[1].split(")", 1)[0] if " (" in str(exc) else str(exc)
        raise StoreUnavailable(f"cannot reach Redis at {redact_url(url)} ({reason}); served mode keeps session state "
                               "there: start redis-server (redis-server --daemonize yes) or pass --redis-url") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Serve's deploy failures end with the replica's own exception: its last line says the most.
    for line in reversed(lines):
        if ("Error" in line or "error" in line) and not line.startswith(("File ", "Traceback")):
            return line[:400]
    return (lines[-1] if lines else type(exc).__name__)[:400]


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces or ")"
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    return children


def _descendants(root: int) -> set[int]:
    children, found = _children(), set()
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.add(pid)
        stack.extend(children.get(pid, []))
    return found


def lower_daemon_priority(niceness: int, root: int | None = None) -> dict[int, str]:
    """Run Ray's background processes (``RAY_DAEMONS``) started under ``root`` (this process) at
    ``niceness``; returns {pid: which daemon} of those it lowered. Linux only; elsewhere, or for a
    process that exited meanwhile, it does nothing.

    Why: on a small machine the target's forward uses every core, and each of its ops waits for
    the slowest thread; the idle cluster's periodic work (about 18 % of a core on 2 cores, mostly
    these daemons) then lands inside forwards. At a low priority it waits for the gaps every
    round has (while a drafter drafts, a core is free). Measured with `specpool bench-served`
    (6 prompts, 2 cores, one session): the served verify forward 279 -> 252 ms against embedded
    245 / 241 ms. Why it is not the default: with 8 concurrent sessions on the same 2 cores the
    target is busy nearly all the time, and in 3 of 4 runs at niceness 19 the verify batches fell
    apart (mostly 1 or 2 sessions; 7.1-7.6 tokens/s against 9.1-9.8 without it), so a starved
    daemon sits on some path we did not pin down. Use it for single-stream latency only.
    Niceness is per thread on Linux, so every thread of each process is set; threads a daemon
    starts later inherit it. Never raises a priority; needs no privileges (same user)."""
    if not os.path.isdir("/proc") or not hasattr(os, "setpriority"):
        return {}
    lowered: dict[int, str] = {}
    for pid in _descendants(os.getpid() if root is None else root):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read().replace("\0", " ")
            daemon = next((name for marker, name in RAY_DAEMONS.items() if marker in command), None)
            if daemon is None:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                if os.getpriority(os.PRIO_PROCESS, int(tid)) < niceness:
                    os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except (OSError, ValueError):  # exited meanwhile
            continue
        lowered[pid] = daemon
    return lowered


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def init_ray(init_kwargs: dict, progress: Callable[[str], None] = lambda message: None, *, attempts: int = 3,
             pauses_s: tuple[float, ...] = (5.0, 15.0)) -> None:
    """``ray.init(**init_kwargs)``; a local cluster that fails to start is torn down and started
    again, up to ``attempts`` starts in all, waiting ``pauses_s[i]`` before start i + 2.

    Why: Ray waits a fixed 30 s for its new raylet to register with the GCS and then raises, leaving
    the GCS, the raylet and their helpers running under this process (the failed node is never
    handed to ``ray.shutdown()``). On a loaded 2-core machine that wait has run out in CI: once,
    and in a later run twice in a row; the processes it left then sat under the test process. Here
    they are killed (whatever the start added under this process: nothing else is touched), the
    machine is given a growing pause to settle, and the start is tried again. Each failure names
    the last error the raylet or the GCS logged; the last one is a ModelUnavailable saying where
    Ray's logs are.
    Without /proc (not Linux) there is nothing to clean up from, so one plain try."""
    import ray

    has_proc = os.path.isdir("/proc")
    tries = attempts if has_proc else 1
    for attempt in range(1, tries + 1):
        before = _descendants(os.getpid()) if has_proc else set()
        try:
            ray.init(**init_kwargs)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises plain Exception for a node that did not start
            if not has_proc:
                raise
            reason = _first_line(exc)
            logged = ray_logged_error()
            if logged:
                reason = f"{reason} Last error Ray logged: {logged}"
            try:
                ray.shutdown()  # whatever part of the driver state was set up
            except Exception:  # noqa: BLE001 - nothing to shut down
                pass
            _kill(_descendants(os.getpid()) - before)
            if attempt == tries:
                raise ModelUnavailable(f"Ray did not start: {reason} (logs under {ray_session_logs()})") from None
            pause = pauses_s[min(attempt - 1, len(pauses_s) - 1)] if pauses_s else 0.0
            progress(f"Ray did not start ({reason}); stopped what it left, starting it again in {pause:.0f} s "
                     f"(start {attempt + 1} of {tries}) ...")
            time.sleep(pause)


def ray_session_logs() -> str:
    """The log folder of the newest local Ray session (under Ray's temp dir, /tmp or $RAY_TMPDIR)."""
    return os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "session_latest", "logs")


# A glog line of Ray's C++ daemons: "[2026-12-06 19:50:36,874 E 6871 6898] (raylet) file.cc:83: text".
_GLOG_ERROR = re.compile(r"^\[\S+ \S+ [EF] \d+ \d+\] (.*)$")


def ray_logged_error(logs: str | None = None) -> str | None:
    """The last error (or fatal) line the raylet, else the GCS, of the newest session logged; None
    if neither logged one. It says why a start timed out (a port taken, a crash); Ray's exception
    does not."""
    logs = ray_session_logs() if logs is None else logs
    for name in ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err"):  # the raylet is what times out
        try:
            with open(os.path.join(logs, name), errors="replace") as f:
                lines = f.read()[-200_000:].splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            match = _GLOG_ERROR.match(line.strip())
            if match:
                return match.group(1)[:300]
    return None


def start_local(
    plan: ServePlan,
    *,
    metrics_port: int | None = DEFAULT_METRICS_PORT,
    progress: Callable[[str], None] = lambda message: None,
    log_to_driver: bool = False,
    daemon_niceness: int | None = None,
    ray_address: str | None = None,
) -> LocalServe:
    """Start Ray (a new local cluster), Serve and every application of ``plan``; returns when all
    are RUNNING. Checks first, before Ray starts: Redis reachable, ports free. ``daemon_niceness``
    (opt-in; None leaves Ray's processes as Ray starts them): see ``lower_daemon_priority``.
    ``ray_address``: deploy on that running cluster instead (e.g. several nodes, the drafters
    placed by ``ray_actor_options.resources``); its nodes' CPUs and metrics port are its own, and
    ``shutdown()`` stops Serve but leaves the cluster to whoever started it. A driver already
    connected (``ray.init``) is used as it is."""
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    router = RouterArgs.parse(plan.router.args)
    check_redis(router.resolved_redis_url(), router.redis_namespace)
    check_port_free(plan.grpc_port, "gRPC")
    if router.http_api:
        check_port_free(plan.http_port, "HTTP")
    if metrics_port:
        check_port_free(metrics_port, "metrics")

    if ray_address is None:
        cpus = max(os.cpu_count() or 1, math.ceil(plan.cpus_wanted()))
        progress(f"starting Ray (local, {cpus} logical CPUs) ...")
        init_kwargs: dict = {"address": "local", "num_cpus": cpus, "include_dashboard": False,
                             "log_to_driver": log_to_driver, "logging_level": logging.WARNING}
        if metrics_port:
            init_kwargs["_metrics_export_port"] = metrics_port
    else:
        progress(f"connecting to the Ray cluster at {ray_address} ...")
        init_kwargs = {"address": ray_address, "log_to_driver": log_to_driver, "logging_level": logging.WARNING}
    # Ray runs its workers at niceness 15, so that they never starve its own daemons. Here the
    # workers ARE the service (the model servers): at 15 any other busy process on the machine
    # would starve them. The raylet reads this when it starts, and passes it to the workers.
    os.environ.setdefault("RAY_worker_niceness", "0")
    for name, value in SERVE_ENV.items():  # read by every Ray process it starts
        os.environ.setdefault(name, value)
    if not (ray_address is not None and ray.is_initialized()):  # a caller may have connected already
        init_ray(init_kwargs, progress, attempts=3 if ray_address is None else 1)  # never restart another's cluster
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the driver's own Serve logs: progress says enough
    http_host = DEFAULT_GRPC_HOST if plan.http_host in ("0.0.0.0", "::", "") else plan.http_host
    started = LocalServe(plan, f"{DEFAULT_GRPC_HOST}:{plan.grpc_port}",
                         f"http://{DEFAULT_GRPC_HOST}:{metrics_port}/metrics" if metrics_port else None,
                         f"http://{http_host}:{plan.http_port}/v1" if router.http_api else None,
                         _owns_ray=ray_address is None)
    try:
        serve.start(
            proxy_location=plan.proxy_location,
            http_options={"host": plan.http_host, "port": plan.http_port},
            grpc_options={"port": plan.grpc_port, "grpc_servicer_functions": list(plan.grpc_servicer_functions)},
            logging_config={"log_level": "WARNING", "enable_access_log": False},
        )
        from ray._common.utils import import_attr

        targets = []
        for app in plan.apps:
            builder = import_attr(app.import_path)
            targets.append(RunTarget(builder(app.args), name=app.name, route_prefix=app.route_prefix,
                                     logging_config=app.logging_config))
        progress(f"deploying {len(targets)} applications ({', '.join(a.name for a in plan.apps)}); loading models ...")
        t0 = time.perf_counter()
        try:
            serve.run_many(targets)
        except Exception as exc:  # noqa: BLE001 - a replica that fails to start: say which and why
            raise ModelUnavailable(f"the applications did not start: {_first_line(exc)} "
                                   "(full logs under /tmp/ray/session_latest/logs/serve)") from None
        progress(f"all applications running after {time.perf_counter() - t0:.0f} s")
        if daemon_niceness is not None:
            lowered = lower_daemon_priority(daemon_niceness)
            progress(f"Ray's background processes at niceness {daemon_niceness}: {', '.join(sorted(set(lowered.values())))}")
    except BaseException:
        started.shutdown()
        raise
    return started


__all__ = ["LocalServe", "check_port_free", "check_redis", "lower_daemon_priority", "start_local"]
