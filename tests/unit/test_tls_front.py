"""The TLS front (specpool/services/tls_front.py) between real gRPC clients and a real plaintext
gRPC server on loopback: answers, metadata, deadlines, statuses and cancels pass through; plaintext
and (with a client CA) certificate-less clients are refused; a renewed certificate is picked up.

The upstream is a small servicer of the real specpool.v1 SpecPool interface plus the real health
servicer: what is under test is the front, not the router."""

from __future__ import annotations

import datetime
import ipaddress
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specpool.core.errors import InvalidArgument
from specpool.services.tls_front import start_tls_front
from specpool.v1 import specpool_pb2, specpool_pb2_grpc

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

HOST = "specpool.test"  # the name in the server certificate; clients override the target name to it


# -- certificates --------------------------------------------------------------------------------
def _name(cn: str):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, issuer=None, ca: bool = False, san: list | None = None):
    """(certificate, key); self-signed when ``issuer`` (certificate, key) is None."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    signer_cert, signer_key = issuer if issuer else (None, key)
    builder = (x509.CertificateBuilder().subject_name(_name(subject))
               .issuer_name(signer_cert.subject if signer_cert else _name(subject))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(signer_key, hashes.SHA256()), key


def _pem(cert=None, key=None) -> bytes:
    if cert is not None:
        return cert.public_bytes(serialization.Encoding.PEM)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


class Pki:
    """A CA, a server certificate for HOST and a client certificate, as PEM files in ``folder``."""

    def __init__(self, folder, tag: str = ""):
        self.ca, ca_key = _issue(f"specpool test CA{tag}", ca=True)
        server, server_key = _issue(HOST, (self.ca, ca_key), san=[x509.DNSName(HOST), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        client, client_key = _issue("client", (self.ca, ca_key))
        self.ca_pem = _pem(self.ca)
        self.client_pem, self.client_key_pem = _pem(client), _pem(key=client_key)
        self.files = {}
        for name, data in {"ca.crt": self.ca_pem, "tls.crt": _pem(server), "tls.key": _pem(key=server_key)}.items():
            (folder / name).write_bytes(data)
            self.files[name] = str(folder / name)


# -- the upstream: a plaintext gRPC server ---------------------------------------------------------
class Upstream(specpool_pb2_grpc.SpecPoolServicer):
    """Echoes prompts, streams max_new_tokens chunks, fails on request, records what arrives."""

    def __init__(self):
        self.calls: list[dict] = []
        self.stream_cancelled = threading.Event()

    def _record(self, request, context):
        self.calls.append({"prompt": request.prompt, "metadata": dict(context.invocation_metadata()),
                           "time_remaining": context.time_remaining()})

    def Generate(self, request, context):
        self._record(request, context)
        if request.prompt == "died":  # how Serve's proxy words a replica that died under the call
            context.abort(grpc.StatusCode.INTERNAL, "The actor died unexpectedly before finishing this task.\n"
                                                    "\tclass_name: ServeReplica:router:Router")
        if request.prompt.startswith("fail:"):
            code = grpc.StatusCode[request.prompt.split(":")[1]]
            context.set_trailing_metadata((("retry-after-ms", "250"),))
            context.abort(code, f"refused: {request.tenant or 'no tenant'}")
        return specpool_pb2.GenerateResponse(text=request.prompt.upper(), token_ids=[1, 2, 3], session_id=request.session_id)

    def GenerateStream(self, request, context):
        self._record(request, context)
        context.add_callback(lambda: None if context.is_active() else self.stream_cancelled.set())
        for i in range(request.max_new_tokens):
            yield specpool_pb2.GenerateStreamResponse(text=f"{request.prompt}{i}", token_ids=[i])
        if request.prompt == "hang":  # a long request: runs until the client goes away
            deadline = time.monotonic() + 30
            while context.is_active() and time.monotonic() < deadline:
                time.sleep(0.01)


@pytest.fixture
def upstream():
    servicer = Upstream()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    specpool_pb2_grpc.add_SpecPoolServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture
def pki(tmp_path):
    return Pki(tmp_path)


@pytest.fixture
def front(upstream, pki):
    handle = start_tls_front("127.0.0.1:0", upstream[1], pki.files["tls.crt"], pki.files["tls.key"])
    yield handle
    handle.stop(0)


def _channel(port: int, root: bytes, client: tuple[bytes, bytes] | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=client[1] if client else None,
                                               certificate_chain=client[0] if client else None)
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", HOST)])


# -- the tests -----------------------------------------------------------------------------------
def test_unary_streaming_and_health_through_tls(upstream, pki, front):
    servicer, _ = upstream
    with _channel(front.port, pki.ca_pem) as channel:
        stub = specpool_pb2_grpc.SpecPoolStub(channel)
        reply = stub.Generate(specpool_pb2.GenerateRequest(prompt="hello", session_id="s1"), timeout=10)
        assert (reply.text, list(reply.token_ids), reply.session_id) == ("HELLO", [1, 2, 3], "s1")
        chunks = list(stub.GenerateStream(specpool_pb2.GenerateRequest(prompt="p", max_new_tokens=4), timeout=10))
        assert [c.text for c in chunks] == ["p0", "p1", "p2", "p3"]
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert [c["prompt"] for c in servicer.calls] == ["hello", "p"]


def test_metadata_and_deadline_arrive_upstream(upstream, pki, front):
    servicer, _ = upstream
    with _channel(front.port, pki.ca_pem) as channel:
        stub = specpool_pb2_grpc.SpecPoolStub(channel)
        stub.Generate(specpool_pb2.GenerateRequest(prompt="m"), timeout=7,
                      metadata=(("authorization", "Bearer sp-secret"), ("request_id", "r-1"), ("trace-bin", b"\x00\xff")))
        stub.Generate(specpool_pb2.GenerateRequest(prompt="no deadline"))
    first, second = servicer.calls
    assert {k: first["metadata"].get(k) for k in ("authorization", "request_id", "trace-bin")} == {
        "authorization": "Bearer sp-secret", "request_id": "r-1", "trace-bin": b"\x00\xff"}
    # The deadline arrives, shortened by the hops and not replaced. A little over 7 s is allowed:
    # gRPC core's grpc-timeout encoding "may round up" (timeout_encoding.h), once per hop; a CI run
    # saw 7.008 s upstream. A front that dropped the deadline or set its own would still fail here.
    assert 5.0 < first["time_remaining"] <= 7.25, first["time_remaining"]
    assert "authorization" not in second["metadata"]
    assert second["time_remaining"] is None or second["time_remaining"] > 1e6  # no deadline stays none


@pytest.mark.parametrize("code", ["UNAUTHENTICATED", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"])
def test_status_code_details_and_trailers_come_back_unchanged(upstream, pki, front, code):
    with _channel(front.port, pki.ca_pem) as channel:
        stub = specpool_pb2_grpc.SpecPoolStub(channel)
        with pytest.raises(grpc.RpcError) as failure:
            stub.Generate(specpool_pb2.GenerateRequest(prompt=f"fail:{code}", tenant="b"), timeout=10)
    assert failure.value.code() == grpc.StatusCode[code]
    assert failure.value.details() == "refused: b"
    assert ("retry-after-ms", "250") in tuple(failure.value.trailing_metadata() or ())


def test_a_replica_that_died_under_the_call_is_a_retryable_unavailable(upstream, pki, front):
    with _channel(front.port, pki.ca_pem) as channel:
        with pytest.raises(grpc.RpcError) as failure:
            specpool_pb2_grpc.SpecPoolStub(channel).Generate(specpool_pb2.GenerateRequest(prompt="died"), timeout=10)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "died mid-request" in failure.value.details() and "retry" in failure.value.details()


def test_a_client_cancel_cancels_the_upstream_call(upstream, pki, front):
    servicer, _ = upstream
    with _channel(front.port, pki.ca_pem) as channel:
        call = specpool_pb2_grpc.SpecPoolStub(channel).GenerateStream(
            specpool_pb2.GenerateRequest(prompt="hang", max_new_tokens=1), timeout=30)
        assert next(call).text == "hang0"  # the upstream is now inside its long request
        assert not servicer.stream_cancelled.is_set()
        call.cancel()
        assert servicer.stream_cancelled.wait(5), "the upstream call was not cancelled"


def test_an_expired_deadline_ends_the_upstream_call(upstream, pki, front):
    servicer, _ = upstream
    with _channel(front.port, pki.ca_pem) as channel:
        call = specpool_pb2_grpc.SpecPoolStub(channel).GenerateStream(
            specpool_pb2.GenerateRequest(prompt="hang", max_new_tokens=1), timeout=1.0)
        with pytest.raises(grpc.RpcError) as failure:
            list(call)
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.stream_cancelled.wait(5), "the upstream call outlived the client's deadline"


def test_a_plaintext_client_is_refused(upstream, front):
    servicer, _ = upstream
    with grpc.insecure_channel(f"127.0.0.1:{front.port}") as channel:
        with pytest.raises(grpc.RpcError) as failure:
            specpool_pb2_grpc.SpecPoolStub(channel).Generate(specpool_pb2.GenerateRequest(prompt="x"), timeout=5)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls == []


def test_a_client_trusting_another_ca_is_refused(upstream, front, tmp_path):
    (tmp_path / "other").mkdir()
    other = Pki(tmp_path / "other", " other")
    with _channel(front.port, other.ca_pem) as channel:
        with pytest.raises(grpc.RpcError) as failure:
            specpool_pb2_grpc.SpecPoolStub(channel).Generate(specpool_pb2.GenerateRequest(prompt="x"), timeout=5)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    assert upstream[0].calls == []


def test_mutual_tls_needs_a_client_certificate(upstream, pki):
    handle = start_tls_front("127.0.0.1:0", upstream[1], pki.files["tls.crt"], pki.files["tls.key"], pki.files["ca.crt"])
    try:
        with _channel(handle.port, pki.ca_pem) as channel:
            with pytest.raises(grpc.RpcError) as failure:
                specpool_pb2_grpc.SpecPoolStub(channel).Generate(specpool_pb2.GenerateRequest(prompt="x"), timeout=5)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        with _channel(handle.port, pki.ca_pem, (pki.client_pem, pki.client_key_pem)) as channel:
            reply = specpool_pb2_grpc.SpecPoolStub(channel).Generate(specpool_pb2.GenerateRequest(prompt="x"), timeout=5)
        assert reply.text == "X"
    finally:
        handle.stop(0)
    assert [c["prompt"] for c in upstream[0].calls] == ["x"]


def test_a_renewed_certificate_is_served_without_a_restart(upstream, pki, front, tmp_path):
    (tmp_path / "new").mkdir()
    renewed = Pki(tmp_path / "new", " renewed")
    for name in ("tls.key", "tls.crt"):  # what the kubelet does when cert-manager renews the Secret
        (tmp_path / name).write_bytes((tmp_path / "new" / name).read_bytes())
    with _channel(front.port, renewed.ca_pem) as channel:
        reply = specpool_pb2_grpc.SpecPoolStub(channel).Generate(specpool_pb2.GenerateRequest(prompt="r"), timeout=10)
    assert reply.text == "R"


def test_bad_files_are_one_clear_error(upstream, pki, tmp_path):
    with pytest.raises(InvalidArgument, match="is not a file"):
        start_tls_front("127.0.0.1:0", upstream[1], str(tmp_path / "missing.crt"), pki.files["tls.key"])
    with pytest.raises(InvalidArgument, match="PEM private key"):
        start_tls_front("127.0.0.1:0", upstream[1], pki.files["tls.crt"], pki.files["tls.crt"])


def test_stop_refuses_new_calls(upstream, pki):
    handle = start_tls_front("127.0.0.1:0", upstream[1], pki.files["tls.crt"], pki.files["tls.key"])
    handle.stop(0)
    handle.stop(0)  # twice is harmless
    with _channel(handle.port, pki.ca_pem) as channel:
        with pytest.raises(grpc.RpcError) as failure:
            specpool_pb2_grpc.SpecPoolStub(channel).Generate(specpool_pb2.GenerateRequest(prompt="x"), timeout=3)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_sidecar_process_serves_and_stops_cleanly_on_sigterm(upstream, pki):
    """``python -m specpool.services.tls_front`` (the Kubernetes sidecar): serves, and on SIGTERM
    (a pod's termination) stops with exit status 0."""
    import re
    import signal
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "specpool.services.tls_front", "--listen", "127.0.0.1:0",
                                "--upstream", upstream[1], "--cert", pki.files["tls.crt"], "--key", pki.files["tls.key"],
                                "--grace-s", "1"], stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        match = re.search(r"on port (\d+) -> ", line)
        assert match, line
        with _channel(int(match.group(1)), pki.ca_pem) as channel:
            reply = specpool_pb2_grpc.SpecPoolStub(channel).Generate(specpool_pb2.GenerateRequest(prompt="side"), timeout=10)
        assert reply.text == "SIDE"
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
