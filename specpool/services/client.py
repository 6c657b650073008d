"""A Python client for the specpool gRPC API (``specpool.v1.SpecPool``).

    from specpool.services.client import SpecPoolClient

    with SpecPoolClient("127.0.0.1:50051") as client:
        answer = client.generate("Write a haiku about caches", max_new_tokens=64)
        print(answer.text, answer.stats.mean_accepted_length)
        for chunk in client.generate_stream("def fib(n):", raw=True, session_id="s1"):
            print(chunk.text, end="", flush=True)

A server replica that dies under a request (Ray Serve's proxy answers INTERNAL with the actor's
death) raises ``RemoteError`` with code ``UNAVAILABLE``: retryable. Failures raise the domain errors of ``specpool.core.errors`` (``InvalidArgument``, ``NotFound``,
``DeadlineExceeded``, ``Cancelled``, ``SessionBusy``, ``Unauthenticated``, ``PermissionDenied``, ...) or ``RemoteError`` for any other status;
each carries the gRPC status name in ``code`` and the server's one-line message. Stopping a
``generate_stream`` iteration early (``break``, ``close()``) cancels the call, and the server stops
the request and frees its caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import grpc

from specpool.core.errors import (
    Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted,
    SessionBusy, SpecpoolError, Unauthenticated,
)
from specpool.services import api as convert
from specpool.services.api import Stats
from specpool.services.status import replica_died, replica_died_message
from specpool.v1 import specpool_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
_ERRORS: dict[str, type[SpecpoolError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_FOUND": NotFound,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "CANCELLED": Cancelled,
    "ABORTED": SessionBusy,
    "FAILED_PRECONDITION": FailedPrecondition,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
}


class RemoteError(SpecpoolError):
    """A status the client has no domain class for (UNAVAILABLE, INTERNAL, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def error_from_rpc(exc: grpc.RpcError, address: str) -> SpecpoolError:
    code = exc.code().name if exc.code() is not None else "UNKNOWN"
    details = exc.details() or code
    if replica_died(exc.code(), details):
        # UNAVAILABLE, what it is: retry, with the same session id to continue the session (its
        # bandit state is in Redis, the target's cache survives a router's death).
        return RemoteError("UNAVAILABLE", replica_died_message(details))
    if code == "UNAVAILABLE" and ("connect" in details.lower() or "unavailable" == details.lower()):
        details = f"cannot reach the specpool server at {address} ({details}); is `specpool serve` running?"
    if code == "DEADLINE_EXCEEDED" and details.lower() == "deadline exceeded":
        details = "deadline exceeded: the request did not finish in time (the server stopped it)"
    cls = _ERRORS.get(code)
    return cls(details) if cls is not None else RemoteError(code, details)


@dataclass(frozen=True)
class Generation:
    """A whole answer."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "cancelled"
    stats: Stats
    session_id: str

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.as_dict(), "session_id": self.session_id}


@dataclass(frozen=True)
class StreamChunk:
    """One streamed message: text and tokens added since the previous one."""

    text: str
    token_ids: list[int]
    session_id: str
    finish_reason: str | None = None  # set on the last message only
    stats: Stats | None = None  # set on the last message only

    def as_dict(self) -> dict:
        out: dict = {"text": self.text, "token_ids": self.token_ids, "session_id": self.session_id}
        if self.finish_reason is not None:
            out["finish_reason"] = self.finish_reason
            out["stats"] = self.stats.as_dict() if self.stats else None
        return out


class SpecPoolClient:
    """Blocking client over one gRPC channel; thread-safe (calls may run concurrently)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None, tenant: str = "",
                 options: Sequence[tuple[str, object]] = (), api_key: str | None = None):
        self.address = address
        self.timeout = timeout  # default per-call deadline in seconds (None: no deadline)
        self.tenant = tenant  # default tenant ("" = the API key's, or the server's "default")
        # Sent on every call when set; a server with API keys needs it (specpool/services/auth.py).
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channel = grpc.insecure_channel(address, options=list(options))
        self._stub = specpool_pb2_grpc.SpecPoolStub(self._channel)

    # -- calls --------------------------------------------------------------------------------------
    def generate(
        self, prompt: str | None = None, *, chat: list[tuple[str, str]] | None = None, raw: bool = False,
        max_new_tokens: int = 0, temperature: float = 0.0, top_p: float | None = None, top_k: int = 0, seed: int = 0,
        stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), policy: str = "", k: int = 0,
        session_id: str = "", tenant: str | None = None, timeout: float | None = None,
    ) -> Generation:
        """The whole answer in one response. ``raw=True`` skips the chat template."""
        request = self._request(prompt, chat, raw, max_new_tokens, temperature, top_p, top_k, seed, stop,
                                stop_token_ids, policy, k, session_id, tenant)
        try:
            response = self._stub.Generate(request, timeout=timeout if timeout is not None else self.timeout,
                                           metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None
        return Generation(response.text, list(response.token_ids), convert.finish_reason_name(response.finish_reason),
                          convert.stats_from_proto(response.stats), response.session_id)

    def generate_stream(
        self, prompt: str | None = None, *, chat: list[tuple[str, str]] | None = None, raw: bool = False,
        max_new_tokens: int = 0, temperature: float = 0.0, top_p: float | None = None, top_k: int = 0, seed: int = 0,
        stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), policy: str = "", k: int = 0,
        session_id: str = "", tenant: str | None = None, timeout: float | None = None,
    ) -> Iterator[StreamChunk]:
        """The answer as it is accepted, round by round; the last chunk has finish_reason and stats."""
        request = self._request(prompt, chat, raw, max_new_tokens, temperature, top_p, top_k, seed, stop,
                                stop_token_ids, policy, k, session_id, tenant)
        call = self._stub.GenerateStream(request, timeout=timeout if timeout is not None else self.timeout,
                                        metadata=self._metadata)
        try:
            for msg in call:
                last = msg.finish_reason != 0
                yield StreamChunk(
                    msg.text, list(msg.token_ids), msg.session_id,
                    convert.finish_reason_name(msg.finish_reason) if last else None,
                    convert.stats_from_proto(msg.stats) if last else None,
                )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None
        finally:
            call.cancel()  # a no-op after the last message; stops the server's work when we stop early

    def health(self, service: str = "specpool.v1.SpecPool", timeout: float = 10.0) -> str:
        """The gRPC health status name of ``service`` ("" = the whole server): SERVING, NOT_SERVING, ..."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            response = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                       timeout=timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def _request(self, prompt, chat, raw, max_new_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids,
                 policy, k, session_id, tenant):
        if chat is not None and (prompt is not None or raw):
            raise InvalidArgument("give either a prompt or chat messages, not both")
        return convert.request_to_proto(
            prompt=None if raw or chat is not None else prompt, raw_prompt=prompt if raw else None, chat=chat,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, policy=policy, k=k, session_id=session_id,
            tenant=self.tenant if tenant is None else tenant,
        )

    # -- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "SpecPoolClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
