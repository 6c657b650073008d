"""The SpecPool registration Serve's proxy uses: the generated service, with bytes that do not parse
answered INVALID_ARGUMENT by the router instead of grpc's UNKNOWN (specpool/services/grpc_ingress.py).
A real grpc server on loopback; the servicer checks requests as the router does (spec_from_proto)."""

from __future__ import annotations

import pickle
from concurrent import futures

import grpc
import pytest

from specpool.core.errors import InvalidArgument
from specpool.services.api import spec_from_proto
from specpool.services.grpc_ingress import (SERVICE, UndecodableRequest, add_specpool_servicer_to_server, method_handlers,
                                            tolerant_deserializer)
from specpool.v1 import specpool_pb2, specpool_pb2_grpc

GARBAGE = b"\xff\xff\xff\xff\x0f\x01"  # a varint that never ends: not any protobuf message


def test_the_same_service_and_methods_as_the_generated_registration():
    service = specpool_pb2.DESCRIPTOR.services_by_name["SpecPool"]
    assert SERVICE == service.full_name
    assert set(method_handlers(specpool_pb2_grpc.SpecPoolServicer())) == {m.name for m in service.methods}
    for method in service.methods:
        handler = method_handlers(specpool_pb2_grpc.SpecPoolServicer())[method.name]
        assert handler.response_streaming == method.server_streaming and not handler.request_streaming


def test_good_bytes_parse_and_bad_bytes_become_an_invalid_argument_at_the_router():
    parse = tolerant_deserializer(specpool_pb2.GenerateRequest)
    message = specpool_pb2.GenerateRequest(prompt="hello", max_new_tokens=3)
    assert parse(message.SerializeToString()) == message
    bad = parse(GARBAGE)
    assert isinstance(bad, UndecodableRequest) and bad.message_type == "specpool.v1.GenerateRequest"
    assert isinstance(pickle.loads(pickle.dumps(bad)), UndecodableRequest)  # Serve pickles it to the router
    with pytest.raises(InvalidArgument, match="not a valid specpool.v1.GenerateRequest"):
        spec_from_proto(bad)


class Router(specpool_pb2_grpc.SpecPoolServicer):
    def Generate(self, request, context):
        try:
            spec_from_proto(request)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return specpool_pb2.GenerateResponse(text="ok")


# The generated registration's failure: INTERNAL "Exception deserializing request!" on grpc's sync
# server (here), UNKNOWN "Unexpected <class DecodeError>" on the asyncio one (Serve's proxy).
@pytest.mark.parametrize("register, codes", [
    (add_specpool_servicer_to_server, {grpc.StatusCode.INVALID_ARGUMENT}),
    (specpool_pb2_grpc.add_SpecPoolServicer_to_server, {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}),
], ids=["tolerant", "generated"])
def test_over_grpc_undecodable_bytes_get_invalid_argument_where_the_generated_registration_fails(register, codes):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    register(Router(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            raw = channel.unary_unary(f"/{SERVICE}/Generate", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as failure:
                raw(GARBAGE, timeout=10)
            good = specpool_pb2.GenerateResponse.FromString(
                raw(specpool_pb2.GenerateRequest(prompt="hi").SerializeToString(), timeout=10))
    finally:
        server.stop(None)
    assert failure.value.code() in codes, (failure.value.code(), failure.value.details())
    assert good.text == "ok"
