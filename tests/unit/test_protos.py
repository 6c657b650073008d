"""The protos and their generated code (specpool/v1/): up to date, importable, documented,
round-tripping, and following the proto style rules (enums start at *_UNSPECIFIED = 0)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pickle
import shutil
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from specpool.services import protogen

GEN_V1 = protogen.GEN_ROOT
PROTO_NAMES = ["common", "drafter", "specpool", "target"]
MODULES = [f"specpool.v1.{name}{suffix}" for name in PROTO_NAMES for suffix in ("_pb2", "_pb2_grpc")]


@pytest.fixture(scope="module")
def rendered() -> dict[str, bytes]:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.fail("grpcio-tools is missing (it is in the test extra): pip install -e '.[test]'")
    return protogen.render()


def _pb2(name: str):
    return importlib.import_module(f"specpool.v1.{name}_pb2")


# -- the generated code is what the protos generate -------------------------------------------------
def test_generated_code_is_up_to_date(rendered):
    stale = protogen.stale_files()
    assert not stale, (
        "generated code is stale; run `python -m specpool.services.protogen` and commit specpool/v1/: " + ", ".join(stale)
    )


def test_every_proto_has_generated_modules(rendered):
    protos = sorted(p.stem for p in protogen.proto_files())
    assert protos == PROTO_NAMES, "a proto was added or removed: update PROTO_NAMES"
    for name in PROTO_NAMES:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert f"{name}{suffix}" in rendered


def test_check_names_changed_missing_and_leftover_files(tmp_path: Path, rendered):
    gen = tmp_path / "gen"
    shutil.copytree(protogen.GEN_ROOT, gen, ignore=shutil.ignore_patterns("__pycache__"))
    assert protogen.stale_files(gen) == []
    with (gen / "target_pb2.py").open("a") as f:
        f.write("# edited by hand\n")
    (gen / "drafter_pb2.pyi").unlink()
    (gen / "removed_pb2.py").write_text("# from a proto that no longer exists\n")
    stale = {Path(p).relative_to(gen).as_posix() for p in protogen.stale_files(gen)}
    assert stale == {"target_pb2.py", "drafter_pb2.pyi", "removed_pb2.py"}


def test_check_sees_a_changed_proto(tmp_path: Path, rendered):
    protos = tmp_path / "protos"
    shutil.copytree(protogen.PROTO_ROOT, protos)
    common = protos / "specpool/v1/common.proto"
    common.write_text(common.read_text().replace("bool released = 1;", "bool released = 1;\n  // Added.\n  uint32 freed_bytes = 2;"))
    stale = protogen.stale_files(proto_root=protos)
    assert "specpool/v1/common_pb2.py" in stale


def test_generation_is_reproducible(tmp_path: Path, rendered):
    elsewhere = tmp_path / "some" / "other" / "checkout" / "protos"
    shutil.copytree(protogen.PROTO_ROOT, elsewhere)
    assert protogen.render(elsewhere) == rendered  # same bytes from another folder, another run
    for rel, content in rendered.items():
        text = content.decode()
        assert str(protogen.REPO_ROOT) not in text and str(tmp_path) not in text, f"{rel} embeds an absolute path"
        if rel.endswith((".py", ".pyi")) and rel != "__init__.py":
            # protoc's own imports name the proto package, which is the installed package: nothing else.
            ours = [line for line in text.splitlines() if line.startswith(("from specpool", "import specpool"))]
            assert all(line.startswith("from specpool.v1 import ") for line in ours), f"{rel}: {ours}"


def test_cli_check_exit_status(tmp_path: Path, monkeypatch, capsys, rendered):
    gen = tmp_path / "gen"
    shutil.copytree(protogen.GEN_ROOT, gen, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(protogen, "GEN_ROOT", gen)
    assert protogen.main(["--check"]) == 0
    (gen / "specpool_pb2.py").write_text("# stale\n")
    assert protogen.main(["--check"]) == 1
    assert "gen/specpool_pb2.py" in capsys.readouterr().err


# -- importable, services present -------------------------------------------------------------------
@pytest.mark.parametrize("module", MODULES)
def test_generated_module_imports(module: str):
    """Each generated module imports under the proto package's name and is the one for its proto
    (the _pb2_grpc modules check the installed grpcio against the one that generated them on import)."""
    imported = importlib.import_module(module)
    proto = module.removeprefix("specpool.v1.").removesuffix("_grpc").removesuffix("_pb2")
    if module.endswith("_pb2"):
        assert (imported.DESCRIPTOR.name, imported.DESCRIPTOR.package) == (f"specpool/v1/{proto}.proto", "specpool.v1")
    else:
        assert imported.GRPC_GENERATED_VERSION == importlib.metadata.version("grpcio-tools")
        assert not imported._version_not_supported  # the installed grpcio is new enough for it


def test_services_and_their_methods():
    expected = {
        ("specpool", "SpecPool"): {"Generate": (False, False), "GenerateStream": (False, True)},
        ("drafter", "Drafter"): {"Propose": (False, False), "Release": (False, False), "Replay": (False, False)},
        ("target", "Target"): {"Verify": (False, False), "Release": (False, False)},
    }
    for (name, service), methods in expected.items():
        grpc_module = importlib.import_module(f"specpool.v1.{name}_pb2_grpc")
        for attr in (f"{service}Stub", f"{service}Servicer", f"add_{service}Servicer_to_server"):
            assert hasattr(grpc_module, attr), f"{name}_pb2_grpc lacks {attr}"
        descriptor = _pb2(name).DESCRIPTOR.services_by_name[service]
        assert descriptor.full_name == f"specpool.v1.{service}"
        got = {m.name: (m.client_streaming, m.server_streaming) for m in descriptor.methods}
        assert got == methods


# -- serialisation round trips ----------------------------------------------------------------------
def test_generate_request_and_response_round_trip():
    common, sp = _pb2("common"), _pb2("specpool")
    request = sp.GenerateRequest(
        chat=sp.Chat(messages=[
            common.ChatMessage(role="system", content="Be brief."),
            common.ChatMessage(role="user", content="Name a prime — and say why. 素数"),
        ]),
        sampling=common.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=-7),
        max_new_tokens=64,
        stop=["\n\n", "END"],
        stop_token_ids=[2],
        policy="metasd-ucb",
        k=6,
        session_id="s-1",
        tenant="acme",
    )
    parsed = sp.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert parsed.WhichOneof("input") == "chat"
    assert [m.role for m in parsed.chat.messages] == ["system", "user"]
    assert parsed.sampling.HasField("top_p") and parsed.sampling.seed == -7

    # The oneof holds one input: setting the prompt clears the chat.
    parsed.prompt = "hello"
    assert parsed.WhichOneof("input") == "prompt" and not parsed.HasField("chat")
    assert sp.GenerateRequest().WhichOneof("input") is None  # none set: the server rejects it
    assert not sp.GenerateRequest().sampling.HasField("top_p")  # unset top_p means 1.0, not 0

    response = sp.GenerateResponse(
        text="2 is prime.",
        token_ids=[17, 318, 6994, 13],
        finish_reason=sp.FINISH_REASON_STOP,
        stats=sp.GenerationStats(
            rounds=3, new_tokens=4, prompt_tokens=12, mean_accepted_length=4 / 3,
            rounds_by_drafter={"code": 2, "ngram": 1}, draft_tokens=10, accepted_tokens=1,
            wall_s=0.25, draft_s=0.05, verify_s=0.18,
        ),
        session_id="s-1",
    )
    parsed = sp.GenerateResponse.FromString(response.SerializeToString())
    assert parsed == response
    assert dict(parsed.stats.rounds_by_drafter) == {"code": 2, "ngram": 1}
    assert parsed.stats.mean_accepted_length == 4 / 3  # double: exact
    assert sp.FinishReason.Name(parsed.finish_reason) == "FINISH_REASON_STOP"

    chunk = sp.GenerateStreamResponse(text=" prime", token_ids=[6994], session_id="s-1")
    assert sp.GenerateStreamResponse.FromString(chunk.SerializeToString()) == chunk
    assert chunk.finish_reason == sp.FINISH_REASON_UNSPECIFIED and not chunk.HasField("stats")


def test_verify_request_and_response_round_trip():
    import numpy as np  # a runtime dependency
    common, target = _pb2("common"), _pb2("target")
    probs = np.array([0.6, 0.3, 0.1], dtype=np.float32) / np.float32(1.0000001)  # not short decimals
    request = target.VerifyRequest(
        session_id="s-1",
        context_ids=[1, 50, 60, 49151],
        draft_tokens=[7, 9],
        q=[
            common.SparseDistribution(token_ids=[7, 8, 3], probs=probs.tolist()),
            common.SparseDistribution(token_ids=[9], probs=[1.0]),
        ],
        sampling=common.SamplingParams(temperature=1.0, top_k=50, seed=123),
        return_top_k=4,
    )
    parsed = target.VerifyRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert list(parsed.context_ids) == [1, 50, 60, 49151]
    # float32 q crosses the wire exactly: the acceptance test u * q(x) < p(x) sees the same numbers.
    assert np.array(parsed.q[0].probs, dtype=np.float32).tobytes() == probs.tobytes()
    assert not parsed.sampling.HasField("top_p")

    tv = [0.1234567890123, 0.0]
    response = target.VerifyResponse(
        accepted=1, tokens=[7, 11], tv=tv, forward_s=0.012,
        target_top_k=[common.SparseDistribution(token_ids=[7, 2], probs=[0.75, 0.25])] * 3,
    )
    parsed = target.VerifyResponse.FromString(response.SerializeToString())
    assert parsed == response and list(parsed.tv) == tv  # double: rewards equal the embedded engine's


def test_features_are_new_fields_that_older_peers_skip_and_newer_ones_default():
    """Backward compatible (new field numbers only): a message with features parses in a reader
    whose schema predates them (unknown fields are skipped), and an older message parses in this
    schema with no features (``HasField`` false), which the router refuses for a white-box arm."""
    common, target, drafter = _pb2("common"), _pb2("target"), _pb2("drafter")
    features = common.Features(start=5, width=576, dtype=common.FEATURE_DTYPE_BFLOAT16, data=b"\x01\x02" * 576 * 3)
    fields = {(m.DESCRIPTOR.name, f.name): f.number for m in (target.VerifyRequest, target.VerifyResponse,
                                                             drafter.ProposeRequest, drafter.ReplayRequest)
              for f in m.DESCRIPTOR.fields if "feature" in f.name}
    assert fields == {("VerifyRequest", "return_features"): 7, ("VerifyResponse", "features"): 7,
                      ("ProposeRequest", "features"): 9, ("ReplayRequest", "features"): 10}
    response = target.VerifyResponse(accepted=2, tokens=[7, 8, 9], features=features)
    parsed = target.VerifyResponse.FromString(response.SerializeToString())
    assert parsed.features == features and len(parsed.features.data) == 3 * 576 * 2
    old = target.VerifyResponse(accepted=2, tokens=[7, 8, 9])  # what an older target sends
    assert not target.VerifyResponse.FromString(old.SerializeToString()).HasField("features")
    # An older reader: target.proto without the new fields, in a pool of its own.
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    older = _older_class("VerifyResponse", lambda f: "feature" not in f.name)
    parsed_old = older.FromString(response.SerializeToString())
    assert (parsed_old.accepted, list(parsed_old.tokens)) == (2, [7, 8, 9])
    assert "features" not in older.DESCRIPTOR.fields_by_name
    request = drafter.ProposeRequest(session_id="s", context_ids=[1, 2], k=3, features=features)
    assert pickle.loads(pickle.dumps(request)) == request  # Ray's actor transport pickles messages


def _older_class(name: str, keep):
    """Message ``name`` as a reader whose schema predates some fields (those ``keep`` rejects), built
    in a descriptor pool of its own from the three service protos."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    for module in (_pb2("common"), _pb2("drafter"), _pb2("target")):  # target.proto imports the other two
        file = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(file)
        for message in file.message_type:
            kept = [f for f in message.field if keep(f)]
            del message.field[:]
            message.field.extend(kept)
        pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"specpool.v1.{name}"))


def test_hosted_drafts_are_new_fields_that_older_peers_skip_and_newer_ones_default():
    """The hosted-drafter fields (specpool/router/hosted.py) take new numbers: an older target skips a
    request's ``hosted`` part (the router checks the target's Info before sending one), and a
    response of an older target has no ``drafted`` (the router then fails the round, not guesses)."""
    target = _pb2("target")
    numbers = {(m.DESCRIPTOR.name, f.name): f.number for m in (target.VerifyRequest, target.VerifyResponse)
               for f in m.DESCRIPTOR.fields if f.name in ("hosted", "drafted")}
    assert numbers == {("VerifyRequest", "hosted"): 10, ("VerifyResponse", "drafted"): 8}
    request = target.VerifyRequest(session_id="s", context_ids=[1, 2], hosted=target.HostedDraft(drafter="eagle:code", k=5,
                                                                                                   feed=["eagle:code"]))
    older = _older_class("VerifyRequest", lambda f: f.name != "hosted")
    parsed = older.FromString(request.SerializeToString())
    assert (parsed.session_id, list(parsed.context_ids)) == ("s", [1, 2]) and "hosted" not in older.DESCRIPTOR.fields_by_name
    old_response = target.VerifyResponse(accepted=0, tokens=[3])
    assert not target.VerifyResponse.FromString(old_response.SerializeToString()).HasField("drafted")


def test_negative_token_ids_are_refused_at_construction():
    with pytest.raises(ValueError):
        _pb2("common").SparseDistribution(token_ids=[-1], probs=[1.0])


def test_messages_pickle_through_their_importable_module():
    """Ray ships messages between processes by pickling: the classes' module must import."""
    sp = _pb2("specpool")
    assert sp.GenerateRequest.__module__ == "specpool.v1.specpool_pb2"
    request = sp.GenerateRequest(prompt="hi", k=3)
    assert pickle.loads(pickle.dumps(request)) == request


# -- style rules, checked on the descriptors --------------------------------------------------------
def _all_enums():
    for name in PROTO_NAMES:
        file = _pb2(name).DESCRIPTOR
        stack = list(file.message_types_by_name.values())
        yield from file.enum_types_by_name.values()
        while stack:
            message = stack.pop()
            yield from message.enum_types
            stack.extend(message.nested_types)


def _screaming_snake(camel: str) -> str:
    out = []
    for i, ch in enumerate(camel):
        if ch.isupper() and i and not camel[i - 1].isupper():
            out.append("_")
        out.append(ch.upper())
    return "".join(out)


def test_every_enum_starts_at_unspecified_zero():
    enums = list(_all_enums())
    assert enums, "no enums found: the walk is broken"
    for enum in enums:
        zero = enum.values_by_number.get(0)
        assert zero is not None, f"{enum.full_name} has no zero value"
        assert zero.name == f"{_screaming_snake(enum.name)}_UNSPECIFIED", f"{enum.full_name}: zero is {zero.name}"
        prefix = _screaming_snake(enum.name) + "_"
        assert all(v.name.startswith(prefix) for v in enum.values), f"{enum.full_name}: values not prefixed {prefix}"


def test_screaming_snake():
    assert _screaming_snake("FinishReason") == "FINISH_REASON"


def test_protos_are_proto3_in_package_specpool_v1():
    for name in PROTO_NAMES:
        file = _pb2(name).DESCRIPTOR
        assert file.package == "specpool.v1"
        assert file.name == f"specpool/v1/{name}.proto"


def _undocumented(files: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Every message, field, oneof, enum, enum value, service and method without a comment."""
    missing = []
    for file in files.file:
        comments = {
            tuple(loc.path): (loc.leading_comments + loc.trailing_comments).strip()
            for loc in file.source_code_info.location
        }

        def need(path: tuple[int, ...], what: str) -> None:
            if not comments.get(path):
                missing.append(f"{file.name}: {what}")

        def message(msg, path, prefix):
            need(path, f"message {prefix}{msg.name}")
            for i, field in enumerate(msg.field):
                need(path + (2, i), f"field {prefix}{msg.name}.{field.name}")
            for i, oneof in enumerate(msg.oneof_decl):
                if not oneof.name.startswith("_"):  # synthetic oneof of a proto3 `optional`
                    need(path + (8, i), f"oneof {prefix}{msg.name}.{oneof.name}")
            for i, nested in enumerate(msg.nested_type):
                if not nested.options.map_entry:
                    message(nested, path + (3, i), f"{prefix}{msg.name}.")
            for i, enum in enumerate(msg.enum_type):
                enum_(enum, path + (4, i), f"{prefix}{msg.name}.")

        def enum_(enum, path, prefix):
            need(path, f"enum {prefix}{enum.name}")
            for i, value in enumerate(enum.value):
                need(path + (2, i), f"enum value {prefix}{enum.name}.{value.name}")

        for i, msg in enumerate(file.message_type):
            message(msg, (4, i), "")
        for i, enum in enumerate(file.enum_type):
            enum_(enum, (5, i), "")
        for i, service in enumerate(file.service):
            need((6, i), f"service {service.name}")
            for j, method in enumerate(service.method):
                need((6, i, 2, j), f"rpc {service.name}.{method.name}")
        if file.syntax != "proto3":
            missing.append(f"{file.name}: not proto3")
    return missing


@pytest.fixture(scope="module")
def descriptor_set(rendered) -> descriptor_pb2.FileDescriptorSet:
    return descriptor_pb2.FileDescriptorSet.FromString(protogen.descriptor_set())


def test_every_element_is_commented(descriptor_set):
    assert len(descriptor_set.file) == len(PROTO_NAMES)
    assert _undocumented(descriptor_set) == []


def test_undocumented_elements_are_reported(descriptor_set):
    bare = descriptor_pb2.FileDescriptorSet()
    bare.CopyFrom(descriptor_set)
    for file in bare.file:
        file.ClearField("source_code_info")
    missing = _undocumented(bare)
    assert "specpool/v1/specpool.proto: field GenerateRequest.tenant" in missing
    assert "specpool/v1/specpool.proto: enum value FinishReason.FINISH_REASON_STOP" in missing
    assert "specpool/v1/target.proto: rpc Target.Verify" in missing
