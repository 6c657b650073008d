"""Domain errors. Every layer raises these; the CLI prints them as one line and the gRPC
interceptor maps ``code`` to a status code. Messages say what was wrong and what to do."""

from __future__ import annotations


class SpecpoolError(Exception):
    """Base class. ``code`` names the gRPC status an interceptor should use."""

    code = "INTERNAL"


class InvalidArgument(SpecpoolError):
    """The request itself is wrong (empty prompt, k out of range, ...)."""

    code = "INVALID_ARGUMENT"


class NotFound(SpecpoolError):
    """A named thing (drafter, model, policy) does not exist."""

    code = "NOT_FOUND"


class ModelUnavailable(SpecpoolError):
    """A model could not be obtained or loaded."""

    code = "UNAVAILABLE"


class StoreUnavailable(SpecpoolError):
    """The session state store (Redis) cannot be reached or refused the connection."""

    code = "UNAVAILABLE"


class DeadlineExceeded(SpecpoolError):
    """The caller's deadline passed before the request finished; its work was stopped."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(SpecpoolError):
    """The caller cancelled the request; its work was stopped and its caches freed."""

    code = "CANCELLED"


class SessionBusy(SpecpoolError):
    """Another request of the same session is running; a session runs one request at a time."""

    code = "ABORTED"


class FailedPrecondition(SpecpoolError):
    """The system is not in the state the call needs (a white-box arm whose target returns no
    features; features that arrive after a gap); the message says what to do."""

    code = "FAILED_PRECONDITION"


class Unauthenticated(SpecpoolError):
    """The request carries no API key, or one the server does not know."""

    code = "UNAUTHENTICATED"


class PermissionDenied(SpecpoolError):
    """The caller's key is valid but may not do this (another tenant's request, an admin operation)."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(SpecpoolError):
    """The server or the tenant is at a limit; the message says when to retry."""

    code = "RESOURCE_EXHAUSTED"


class IncompatibleModels(InvalidArgument):
    """Drafter and target do not share a tokenizer, so token ids would mean different things."""


def check(condition: bool, message: str, error: type[SpecpoolError] = InvalidArgument) -> None:
    """Raise ``error(message)`` unless ``condition`` holds. Keeps validation code one line a rule."""
    if not condition:
        raise error(message)
