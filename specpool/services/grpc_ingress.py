"""The SpecPool gRPC service as Serve's gRPC proxy registers it (``grpc_options.grpc_servicer_functions``).

The generated ``specpool_pb2_grpc.add_SpecPoolServicer_to_server`` gives the proxy
``GenerateRequest.FromString`` as the request deserializer. Serve's proxy runs it before any of our
code, and grpc answers a deserializer that raises with UNKNOWN ("Unexpected <class
DecodeError>"): bytes that are not a GenerateRequest, which are the caller's mistake, looked like a
server fault. This registration is the same service with a deserializer that never raises.
Undecodable bytes become an ``UndecodableRequest``, which Serve carries to the router like any
request, and the router answers INVALID_ARGUMENT (``specpool.services.api.spec_from_proto``).
"""

from __future__ import annotations

import grpc

from specpool.v1 import specpool_pb2

SERVICE = "specpool.v1.SpecPool"


class UndecodableRequest:
    """Request bytes that did not parse as ``message_type``; ``error`` says why."""

    def __init__(self, message_type: str, error: str):
        self.message_type = message_type
        self.error = error

    def __repr__(self) -> str:
        return f"UndecodableRequest({self.message_type!r}, {self.error!r})"


def tolerant_deserializer(message_class):
    """``message_class.FromString``, except that bytes it cannot parse give an ``UndecodableRequest``."""
    name = message_class.DESCRIPTOR.full_name

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and friends: the caller's bytes, not our fault
            return UndecodableRequest(name, f"{type(exc).__name__}: {exc}"[:300])

    return deserialize


def method_handlers(servicer) -> dict[str, grpc.RpcMethodHandler]:
    """The service's methods (as the generated registration has them), tolerant of bad bytes."""
    request = tolerant_deserializer(specpool_pb2.GenerateRequest)
    return {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=request,
            response_serializer=specpool_pb2.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=request,
            response_serializer=specpool_pb2.GenerateStreamResponse.SerializeToString),
    }


def add_specpool_servicer_to_server(servicer, server) -> None:
    """Drop-in for ``specpool_pb2_grpc.add_SpecPoolServicer_to_server`` (same service, same methods)."""
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


__all__ = ["SERVICE", "UndecodableRequest", "add_specpool_servicer_to_server", "method_handlers", "tolerant_deserializer"]
