"""The ONE mapping from errors to gRPC status codes (docs/ARCHITECTURE.md, convention 5).

Every served entry point (the router's SpecPool methods, its health check) sends failures through
``grpc_status``: a domain error (``specpool.core.errors.SpecpoolError``) carries its status name in
``code`` and a message written for the caller; errors that cross a Ray Serve deployment handle
arrive wrapped (``RayTaskError`` and friends) and are unwrapped first; Ray's own failures (a
replica that died, back-pressure, a timeout) get the status a client can act on. Anything else is
INTERNAL with a one-line message: never a stack trace on the wire (the server logs keep it).

Pure: grpc is imported for its ``StatusCode`` enum only, and Ray's exception classes are recognised
by name, so this module (and its tests) need no running Ray.
"""

from __future__ import annotations

import grpc

from specpool.core.errors import SpecpoolError

MAX_MESSAGE_CHARS = 1000  # status details travel in HTTP/2 trailers: keep them short

# Ray / Ray Serve exception class names -> (status, what to tell the caller). Matched over the
# exception's MRO by name, so no Ray import is needed here.
_RAY_ERRORS: dict[str, tuple[grpc.StatusCode, str]] = {
    "BackPressureError": (grpc.StatusCode.RESOURCE_EXHAUSTED, "the server is at capacity; retry later"),
    "DeploymentUnavailableError": (grpc.StatusCode.UNAVAILABLE, "a model server is unavailable; retry later"),
    "ActorDiedError": (grpc.StatusCode.UNAVAILABLE, "a model server replica died; retry"),
    "ActorUnavailableError": (grpc.StatusCode.UNAVAILABLE, "a model server replica is unreachable; retry"),
    "RayActorError": (grpc.StatusCode.UNAVAILABLE, "a model server replica failed; retry"),
    "RequestCancelledError": (grpc.StatusCode.CANCELLED, "the request was cancelled"),
    "GetTimeoutError": (grpc.StatusCode.DEADLINE_EXCEEDED, "a model server did not answer in time"),
}


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers: a ``RayTaskError`` keeps the remote
    exception in ``cause``; a ``gRPCStatusError`` in ``original_exception``."""
    seen = 0
    while seen < 8:
        seen += 1
        inner = getattr(exc, "cause", None)
        if isinstance(inner, BaseException) and type(exc).__name__.startswith("RayTaskError"):
            exc = inner
            continue
        inner = getattr(exc, "original_exception", None)
        if isinstance(inner, BaseException):
            exc = inner
            continue
        break
    return exc


def _short(text: str) -> str:
    text = " ".join(text.split())  # one line
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, one-line message) for any exception a served request may end with."""
    exc = unwrap(exc)
    if isinstance(exc, SpecpoolError):
        code = getattr(grpc.StatusCode, str(exc.code), None)
        if not isinstance(code, grpc.StatusCode) or code is grpc.StatusCode.OK:
            code = grpc.StatusCode.INTERNAL
        return code, _short(str(exc) or type(exc).__name__)
    for cls in type(exc).__mro__:
        known = _RAY_ERRORS.get(cls.__name__)
        if known is not None:
            return known[0], known[1]
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the request ran out of time"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the server log has the details"


def is_unavailable(exc: BaseException) -> bool:
    """Whether a failed call to a model server may succeed when retried (on another replica):
    the replica died, is unreachable or is being replaced. Domain errors never are."""
    exc = unwrap(exc)
    if isinstance(exc, SpecpoolError):
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ActorDiedError", "ActorUnavailableError", "RayActorError", "DeploymentUnavailableError"})


# How Ray Serve's gRPC proxy words a replica that died under a request (the router replica killed
# mid-stream, or its node lost): INTERNAL with the actor error's text, because its
# get_grpc_response_status (ray/serve/_private/grpc_util.py) makes every RayActorError INTERNAL. The
# failure is transient: a retry reaches a live or replacement replica. Serve's proxy is not ours
# to change, so what sits between it and the caller (the client, the TLS front) says UNAVAILABLE.
REPLICA_DIED_MARKS = ("The actor died unexpectedly", "ActorDiedError", "ActorUnavailableError", "The actor is dead")


def replica_died(code: grpc.StatusCode | None, details: str | None) -> bool:
    """Whether a status from Serve's proxy is a replica that died under the call (see above)."""
    return code == grpc.StatusCode.INTERNAL and any(mark in (details or "") for mark in REPLICA_DIED_MARKS)


def replica_died_message(details: str) -> str:
    return ("the server replica handling this request died mid-request "
            f"({details.splitlines()[0][:120]}); retry, with the same session id to continue the session")

