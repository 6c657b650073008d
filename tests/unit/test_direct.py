"""Same-node direct routes (specpool/services/direct.py): a real loopback gRPC endpoint on its own event loop,
called through ``DeploymentCaller`` the way the router calls a model replica. Ray Serve's handle is
replaced by a stand-in that answers the way a replica does (its response carries the route); the
real Serve path is covered by tests/integration/test_served.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specpool.core.errors import InvalidArgument
from specpool.services import direct
from specpool.services.direct import DirectEndpoint, DirectRoutes
from specpool.v1 import common_pb2, drafter_pb2
from specpool.services.remote import DeploymentCaller

NODE = "node-a"


class Replica:
    """A drafter replica's two methods on an event loop of its own thread, plus its endpoint."""

    def __init__(self, node: str = NODE):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proposals = 0
        self.paths: list[bool] = []  # per Propose, whether it ran for a direct call
        self.released: list[str] = []
        self.endpoint = DirectEndpoint("drafter", {"Propose": self.Propose, "Release": self.Release}, node_id=lambda: node)

    async def Propose(self, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        if request.k == 99:
            raise InvalidArgument("k (draft length) must be in 1..32, got 99")
        self.proposals += 1
        self.paths.append(direct.in_direct_call())
        response = drafter_pb2.ProposeResponse(tokens=[request.k, self.proposals])
        route = await self.endpoint.route()
        if route is not None:
            response.direct.CopyFrom(route)
        return response

    async def Release(self, request: common_pb2.ReleaseRequest) -> common_pb2.ReleaseResponse:
        self.released.append(request.session_id)
        return common_pb2.ReleaseResponse(released=True)

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def stop(self):
        self.run(self.endpoint.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class ServeStandIn:
    """What the router's DeploymentCaller needs of a Serve handle: options(...).remote(msg).result()."""

    def __init__(self, replica: Replica):
        self.replica = replica
        self.calls = 0

    def options(self, method_name: str, **_):
        stand_in = self

        class _Call:
            def remote(self, message):
                stand_in.calls += 1
                result = stand_in.replica.run(getattr(stand_in.replica, method_name)(message))

                class _Response:
                    def result(self, timeout_s=None):
                        return result
                return _Response()
        return _Call()


@pytest.fixture
def replica():
    r = Replica()
    yield r
    r.stop()


def propose(k: int = 5) -> drafter_pb2.ProposeRequest:
    return drafter_pb2.ProposeRequest(session_id="s1", context_ids=[1, 2, 3], k=k)


def test_a_sessions_later_calls_go_straight_to_its_replica(replica):
    serve = ServeStandIn(replica)
    routes = DirectRoutes("drafter", NODE)
    caller = DeploymentCaller(serve, "drafter 'x'", direct=routes)
    first = caller.call("Propose", propose(), "s1")
    assert serve.calls == 1 and first.direct.address.startswith("127.0.0.1:") and first.direct.token
    second = caller.call("Propose", propose(4), "s1")
    assert list(second.tokens) == [4, 2]  # answered by the same replica's method
    assert serve.calls == 1 and replica.endpoint.calls == 1 and routes.calls == 1
    caller.call("Propose", propose(), "s2")  # another session starts through Serve
    assert serve.calls == 2
    assert caller.call("Release", common_pb2.ReleaseRequest(session_id="s1"), "s1").released
    assert replica.released == ["s1"] and serve.calls == 2 and routes.route_of("s1") is None
    caller.call("Propose", propose(), "s1")  # released: the session's next request starts over
    assert serve.calls == 3
    # The method knows which way each call came (the target's batch trace counts calls by path).
    assert replica.paths == [False, True, False, False]
    assert not direct.in_direct_call()  # the mark does not leak out of the call


def test_an_end_of_request_notice_keeps_the_sessions_route(replica):
    """Release with keep_caches (the request ended, the caches stay) goes direct and keeps the route:
    the session's next request still reaches its replica directly."""
    serve = ServeStandIn(replica)
    routes = DirectRoutes("drafter", NODE)
    caller = DeploymentCaller(serve, "drafter 'x'", direct=routes)
    caller.call("Propose", propose(), "s1")
    caller.call("Release", common_pb2.ReleaseRequest(session_id="s1", keep_caches=True), "s1")
    assert replica.released == ["s1"] and serve.calls == 1 and routes.route_of("s1") is not None
    caller.call("Propose", propose(), "s1")
    assert serve.calls == 1 and replica.endpoint.calls == 2


def test_domain_errors_raise_as_the_replica_raised_them(replica):
    caller = DeploymentCaller(ServeStandIn(replica), "drafter 'x'", direct=DirectRoutes("drafter", NODE))
    caller.call("Propose", propose(), "s1")
    with pytest.raises(InvalidArgument, match="got 99"):
        caller.call("Propose", propose(99), "s1")  # over the direct route
    with pytest.raises(InvalidArgument, match="got 99"):
        caller.call("Propose", propose(99), "s9")  # through Serve


def test_a_gone_replica_sends_the_session_back_through_serve(replica):
    serve = ServeStandIn(replica)
    routes = DirectRoutes("drafter", NODE)
    caller = DeploymentCaller(serve, "drafter 'x'", direct=routes)
    old = caller.call("Propose", propose(), "s1").direct.address
    replica.run(replica.endpoint.stop())  # the replica's endpoint is gone (as when it dies)
    replacement = Replica()
    try:
        serve.replica = replacement  # Serve now routes the session to a live replica
        answer = caller.call("Propose", propose(3), "s1")
        assert list(answer.tokens) == [3, 1] and serve.calls == 2 and routes.fallbacks == 1
        assert routes.route_of("s1").address == answer.direct.address != old  # the new route is learned
        caller.call("Propose", propose(), "s1")
        assert serve.calls == 2 and replacement.endpoint.calls == 1
    finally:
        replacement.stop()


def test_the_endpoint_refuses_calls_without_its_token(replica):
    route = replica.run(replica.endpoint.route())
    routes = DirectRoutes("drafter", NODE)
    forged = drafter_pb2.ProposeResponse()
    forged.direct.CopyFrom(common_pb2.DirectRoute(node_id=NODE, address=route.address, token="guess"))
    routes.learn("s1", forged)
    assert routes.call("Propose", propose(), "s1") is None  # refused: the caller goes through Serve
    assert replica.proposals == 0 and replica.endpoint.calls == 0 and routes.route_of("s1") is None


def test_routes_to_another_node_or_without_a_token_are_not_kept(replica):
    route = replica.run(replica.endpoint.route())
    routes = DirectRoutes("drafter", "node-b")
    response = drafter_pb2.ProposeResponse()
    response.direct.CopyFrom(route)
    routes.learn("s1", response)  # the replica is on node-a
    assert routes.route_of("s1") is None
    here = DirectRoutes("drafter", NODE)
    response.direct.token = ""
    here.learn("s1", response)
    assert here.route_of("s1") is None
    here.learn("s1", common_pb2.ReleaseResponse(released=True))  # a message without a route field
    assert here.route_of("s1") is None


def test_routes_are_bounded(replica, monkeypatch):
    monkeypatch.setattr(direct, "MAX_ROUTES", 3)
    caller = DeploymentCaller(ServeStandIn(replica), "drafter 'x'", direct=DirectRoutes("drafter", NODE))
    for session in ("a", "b", "c", "d"):
        caller.call("Propose", drafter_pb2.ProposeRequest(session_id=session, context_ids=[1], k=1), session)
    assert [s for s in "abcd" if caller.direct.route_of(s) is not None] == ["b", "c", "d"]


def test_without_direct_routes_every_call_goes_through_serve(replica):
    serve = ServeStandIn(replica)
    caller = DeploymentCaller(serve, "drafter 'x'")
    for _ in range(3):
        caller.call("Propose", propose(), "s1")
    assert serve.calls == 3 and replica.endpoint.calls == 0
