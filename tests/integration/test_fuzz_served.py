"""Integration fuzz test: 10,000 malformed or random requests over gRPC, and 1,000 malformed HTTP
bodies, against a real `specpool serve` (Ray Serve, the real default target, the n-gram drafter,
Redis at 127.0.0.1:6379, API keys on with two tenants); no mocks.

A seeded generator (the seed is printed; set SPECPOOL_FUZZ_SEED to replay a run) builds requests
with random and bad fields (empty and huge prompts, huge max_new_tokens and k, negative/NaN/inf
floats, random unicode, random stop lists, session ids and tenants), hand-encoded protobuf with
invalid UTF-8, wrong wire types and unknown fields, truncated and bit-flipped messages and plain
garbage bytes, each with right, wrong, missing or garbage keys in the metadata. They go through a
generic channel with identity serializers, so any bytes reach the server as they are.

Every call must end with a status within its deadline (unanswered: 0), the server must stay
healthy (health SERVING, the same greedy answer as before the fuzz) and hold nothing for the
fuzz's requests afterwards (no request running; caches at most those of the successful requests,
then released). Requests that would run the model ask for at most 4 tokens, so the run stays
short (the 10,000 calls took 290 s on 2 cores shared with other jobs, less on an idle machine). The tallies are written to a JSON in the test's tmp dir (and to $SPECPOOL_FUZZ_REPORT/ when set).
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import time
import uuid
from collections import Counter
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import httpx
import pytest

from specpool.services.auth import add_key
from specpool.services.client import SpecPoolClient
from specpool.v1 import common_pb2, specpool_pb2

pytestmark = pytest.mark.integration

from redis_helpers import URL, connect_or_skip, delete_namespace
from serve_helpers import free_port as _free_port

POOL = ["ngram"]
GRPC_REQUESTS = 10_000
HTTP_BODIES = 1_000
CONCURRENCY = 8
DEADLINE_S = 120.0  # a call not ended by then is unanswered (refusals take milliseconds; the few model runs took up to 40 s on a loaded 2-core box)
MAX_RUN_TOKENS = 4  # requests that can run the model ask for at most this many tokens
GREEDY_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
METHODS = ("/specpool.v1.SpecPool/Generate", "/specpool.v1.SpecPool/GenerateStream")
INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82", b"\xf4\x90\x80\x80", b"ab\x80cd"]


def _call(handle, method: str, *args):
    return handle.options(method_name=method).remote(*args).result(timeout_s=120)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from ray import serve

    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import default_serve_config, plan_from_config

    raw_redis = connect_or_skip(decode_responses=True)
    keys_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = {"acme": add_key(keys_file, "acme"), "globex": add_key(keys_file, "globex")}
    namespace = f"specpool-fuzz-{uuid.uuid4().hex[:8]}"
    port, http_port = _free_port(), _free_port()
    config = default_serve_config(POOL, URL, port, http_port=http_port)
    router = next(a for a in config["applications"] if a["name"] == "router")
    router["args"].update(redis_namespace=namespace, api_keys_file=str(keys_file))
    local = start_local(plan_from_config(config, "the test config"), metrics_port=None,
                        progress=lambda m: print(f"[served] {m}", flush=True))
    handles = SimpleNamespace(router=serve.get_deployment_handle("Router", app_name="router"),
                              target=serve.get_deployment_handle("Target", app_name="target"),
                              drafter=serve.get_deployment_handle("Drafter", app_name="drafter-ngram"))
    yield SimpleNamespace(local=local, address=local.address, http_url=local.http_url, keys=keys, handles=handles)
    local.shutdown()
    delete_namespace(raw_redis, namespace)
    raw_redis.close()


@pytest.fixture(scope="module")
def seed() -> int:
    value = int(os.environ.get("SPECPOOL_FUZZ_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"fuzz seed: {value} (SPECPOOL_FUZZ_SEED={value} replays this run)", flush=True)
    return value


# -- the generator ------------------------------------------------------------------------------------------
class Fuzz:
    """Random requests: (method, bytes, metadata, whether it could run the model)."""

    def __init__(self, rng: random.Random, keys: dict[str, str]):
        self.r = rng
        self.keys = keys

    # strings
    _RANGES = [(0x20, 0x7E), (0xA0, 0x2FF), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F),
               (0x0, 0x1F), (0xE000, 0xF8FF), (0x10000, 0x10FFFF)]

    def unicode(self, n: int) -> str:
        """``n`` characters from every plane but the surrogates (protobuf strings are valid UTF-8;
        invalid bytes come from ``wire``)."""
        if not hasattr(self, "_chars"):  # drawn once per generator: choices() over it is fast
            self._chars = [chr(self.r.randint(*self.r.choice(self._RANGES))) for _ in range(4096)]
        return "".join(self.r.choices(self._chars, k=n))

    def text(self) -> str:
        roll = self.r.random()
        if roll < 0.1:
            return ""
        if roll < 0.55:
            return self.r.choice(["Hello", "Write a haiku about caches.", "def fib(n):", "2+2=", GREEDY_PROMPT])
        if roll < 0.85:
            return self.unicode(self.r.randint(1, 200))
        if roll < 0.98:
            return self.unicode(1) * self.r.randint(1, 300)
        return (self.unicode(1000) + " ") * self.r.randint(30, 100)  # 30-100 k characters: beyond the context

    def session_id(self) -> str:
        return self.r.choice([
            "", "", uuid.uuid4().hex, f"fuzz-{uuid.uuid4().hex[:12]}", f"shared-{self.r.randint(1, 3)}",  # collisions
            "x" * self.r.choice([128, 129, 500, 70_000]), "-leading-dash", "has space", "a/b", self.unicode(10), "é",
        ])

    def tenant(self, own: str | None) -> str:
        other = [t for t in self.keys if t != own]
        return self.r.choice(["", "", "", own or "", self.r.choice(other), "default", "t" * 65, "-bad", "bad tenant",
                              self.unicode(8), f"tenant{self.r.randint(0, 10**6)}", "acme.evil"])

    def floats(self) -> float:
        return self.r.choice([0.0, 0.0, 0.7, 1.0, -1.0, -0.0, math.nan, math.inf, -math.inf, 1e38, -1e-45, 3.4e38, 1e-30])

    # one protobuf request, fields valid or not at random
    def proto(self, own: str | None) -> tuple[bytes, bool]:
        r = self.r
        req = specpool_pb2.GenerateRequest()
        which = r.random()
        if which < 0.45:
            req.prompt = self.text()
        elif which < 0.65:
            req.raw_prompt = self.text()
        elif which < 0.9:
            for _ in range(r.choice([0, 1, 2, 5, 50])):
                req.chat.messages.add(role=r.choice(["user", "assistant", "system", "", "tool", self.unicode(5)]),
                                      content=self.text() if r.random() < 0.3 else r.choice(["hi", ""]))
        # else: no input at all
        if r.random() < 0.5:
            req.sampling.temperature = self.floats()
            if r.random() < 0.5:
                req.sampling.top_p = self.floats()
            req.sampling.top_k = r.choice([0, 1, 50, 2**31, 2**32 - 1])
            req.sampling.seed = r.choice([0, 1, -1, 2**63 - 1, -(2**63)])
        huge = r.random() < 0.2
        req.max_new_tokens = r.choice([2**20, 2**31, 2**32 - 1, 100_000]) if huge else r.randint(1, MAX_RUN_TOKENS)
        if r.random() < 0.3:
            req.stop.extend(r.choice([self.unicode(r.randint(0, 20)), "", "\n", "a" * 1000])
                            for _ in range(r.choice([1, 3, 20, 200])))
        if r.random() < 0.2:
            n = r.choice([1, 5, 1000])
            req.stop_token_ids.extend(struct.unpack(f"<{n}I", r.randbytes(4 * n)))  # any uint32, most beyond the vocabulary
        req.policy = r.choice(["", "", "metasd-ucb", "fixed:ngram", "fixed:nope", "ucb+warm", "nope", self.unicode(12)])
        req.k = r.choice([0, 0, 1, 5, 32, 33, 1000, 2**32 - 1])
        req.session_id = self.session_id()
        req.tenant = self.tenant(own)
        could_run = not huge and own is not None  # the server decides; this only bounds the model's work
        return req.SerializeToString(), could_run

    # hand-made wire bytes: invalid UTF-8, wrong wire types, unknown fields, truncation
    @staticmethod
    def varint(n: int) -> bytes:
        out = bytearray()
        n &= (1 << 64) - 1
        while True:
            byte, n = n & 0x7F, n >> 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(out)

    def field(self, number: int, wire: int, payload: bytes) -> bytes:
        return self.varint(number << 3 | wire) + payload

    def wire(self) -> bytes:
        r = self.r
        parts = []
        for _ in range(r.randint(1, 6)):
            kind = r.random()
            number = r.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 99, 536_870_911])
            if kind < 0.35:  # a string field with invalid UTF-8
                value = r.choice(INVALID_UTF8) * r.randint(1, 5)
                parts.append(self.field(r.choice([1, 3, 6, 8, 10, 11]), 2, self.varint(len(value)) + value))
            elif kind < 0.5:  # a chat message with invalid UTF-8 in its role or content
                bad = r.choice(INVALID_UTF8)
                message = self.field(r.choice([1, 2]), 2, self.varint(len(bad)) + bad)
                messages = self.field(1, 2, self.varint(len(message)) + message)
                parts.append(self.field(2, 2, self.varint(len(messages)) + messages))
            elif kind < 0.65:  # a wrong wire type for a known field, or an unknown field
                wire = r.choice([0, 1, 2, 5, 3, 4, 6, 7])
                payload = {0: self.varint(r.randrange(1 << 64)), 1: struct.pack("<d", math.nan), 5: struct.pack("<f", math.inf),
                           2: self.varint(3) + b"abc"}.get(wire, b"")
                parts.append(self.field(number, wire, payload))
            elif kind < 0.75:  # an out-of-range enum-like varint / negative int in uint32 fields
                parts.append(self.field(r.choice([5, 7, 9]), 0, self.varint(r.choice([-1, 2**40, 2**63]))))
            elif kind < 0.85:  # a length prefix longer than the data
                parts.append(self.field(number, 2, self.varint(r.choice([10, 2**31, 2**62])) + b"short"))
            elif kind < 0.92:  # a truncated varint
                parts.append(self.field(number, 0, b"\xff\xff\xff"))
            else:  # sampling params with garbage inside
                inner = bytes(r.randrange(256) for _ in range(r.randint(0, 30)))
                parts.append(self.field(4, 2, self.varint(len(inner)) + inner))
        return b"".join(parts)

    def garbage(self) -> bytes:
        n = self.r.choice([0, 1, 7, 100, 1000, 10_000])
        if self.r.random() < 0.002:
            n = 5 << 20  # over gRPC's default 4 MB message limit
        return self.r.randbytes(n)

    def mangled(self, own: str | None) -> bytes:
        """A request truncated or with flipped bits; drawn again while it would still parse into a
        request asking for a long run (a flip in max_new_tokens, a truncation dropping it: 0 is
        the server's default of 128 tokens), which is work, not malformed input."""
        while True:
            data = bytearray(self.proto(own)[0])
            if not data:
                return b"\x0a"
            if self.r.random() < 0.5:
                data = data[: self.r.randrange(len(data))]  # truncated
            else:
                for _ in range(self.r.randint(1, 8)):
                    data[self.r.randrange(len(data))] ^= 1 << self.r.randrange(8)  # bit flips
            try:
                parsed = specpool_pb2.GenerateRequest.FromString(bytes(data))
            except Exception:  # noqa: BLE001 - unparseable: exactly what this case is for
                return bytes(data)
            if 1 <= parsed.max_new_tokens <= MAX_RUN_TOKENS or parsed.max_new_tokens > 16_384:
                return bytes(data)

    def metadata(self) -> tuple[list[tuple[str, str | bytes]], str | None]:
        """(metadata, the tenant of a valid key in it or None)."""
        r = self.r
        roll = r.random()
        if roll < 0.35:
            return [("authorization", f"Bearer {self.keys['acme']}")], "acme"
        if roll < 0.6:
            return [("authorization", f"Bearer {self.keys['globex']}")], "globex"
        printable = "".join(chr(r.randint(0x20, 0x7E)) for _ in range(r.randint(0, 80))).strip()
        return r.choice([
            [], [("authorization", "Bearer sp-" + uuid.uuid4().hex)], [("authorization", "Bearer")],
            [("authorization", "Basic dXNlcjpwYXNz")], [("authorization", printable or "x")],
            [("authorization", "Bearer " + self.keys["acme"][:-1])], [("authorization", "bearer " + self.keys["acme"].upper())],
            [("authorization-bin", r.randbytes(32))], [("x-junk-bin", r.randbytes(r.randint(0, 512)))],
            [("authorization", "Bearer " + "k" * 8000)],
        ]), None

    def case(self) -> tuple[str, bytes, list, bool, str]:
        """(method, payload, metadata, could run the model, kind)."""
        metadata, own = self.metadata()
        roll = self.r.random()
        if roll < 0.6:
            payload, could_run = self.proto(own)
            kind = "fields"
        elif roll < 0.8:
            payload, could_run, kind = self.wire(), False, "wire"
        elif roll < 0.9:
            payload, could_run, kind = self.garbage(), False, "garbage"
        else:
            payload, could_run, kind = self.mangled(own), False, "mangled"
        return self.r.choice(METHODS), payload, metadata, could_run, kind


def _send(channel, method: str, payload: bytes, metadata) -> tuple[str, float, int, str]:
    """(status name, seconds, messages received, details) of one call through identity serializers."""
    started = time.monotonic()
    messages, details = 0, ""
    try:
        if method.endswith("Stream"):
            call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
            for _ in call(payload, timeout=DEADLINE_S, metadata=metadata):
                messages += 1
        else:
            channel.unary_unary(method, request_serializer=None, response_deserializer=None)(
                payload, timeout=DEADLINE_S, metadata=metadata)
            messages = 1
        status = "OK"
    except grpc.RpcError as exc:
        status = exc.code().name if exc.code() is not None else "UNKNOWN"
        details = (exc.details() or "")[:200]
    return status, time.monotonic() - started, messages, details


def _describe(payload: bytes) -> str:
    """What a slow call asked for (for the tally): its fields when it parses."""
    try:
        req = specpool_pb2.GenerateRequest.FromString(payload)
    except Exception:  # noqa: BLE001
        return f"{len(payload)} unparseable bytes"
    text = req.prompt or req.raw_prompt or "".join(m.content for m in req.chat.messages)
    return (f"{len(payload)} bytes: {req.WhichOneof('input')} of {len(text)} chars, {len(req.chat.messages)} messages, "
            f"max_new_tokens {req.max_new_tokens}, k {req.k}, {len(req.stop)} stops, policy {req.policy[:20]!r}")


# -- the tests ----------------------------------------------------------------------------------------------
def _greedy(served) -> list[int]:
    with SpecPoolClient(served.address, api_key=served.keys["acme"], timeout=120) as client:
        return client.generate(GREEDY_PROMPT, max_new_tokens=8, session_id=f"greedy-{uuid.uuid4().hex}").token_ids


def test_ten_thousand_malformed_grpc_requests_all_answered_and_nothing_leaks(served, seed, tmp_path):
    before = _greedy(served)
    assert before, "the server answers nothing before the fuzz"
    target_before = set(_call(served.handles.target, "Sessions"))
    drafter_before = set(_call(served.handles.drafter, "Sessions"))
    fuzz = Fuzz(random.Random(seed), served.keys)
    cases = [fuzz.case() for _ in range(GRPC_REQUESTS)]
    options = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]
    started = time.monotonic()
    with grpc.insecure_channel(served.address, options=options) as channel, ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda c: _send(channel, c[0], c[1], c[2]), cases))
    wall = time.monotonic() - started

    by_status = Counter(status for status, _, _, _ in results)
    by_kind: dict[str, Counter] = {}
    examples: dict[str, str] = {}
    for (_, _, _, _, kind), (status, _, _, details) in zip(cases, results):
        by_kind.setdefault(kind, Counter())[status] += 1
        examples.setdefault(status, details)
    unanswered = sum(1 for status, seconds, _, _ in results if status == "DEADLINE_EXCEEDED" and seconds >= DEADLINE_S - 1)
    slowest = max(seconds for _, seconds, _, _ in results)
    slow = [{"seconds": round(seconds, 1), "status": status, "kind": case[4], "request": _describe(case[1])}
            for case, (status, seconds, _, _) in zip(cases, results) if seconds > 10]
    ok = by_status.get("OK", 0)
    tally = {"seed": seed, "requests": len(results), "unanswered": unanswered, "wall_s": round(wall, 1),
             "slowest_s": round(slowest, 2), "concurrency": CONCURRENCY, "by_status": dict(by_status.most_common()),
             "by_kind": {k: dict(v.most_common()) for k, v in by_kind.items()},
             "could_run_model": sum(1 for c in cases if c[3]), "example_details": examples, "slow_calls": slow}
    # SPECPOOL_FUZZ_REPORT=DIR also keeps the tally there (bench/results/fuzz holds the cited run's).
    out = Path(os.environ.get("SPECPOOL_FUZZ_REPORT") or tmp_path) / "fuzz_grpc_tally.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(tally, indent=2) + "\n")
    print(f"fuzz tally ({out}):\n{json.dumps(tally, indent=2)}", flush=True)

    assert len(results) == GRPC_REQUESTS >= 10_000
    assert unanswered == 0, tally
    assert by_status.get("UNAVAILABLE", 0) == 0, f"the server went away during the fuzz: {tally}"
    # Bytes that are not a GenerateRequest are the caller's mistake: INVALID_ARGUMENT, never grpc's
    # UNKNOWN or INTERNAL (specpool/services/grpc_ingress.py).
    assert by_status.get("UNKNOWN", 0) == 0 and by_status.get("INTERNAL", 0) == 0, tally
    # Garbage and malformed messages are refused without a model run: most calls are not OK.
    assert ok < GRPC_REQUESTS * 0.2, tally
    assert by_status.get("INVALID_ARGUMENT", 0) > 0 and by_status.get("UNAUTHENTICATED", 0) > 0, tally
    assert by_status.get("PERMISSION_DENIED", 0) > 0, tally

    # Healthy after: health SERVING, and the same greedy answer as before the fuzz.
    with SpecPoolClient(served.address, api_key=served.keys["acme"]) as client:
        assert client.health() == "SERVING"
        assert client.health("") == "SERVING"
    assert _greedy(served) == before

    # Nothing leaked: no request running; caches only of requests that succeeded (then released).
    deadline = time.monotonic() + 60
    while _call(served.handles.router, "Active") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _call(served.handles.router, "Active") == []
    target_after = set(_call(served.handles.target, "Sessions")) - target_before
    drafter_after = set(_call(served.handles.drafter, "Sessions")) - drafter_before
    # +1: the greedy request after the fuzz keeps its caches too (keep_caches).
    assert len(target_after) <= ok + 1 and len(drafter_after) <= ok + 1, (len(target_after), len(drafter_after), ok)
    for handle in (served.handles.target, served.handles.drafter):
        for session in _call(handle, "Sessions"):
            _call(handle, "Release", common_pb2.ReleaseRequest(session_id=session))
        assert _call(handle, "Sessions") == []


# -- HTTP: malformed bodies ---------------------------------------------------------------------------------
_KNOWN = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
          "stream_options", "user", "policy", "drafter", "k", "session_id", "tenant", "top_k", "max_completion_tokens"]
_WRONG = [None, True, False, -1, 0, 2**70, 1.5, -1e308, "x", "", [], [1, "a"], {}, {"a": {"b": []}}, "\u0000", "é" * 50]


def _http_case(r: random.Random, model: str) -> tuple[str, bytes, dict]:
    """(path, body bytes, headers): always malformed (each branch breaks a rule of the API)."""
    path = r.choice(["/chat/completions", "/completions"])
    valid = ({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if path == "/chat/completions"
             else {"model": model, "prompt": "hi", "max_tokens": 2})
    roll = r.random()
    content_type = "application/json"
    if roll < 0.15:
        body = r.randbytes(r.choice([0, 1, 10, 1000]))  # garbage
    elif roll < 0.25:
        body = json.dumps(valid).encode()[: r.randint(0, 20)]  # truncated JSON
    elif roll < 0.32:
        body = json.dumps(r.choice([[], [valid], "text", 42, None, True, 1.5])).encode()  # not an object
    elif roll < 0.38:
        body = b'{"model": "' + r.choice(INVALID_UTF8) + b'", "messages": []}'  # invalid UTF-8 inside JSON
    elif roll < 0.43:
        body = json.dumps({**valid, "temperature": "NaN"}).encode().replace(b'"NaN"', r.choice([b"NaN", b"Infinity", b"-Infinity"]))
    elif roll < 0.5:
        body = (b"[" * 10_000) + (b"]" * 10_000)  # deep nesting
    elif roll < 0.6:
        broken = dict(valid)
        broken["".join(chr(r.randint(0x21, 0x7E)) for _ in range(r.randint(1, 12))) + "_unknown"] = r.choice(_WRONG)
        body = json.dumps(broken).encode()
    elif roll < 0.7:
        broken = dict(valid)
        del broken[r.choice(["model", "messages" if "messages" in valid else "prompt"])]
        body = json.dumps(broken).encode()
    else:  # a known field of the wrong type or out of range
        broken = dict(valid)
        name = r.choice(["model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "k", "top_k",
                         "session_id", "tenant", "messages" if "messages" in valid else "prompt", "stream_options"])
        bad = {"model": ["no-such-model", 1, None, [model]], "max_tokens": [-5, 0, 2**40, "2", 1.5, True],
               "temperature": [-1, "hot", [], 2.5], "top_p": [-0.1, 1.5, "x"], "seed": ["1", 1.5, []],
               "stop": [5, [1, 2], {"a": 1}, ["x"] * 1000], "n": [2, 0, "1"], "stream": ["yes", 1],
               "k": [0, 33, -1, "5"], "top_k": [-1, "x"], "session_id": ["x" * 500, "bad id", 5],
               "tenant": ["globex", "-bad", 7], "messages": [[], "hi", [{"role": "user"}], [{"content": "x"}], [1], [{"role": 5, "content": "x"}]],
               "prompt": [5, None, {"a": 1}, [[1, 2]]], "stream_options": [{"include_usage": True}, "x", {"foo": 1}]}[name]
        broken[name] = r.choice(bad)
        if name == "stream_options":
            broken.pop("stream", None)  # stream_options without stream: true is a 400
        body = json.dumps(broken).encode()
        if r.random() < 0.1:
            content_type = r.choice(["text/plain", "application/x-www-form-urlencoded", ""])
    return path, body, {"content-type": content_type} if content_type else {}


def test_malformed_http_bodies_are_4xx_json_errors_never_500(served, seed, tmp_path):
    r = random.Random(seed + 1)
    key = served.keys["acme"]
    with httpx.Client(base_url=served.http_url, timeout=DEADLINE_S) as http:
        model = http.get("/models", headers={"authorization": f"Bearer {key}"}).json()["data"][0]["id"]
        cases = [_http_case(r, model) for _ in range(HTTP_BODIES)]
        keyed = [r.random() < 0.85 for _ in cases]  # most with a valid key (else 401 before the body is read)

        def send(i: int):
            path, body, headers = cases[i]
            if keyed[i]:
                headers = {**headers, "authorization": f"Bearer {key}"}
            response = http.post(path, content=body, headers=headers)
            try:
                error = response.json().get("error")
            except (ValueError, AttributeError):
                error = None
            return response.status_code, error

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(send, range(len(cases))))
    by_status = Counter(status for status, _ in results)
    tally = {"seed": seed + 1, "bodies": len(results), "by_status": {str(k): v for k, v in sorted(by_status.items())}}
    (tmp_path / "fuzz_http_tally.json").write_text(json.dumps(tally, indent=2) + "\n")
    print(f"HTTP fuzz tally: {json.dumps(tally)}", flush=True)
    bad = [(i, status, error) for i, (status, error) in enumerate(results)
           if not 400 <= status < 500 or not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error)]
    assert not bad, [(cases[i][0], cases[i][1][:200], status, error) for i, status, error in bad[:10]]
    assert len(results) == HTTP_BODIES
    # The server still answers a valid request afterwards.
    with SpecPoolClient(served.address, api_key=key) as client:
        assert client.health() == "SERVING"
