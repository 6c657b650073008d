"""A TLS front for the public gRPC endpoint: TLS (optionally mutual) outside, Serve's gRPC proxy inside.

Ray Serve's gRPC proxy has no TLS option (its gRPCOptions are a port, servicer functions, a timeout
and reflection), so the public endpoint gets a small gRPC server of its own that terminates TLS and
forwards every call, as raw bytes, to the proxy on loopback:

    client --TLS--> tls_front (listen, e.g. 0.0.0.0:9443) --plaintext, loopback--> Serve proxy (127.0.0.1:9000)

It knows no service: one generic handler takes every method (specpool.v1.SpecPool,
grpc.health.v1.Health, server reflection, whatever the proxy serves next) and forwards it as a
stream-stream call. On the wire a gRPC call is a stream of messages each way whatever its declared
kind, so a unary, server-streaming, client-streaming or bidirectional method all pass unchanged;
the upstream server, which knows the method, reads and answers as its own kind says. What a
client sends besides the messages passes through too: metadata (the ``authorization`` API key,
``request_id``, ``application``), the deadline (as the upstream call's timeout), and a client
cancel, which cancels the upstream call (the router then stops the request and frees its caches).
What comes back: the upstream's initial and trailing metadata, messages, and status code and
details unchanged.

The certificate and key are read from files (on Kubernetes a mounted ``kubernetes.io/tls`` Secret,
e.g. one cert-manager keeps renewed) and re-read when a file changes, at the next handshake, so a
renewed certificate needs no restart. With ``client_ca_file`` clients must present a certificate
signed by that CA (mutual TLS).

``start_tls_front(listen, upstream, cert_file, key_file)`` runs it on its own event loop thread
(beside ``specpool serve``, or anything else) and returns a handle with ``port`` and
``stop(grace)``; ``python -m specpool.services.tls_front --listen ... --upstream ...`` runs it as a
process (the Kubernetes sidecar, k8s/rayservice.yaml) until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import grpc
import grpc.aio

from specpool.core.errors import InvalidArgument
from specpool.services.status import replica_died, replica_died_message

log = logging.getLogger(__name__)

# As large as the messages Serve's replicas take (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH in
# k8s/rayservice.yaml): the front must not be the hop that refuses a long prompt.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Metadata grpc sets itself on the upstream call; a client's copy must not be forwarded.
_HOP_BY_HOP = {"user-agent", "te", "content-type", "host", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding"}


def _identity(data: bytes) -> bytes:
    return data


def _forwardable(metadata) -> list[tuple[str, str | bytes]]:
    # grpc hands metadata as (key, value) pairs: namedtuples, plain tuples or an aio.Metadata.
    return [(key, value) for key, value in metadata or () if not key.startswith(":") and key not in _HOP_BY_HOP]


class _Forwarder(grpc.GenericRpcHandler):
    """Every method -> the same method upstream, bytes in, bytes out."""

    def __init__(self, channel: grpc.aio.Channel):
        self._channel = channel

    def service(self, handler_call_details):
        method = handler_call_details.method
        upstream = self._channel.stream_stream(method, request_serializer=_identity, response_deserializer=_identity)

        async def forward(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
            call = upstream(requests, timeout=context.time_remaining(),
                            metadata=_forwardable(context.invocation_metadata()))
            try:
                initial = await call.initial_metadata()
                if initial:
                    await context.send_initial_metadata(_forwardable(initial))
                async for reply in call:
                    yield reply
                trailing = await call.trailing_metadata()
                if trailing:
                    context.set_trailing_metadata(_forwardable(trailing))
            except grpc.aio.AioRpcError as exc:
                # The upstream's status, unchanged (a refused key stays UNAUTHENTICATED, a full
                # queue RESOURCE_EXHAUSTED with its retry hint in the trailers).
                if exc.trailing_metadata():
                    context.set_trailing_metadata(_forwardable(exc.trailing_metadata()))
                if replica_died(exc.code(), exc.details()):  # Serve's INTERNAL for a dead replica: retryable
                    await context.abort(grpc.StatusCode.UNAVAILABLE, replica_died_message(exc.details()))
                await context.abort(exc.code(), exc.details() or "")
            finally:
                # A client that cancelled (or whose deadline passed) cancels the task running this
                # generator: cancelling the upstream call makes the router stop the request.
                # No-op when the call has already ended.
                call.cancel()

        return grpc.stream_stream_rpc_method_handler(forward, request_deserializer=_identity, response_serializer=_identity)


class _CertificateFiles:
    """The server's certificate configuration from files, re-read when one of them changes."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None):
        self.paths = [Path(p) for p in (cert_file, key_file, client_ca_file) if p is not None]
        for path in self.paths:
            if not path.is_file():
                raise InvalidArgument(f"TLS: {path} is not a file (certificate, key or client CA)")
        self.client_ca = client_ca_file is not None
        self._stamp = None
        self.initial = self._load()

    def _stamps(self):
        return tuple((p.stat().st_mtime_ns, p.stat().st_size) for p in self.paths)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        stamp = self._stamps()
        cert, key, *ca = (p.read_bytes() for p in self.paths)
        if b"PRIVATE KEY" not in key or b"CERTIFICATE" not in cert:
            raise InvalidArgument(f"TLS: expected a PEM certificate in {self.paths[0]} and a PEM private key in {self.paths[1]}")
        self._stamp = stamp
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca[0] if ca else None)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by grpc at each new handshake: a new configuration when the files changed, else None."""
        try:
            if self._stamps() == self._stamp:
                return None
            return self._load()
        except (OSError, InvalidArgument) as exc:  # mid-rotation (one file written, not the other): keep the old one
            log.warning("TLS front: keeping the current certificate (%s)", exc)
            return None


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> grpc.ServerCredentials:
    files = _CertificateFiles(cert_file, key_file, client_ca_file)
    return grpc.dynamic_ssl_server_credentials(files.initial, files.fetch, require_client_authentication=files.client_ca)


def free_port() -> int:
    """A TCP port free now (for the plaintext server behind the front, e.g. Serve's proxy)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class TlsFront:
    """A running front: ``port`` it listens on, ``stop(grace)`` to end it."""

    port: int
    upstream: str
    _loop: asyncio.AbstractEventLoop
    _server: grpc.aio.Server
    _channel: grpc.aio.Channel
    _thread: threading.Thread

    def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, let calls in flight finish for ``grace`` seconds, then cancel them."""
        if not self._thread.is_alive():
            return

        async def shutdown():
            await self._server.stop(grace)
            await self._channel.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def start_tls_front(listen: str, upstream: str, cert_file: str, key_file: str,
                    client_ca_file: str | None = None) -> TlsFront:
    """Listen on ``listen`` (HOST:PORT; port 0 picks one) with TLS and forward every call to the
    plaintext gRPC server at ``upstream`` (HOST:PORT, normally Serve's proxy on loopback)."""
    credentials = server_credentials(cert_file, key_file, client_ca_file)  # bad files: an error before anything starts
    loop = asyncio.new_event_loop()
    started: dict = {}
    ready = threading.Event()

    async def start():
        channel = grpc.aio.insecure_channel(upstream, options=_CHANNEL_OPTIONS)
        server = grpc.aio.server(options=_CHANNEL_OPTIONS)
        server.add_generic_rpc_handlers((_Forwarder(channel),))
        port = server.add_secure_port(listen, credentials)
        if port == 0:
            raise InvalidArgument(f"TLS front: cannot listen on {listen} (in use, or not an address of this host)")
        await server.start()
        return port, server, channel

    def run():
        asyncio.set_event_loop(loop)
        try:
            started["value"] = loop.run_until_complete(start())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            started["error"] = exc
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, name="specpool-tls-front", daemon=True)
    thread.start()
    ready.wait()
    if "error" in started:
        thread.join()
        raise started["error"]
    port, server, channel = started["value"]
    return TlsFront(port, upstream, loop, server, channel, thread)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specpool.services.tls_front", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="0.0.0.0:9443", help="HOST:PORT to serve TLS on (default 0.0.0.0:9443)")
    parser.add_argument("--upstream", default="127.0.0.1:9000", help="the plaintext gRPC server (default Serve's proxy, 127.0.0.1:9000)")
    parser.add_argument("--cert", required=True, help="PEM certificate chain (tls.crt of a kubernetes.io/tls Secret)")
    parser.add_argument("--key", required=True, help="PEM private key (tls.key)")
    parser.add_argument("--client-ca", default=None, help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    parser.add_argument("--grace-s", type=float, default=20.0, help="on SIGTERM, how long calls in flight may finish (default 20)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m specpool.services.tls_front``: the front as a process (the Kubernetes sidecar)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        front = start_tls_front(args.listen, args.upstream, args.cert, args.key, args.client_ca)
    except InvalidArgument as exc:
        print(f"specpool tls front: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"specpool tls front: TLS{' (mutual)' if args.client_ca else ''} on port {front.port} -> {args.upstream}",
          file=sys.stderr, flush=True)
    stop.wait()
    front.stop(args.grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
