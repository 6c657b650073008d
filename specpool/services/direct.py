"""Same-node direct calls from the router to the model replica that holds a session's caches.

Ray Serve routes every internal call (``specpool/services/remote.py``): the caller's handle picks the
replica on its consistent-hash ring, and the replica's request wrapper runs our method. That costs
about 6 ms a call on 2 cores (two calls per round), most of it thread and process wake-ups around
Serve's own event loops, against 0.5 to 2 ms for the same work embedded. So, per session:

1. its first call goes through Serve as always (routing, affinity, back-pressure, failover);
2. the replica answers with a ``DirectRoute``: its node id, a loopback gRPC endpoint it opened
   on first use, and a random token, all inside the response Serve carried back;
3. the router's later calls for that session, when the router runs on the same node, go to that
   endpoint with the token, which runs the same ``Propose`` / ``Verify`` / ``Release`` method on
   the replica's event loop, so ``@serve.batch`` and the model thread are shared with Serve's path;
4. a direct call that cannot connect (the replica died, was replaced or scaled away) drops the
   route, and the call is made through Serve again, which moves the session like any other failover.

What the direct path does not do: Serve's request metrics and ``max_ongoing_requests`` do not see
direct calls (autoscaling on ongoing requests counts each session's first call only), and the
endpoint only listens on 127.0.0.1, so routers on other nodes (KubeRay's worker pods) always use
Serve. ``RouterArgs.direct_calls`` turns it off.
"""

from __future__ import annotations

import asyncio
import contextvars
import secrets
import threading
from collections import OrderedDict
from typing import Any, Awaitable, Callable

import grpc

from specpool.core.errors import SpecpoolError
from specpool.services.client import error_from_rpc
from specpool.services.status import grpc_status
from specpool.v1 import common_pb2, drafter_pb2_grpc, target_pb2_grpc

TOKEN_METADATA = "x-specpool-direct-token"
LOOPBACK = "127.0.0.1"
MAX_ROUTES = 4096  # sessions remembered per caller; the least recently used are forgotten
# True inside a method a direct call runs (the target's batch trace counts calls by path).
_IN_DIRECT_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("specpool_in_direct_call", default=False)


def in_direct_call() -> bool:
    """Whether the running method was called over a direct route (not through Serve).

    A function rather than the context variable itself: a Serve deployment's class is pickled, and
    a context variable cannot be."""
    return _IN_DIRECT_CALL.get()


def _node_id() -> str:
    import ray  # here: only a replica or router inside Ray asks, and importing Ray takes seconds

    return ray.get_runtime_context().get_node_id()


# -- the replica's side ---------------------------------------------------------------------------------
class DirectEndpoint:
    """A model replica's loopback gRPC server, opened on first use, on the replica's event loop.

    ``methods`` maps a method name ("Propose", "Verify", "Release") to the replica's own async
    method; ``service`` is "drafter" or "target" (which generated servicer to register)."""

    def __init__(self, service: str, methods: dict[str, Callable[[Any], Awaitable[Any]]],
                 node_id: Callable[[], str] = _node_id):
        self.service = service
        self.methods = methods
        self.node_id = node_id
        self.calls = 0  # direct calls answered (tests and Stats)
        self._route: common_pb2.DirectRoute | None = None
        self._server: Any = None
        self._starting: asyncio.Lock | None = None

    async def route(self) -> common_pb2.DirectRoute | None:
        """This replica's route, starting the server the first time; None when it cannot start
        (the caller then simply keeps using Serve)."""
        if self._route is not None:
            return self._route
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._route is None:
                try:
                    self._route = await self._start()
                except Exception:  # noqa: BLE001 - no port, no loopback: Serve's path still works
                    self._route = common_pb2.DirectRoute()
        return self._route if self._route.address else None

    async def _start(self) -> common_pb2.DirectRoute:
        token = secrets.token_urlsafe(24)
        # 64 MB as the router's channels: a white-box prefill's features are 1,152 bytes a position.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        servicer = _Servicer(self, token)
        if self.service == "drafter":
            drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
        else:
            target_pb2_grpc.add_TargetServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"{LOOPBACK}:0")
        await server.start()
        self._server = server
        return common_pb2.DirectRoute(node_id=self.node_id(), address=f"{LOOPBACK}:{port}", token=token)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None


class _Servicer:
    """The generated servicer interfaces, answered by the replica's own methods."""

    def __init__(self, endpoint: DirectEndpoint, token: str):
        self._endpoint = endpoint
        self._token = token

    async def _call(self, method: str, request: Any, context: Any) -> Any:
        metadata = dict(context.invocation_metadata() or ())
        if not secrets.compare_digest(str(metadata.get(TOKEN_METADATA, "")), self._token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a direct call needs the token of this replica's route")
        self._endpoint.calls += 1
        marked = _IN_DIRECT_CALL.set(True)
        try:
            return await self._endpoint.methods[method](request)
        except Exception as exc:  # noqa: BLE001 - the one mapping to status codes, as on Serve's path
            code, message = grpc_status(exc)
            await context.abort(code, message)
        finally:
            _IN_DIRECT_CALL.reset(marked)

    async def Propose(self, request, context):
        return await self._call("Propose", request, context)

    async def Replay(self, request, context):
        return await self._call("Replay", request, context)

    async def Verify(self, request, context):
        return await self._call("Verify", request, context)

    async def Release(self, request, context):
        return await self._call("Release", request, context)


# -- the router's side ----------------------------------------------------------------------------------
class DirectRoutes:
    """Per session, the direct route its replica offered; blocking calls over it (router threads).

    ``local_node`` is the router's node id: routes to other nodes are not kept."""

    def __init__(self, service: str, local_node: str):
        self.service = service
        self.local_node = local_node
        self.calls = 0  # calls made directly (tests)
        self.fallbacks = 0  # direct calls that could not connect and went through Serve instead
        self._routes: OrderedDict[str, common_pb2.DirectRoute] = OrderedDict()
        self._stubs: dict[str, Any] = {}  # address -> stub (one channel per replica endpoint, kept for the process)
        self._lock = threading.Lock()

    def learn(self, session_id: str, response: Any) -> None:
        """Keep the route a response carried, if it is usable from here."""
        if not session_id or "direct" not in response.DESCRIPTOR.fields_by_name or not response.HasField("direct"):
            return
        route = response.direct
        if route.node_id != self.local_node or not route.address or not route.token:
            return
        with self._lock:
            self._routes[session_id] = route
            self._routes.move_to_end(session_id)
            while len(self._routes) > MAX_ROUTES:
                self._routes.popitem(last=False)

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._routes.pop(session_id, None)

    def route_of(self, session_id: str) -> common_pb2.DirectRoute | None:
        with self._lock:
            route = self._routes.get(session_id)
            if route is not None:
                self._routes.move_to_end(session_id)
            return route

    def _stub(self, address: str) -> Any:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                                  ("grpc.max_send_message_length", 64 << 20)])
                stub = (drafter_pb2_grpc.DrafterStub if self.service == "drafter" else target_pb2_grpc.TargetStub)(channel)
                self._stubs[address] = stub
            return stub

    def call(self, method: str, message: Any, session_id: str, timeout_s: float | None = None) -> Any | None:
        """The response of a direct call, or None when the session has no route or the route is
        gone (the caller then goes through Serve). Domain errors raise as the SpecpoolError the
        replica raised; no answer within ``timeout_s``: DeadlineExceeded."""
        route = self.route_of(session_id)
        if route is None:
            return None
        try:
            response = getattr(self._stub(route.address), method)(message, metadata=((TOKEN_METADATA, route.token),),
                                                                  timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED):
                # Gone (or restarted with a new token on the same port): back to Serve, which
                # routes the session to a live replica and hands out a fresh route.
                self.forget(session_id)
                with self._lock:
                    self.fallbacks += 1
                return None
            raise _domain_error(exc) from None
        with self._lock:
            self.calls += 1
        return response


def _domain_error(exc: grpc.RpcError) -> SpecpoolError:
    return error_from_rpc(exc, "a model replica")
