"""Served white-box drafters, the pure parts: the target's features over the versioned protos
(float16 / bfloat16 bytes, malformed bytes refused), and the router's side of a white-box drafter
deployment (``RemoteDrafter`` with a ``FeatureRelay``): each call carries only the rows the
deployment has not been sent, a deployment that lost them gets them again from where it asks, and
the whole path (target verify over protos -> router -> drafter deployment over protos) keeps
greedy output identical to target-only. The deployments are test doubles that run the real
conversion and the drafter server's own feature step on messages that went through bytes."""

from __future__ import annotations

import pytest
import torch

from specpool.core.errors import FailedPrecondition, InvalidArgument
from specpool.drafters.base import Proposal, reads_features
from specpool.drafters.eagle import EagleDrafter
from specpool.drafters.eagle_model import EagleConfig, EagleHead
from specpool.router.loop import FixedChooser, speculative_generate
from specpool.services import convert
from specpool.services.remote import FeatureRelay, RemoteDrafter, RemoteVerifier
from specpool.services.status import grpc_status
from specpool.target.features import FeatureGap, FeatureLog, Features
from specpool.target.sampling import SamplingParams
from specpool.target.tree import primary_chain
from specpool.target.verifier import VerifyRequest, VerifyResult
from specpool.v1 import common_pb2, drafter_pb2, target_pb2

WIDTH = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


def rows(start: int, n: int, width: int = WIDTH) -> Features:
    """Row t holds t + 0.5 in every column (exact in float16 and bfloat16 for small t)."""
    values = torch.arange(start, start + n, dtype=torch.float32)[:, None] + 0.5  # (n, 1)
    return Features(start, values.expand(n, width).clone())  # (n, d)


def wire(msg):
    """The message as the other side sees it: serialised and parsed again."""
    return type(msg).FromString(msg.SerializeToString())


# -- features over the protos ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_features_round_trip_in_two_bytes_a_value(dtype):
    torch.manual_seed(0)
    features = Features(7, torch.randn(5, WIDTH))  # (5, d)
    msg = wire(convert.features_to_proto(features, dtype))
    assert (msg.start, msg.width, len(msg.data)) == (7, WIDTH, 5 * WIDTH * 2)
    back = convert.features_from_proto(msg)
    assert back.start == 7 and back.rows.dtype == torch.float32
    rounded = features.rows.to(getattr(torch, dtype)).float()
    assert torch.equal(back.rows, rounded)  # exactly the 2-byte values, nothing else lost
    assert not torch.equal(back.rows, features.rows)  # and they are 2-byte values


def test_verify_carries_features_only_when_asked():
    request = VerifyRequest("s", [1, 2, 3], [], [], GREEDY, return_features=True)
    assert convert.verify_request_from_proto(wire(convert.verify_request_to_proto(request))).return_features
    plain = VerifyRequest("s", [1, 2, 3], [], [], GREEDY)
    assert not convert.verify_request_from_proto(wire(convert.verify_request_to_proto(plain))).return_features
    result = VerifyResult(1, [4, 5], [0.0], features=rows(3, 2))
    response = wire(convert.verify_result_to_proto(result, "bfloat16"))
    assert response.features.dtype == common_pb2.FEATURE_DTYPE_BFLOAT16 and len(response.features.data) == 2 * WIDTH * 2
    back = convert.verify_result_from_proto(response)
    assert back.features.start == 3 and torch.equal(back.features.rows, result.features.rows)
    # A response without the field (not asked, or a target older than it) has no features: the
    # loop then refuses to run a white-box arm blind.
    assert convert.verify_result_from_proto(wire(convert.verify_result_to_proto(VerifyResult(0, [4], [])))).features is None


def test_propose_and_replay_requests_carry_the_unsent_rows():
    features = convert.features_to_proto(rows(4, 3))
    propose = wire(convert.propose_request_to_proto("s", [1, 2, 3, 4, 5, 6, 7], 3, GREEDY, features=features))
    args = convert.propose_request_from_proto(propose)
    assert args.features.start == 4 and torch.equal(args.features.rows, rows(4, 3).rows)
    assert convert.propose_request_from_proto(wire(convert.propose_request_to_proto("s", [1], 3, GREEDY))).features is None
    replay = wire(convert.replay_request_to_proto("s", [1, 2], [3], 2, GREEDY, features=features))
    assert convert.replay_request_from_proto(replay).features.start == 4


@pytest.mark.parametrize("mutate, fragment", [
    (lambda m: setattr(m, "data", m.data[:-1]), "not whole rows"),
    (lambda m: setattr(m, "data", m.data + b"\0\0"), "not whole rows"),
    (lambda m: setattr(m, "width", 0), "width > 0"),
    (lambda m: setattr(m, "dtype", common_pb2.FEATURE_DTYPE_UNSPECIFIED), "dtype"),
    (lambda m: setattr(m, "dtype", 7), "dtype"),
])
def test_malformed_features_are_invalid_argument(mutate, fragment):
    msg = convert.features_to_proto(rows(0, 2))
    mutate(msg)
    request = drafter_pb2.ProposeRequest(session_id="s", context_ids=[1, 2, 3], k=2, features=msg)
    with pytest.raises(InvalidArgument, match=fragment) as caught:
        convert.propose_request_from_proto(request)
    assert grpc_status(caught.value)[0].name == "INVALID_ARGUMENT"
    with pytest.raises(InvalidArgument, match=fragment):
        convert.verify_result_from_proto(target_pb2.VerifyResponse(accepted=0, tokens=[1], features=msg))


def test_a_feature_gap_crosses_the_wire_as_failed_precondition_with_the_position():
    error = convert.feature_gap_error(FeatureGap(3, 9))
    assert isinstance(error, FailedPrecondition) and grpc_status(error)[0].name == "FAILED_PRECONDITION"
    # Only the message survives Serve's pickling and the direct route's status details.
    assert convert.features_needed(FailedPrecondition(grpc_status(error)[1])) == 3
    assert convert.features_needed(FeatureGap(5, 9)) == 5
    from specpool.services.client import RemoteError

    assert convert.features_needed(RemoteError("FAILED_PRECONDITION", grpc_status(error)[1])) == 3  # a direct route's
    assert convert.features_needed(FailedPrecondition("the pool has white-box drafters but ...")) is None
    assert convert.features_needed(InvalidArgument("(features_needed=3)")) is None


# -- the router's side of a white-box deployment -------------------------------------------------------------
class RecordingWhiteBox:
    """A white-box drafter that drafts nothing and keeps what it was told (the deployment's state)."""

    name = "wb"
    tokenizer_fingerprint = None
    feature_width = WIDTH

    def __init__(self):
        self.logs: dict[str, FeatureLog] = {}
        self.cost = None

    def observe_features(self, session_id, features):
        self.logs.setdefault(session_id, FeatureLog(WIDTH)).apply(features)

    def propose(self, session_id, context_ids, k, params):
        return Proposal([], [])

    def replay(self, session_id, context_ids, continuation, k, params):
        return 0

    def release(self, session_id):
        self.logs.pop(session_id, None)


class FakeDrafterDeployment:
    """The drafter deployment's Propose / Replay / Release, over bytes, with its feature step.
    ``direct``: errors come back as over a same-node direct route (a gRPC status, then
    ``client.error_from_rpc``), not as the exception itself (Serve's path)."""

    def __init__(self, drafter, lose_before_call: int | None = None, direct: bool = False):
        from specpool.services.serve_app import DrafterServer

        self.observe = DrafterServer.func_or_class._observe  # the server's own: apply, or gap -> FAILED_PRECONDITION
        self.draft = DrafterServer.func_or_class._draft  # and its own choice of a tree or a chain
        self.drafter = drafter
        self.calls: list[tuple[str, object]] = []
        self.lose_before_call = lose_before_call  # fault injection: the replica forgets every session
        self.direct = direct

    def call(self, method: str, message, session_id: str = "", timeout_s: float | None = None):
        try:
            return self._call(method, message, session_id)
        except Exception as exc:
            if not self.direct:
                raise
            from specpool.services.client import error_from_rpc

            code, details = grpc_status(exc)
            rpc = type("Rpc", (), {"code": lambda self: code, "details": lambda self: details})()
            raise error_from_rpc(rpc, "a model replica") from None

    def _call(self, method: str, message, session_id: str = ""):
        message = wire(message)
        self.calls.append((method, message))
        if method == "Release":
            self.drafter.release(message.session_id)
            return common_pb2.ReleaseResponse(released=True)
        if self.lose_before_call == len(self.calls):
            self.drafter.release(session_id)
        if method == "Propose":
            args = convert.propose_request_from_proto(message)
            self.observe(self.drafter, args)
            return wire(convert.proposal_to_proto(self.draft(self.drafter, args)))
        args = convert.replay_request_from_proto(message)
        self.observe(self.drafter, args)
        return wire(convert.replay_to_proto(self.drafter.replay(args.session_id, args.context_ids, args.continuation,
                                                                args.k, args.params)))

    def sent(self) -> list[tuple[int, int]]:
        """(start, rows) of the features each Propose / Replay carried."""
        return [(m.features.start, len(m.features.data) // (2 * WIDTH)) for method, m in self.calls if method != "Release"]


def test_each_call_sends_only_the_rows_the_deployment_has_not_seen():
    deployment = FakeDrafterDeployment(RecordingWhiteBox())
    remote = RemoteDrafter("wb", deployment, None, feature_width=WIDTH)
    assert reads_features(remote) and not reads_features(RemoteDrafter("ngram", deployment, None))
    context = list(range(1, 11))
    remote.observe_features("s", rows(0, 10))  # the prefill round
    remote.propose("s", context + [11], 4, GREEDY)
    remote.observe_features("s", rows(10, 3))  # a round that accepted 2: 3 rows
    remote.propose("s", context + [11, 12, 13, 14], 4, GREEDY)
    remote.replay("s", context + [11, 12, 13, 14], [15], 4, GREEDY)  # nothing new: an empty update
    remote.observe_features("s", rows(11, 1))  # a rollback: rows from 11 on are new
    remote.propose("s", context + [11, 12], 4, GREEDY)
    assert deployment.sent() == [(0, 10), (10, 3), (13, 0), (11, 1)]
    assert remote.features_sent.as_dict() == {"calls": 4, "rows": 14, "bytes": 14 * WIDTH * 2}
    held = deployment.drafter.logs["s"]
    assert len(held) == 12 and torch.equal(held.rows(0), rows(0, 12).rows)
    assert remote.resends == 0


@pytest.mark.parametrize("direct", [False, True])
def test_a_deployment_that_lost_the_session_gets_the_rows_again_from_where_it_asks(direct):
    deployment = FakeDrafterDeployment(RecordingWhiteBox(), lose_before_call=2, direct=direct)  # a replica restart
    remote = RemoteDrafter("wb", deployment, None, feature_width=WIDTH)
    remote.observe_features("s", rows(0, 6))
    remote.propose("s", list(range(7)), 3, GREEDY)
    remote.observe_features("s", rows(6, 2))
    remote.propose("s", list(range(9)), 3, GREEDY)
    assert deployment.sent() == [(0, 6), (6, 2), (0, 8)]  # refused after the gap, then resent from 0
    assert remote.resends == 1 and torch.equal(deployment.drafter.logs["s"].rows(0), rows(0, 8).rows)
    remote.observe_features("s", rows(8, 1))
    remote.replay("s", list(range(10)), [10], 3, GREEDY)
    assert deployment.sent()[-1] == (8, 1)  # back to increments


def test_a_gap_the_router_cannot_fill_drafts_nothing_and_does_not_fail():
    """A restarted router joins a session whose target cache (and so its features' start) lives
    on: it holds only the newest rows. A deployment that has the rest takes them; one that lost
    them cannot be helped, and that arm proposes nothing (a target-only round: never wrong)."""
    deployment = FakeDrafterDeployment(RecordingWhiteBox())
    deployment.drafter.observe_features("s", rows(0, 20))  # the replica kept its state
    remote = RemoteDrafter("wb", deployment, None, feature_width=WIDTH)
    remote.observe_features("s", rows(20, 2))
    remote.propose("s", list(range(23)), 3, GREEDY)
    assert deployment.sent() == [(20, 2)] and len(deployment.drafter.logs["s"]) == 22
    deployment.drafter.release("s")  # and now it lost them
    remote.observe_features("s", rows(22, 1))
    assert remote.propose("s", list(range(24)), 3, GREEDY) == Proposal([], [])
    assert remote.replay("s", list(range(24)), [24], 3, GREEDY) is None


def test_release_frees_the_routers_copy_and_the_relay_is_bounded():
    relay = FeatureRelay(WIDTH, capacity=2)
    deployment = FakeDrafterDeployment(RecordingWhiteBox())
    a, b = RemoteDrafter("a", deployment, None, WIDTH, relay), RemoteDrafter("b", deployment, None, WIDTH, relay)
    for drafter in (a, b):  # the loop hands every white-box arm the same rows: one copy
        drafter.observe_features("s", rows(0, 4))
    assert relay.sessions() == 1 and relay.span("s") == (0, 4)
    a.release("s")
    assert relay.sessions() == 0 and not a._sent and "s" not in deployment.drafter.logs
    for session in ("x", "y", "z"):
        a.observe_features(session, rows(0, 1))
    assert relay.sessions() == 2 and relay.span("x") == (0, 0)  # least recently used forgotten


def test_the_relay_keeps_the_wire_values_bit_for_bit():
    torch.manual_seed(1)
    received = convert.features_from_proto(convert.features_to_proto(Features(0, torch.randn(3, WIDTH)), "bfloat16"))
    relay = FeatureRelay(WIDTH, "bfloat16")
    relay.observe("s", received)
    assert relay.since("s", 0).data == convert.features_to_proto(received, "bfloat16").data
    assert relay.since("s", 1).start == 1 and relay.since("s", 4) is None


# -- the whole path: target over protos, router, white-box deployment over protos --------------------------------
class FakeTargetDeployment:
    """The target deployment's Verify over bytes, through verify_batch as its @serve.batch handler does."""

    def __init__(self, verifier, dtype: str = "float16", strip_features: bool = False):
        self.verifier, self.dtype, self.strip_features = verifier, dtype, strip_features

    def call(self, method: str, message, session_id: str = "", timeout_s: float | None = None):
        if method == "Release":
            self.verifier.release(message.session_id)
            return common_pb2.ReleaseResponse(released=True)
        request = convert.verify_request_from_proto(wire(message))
        (result,) = self.verifier.verify_batch([request])
        response = convert.verify_result_to_proto(result, self.dtype)
        if self.strip_features:  # a target deployment older than the field
            response.ClearField("features")
        return wire(response)


def tiny_eagle(target_lm, **options) -> EagleDrafter:
    model, tokenizer = target_lm
    config = model.config
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                                 num_kv_heads=config.num_key_value_heads, intermediate_size=config.intermediate_size,
                                 reduced_vocab=config.vocab_size, max_positions=config.max_position_embeddings),
                     model.get_input_embeddings().weight.detach().float(), torch.arange(config.vocab_size))
    from specpool.target.models import tokenizer_fingerprint

    return EagleDrafter("eagle", head.eval(), {"target_tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}, **options)


@pytest.mark.parametrize("dtype, lose", [("float16", None), ("bfloat16", 3)])
def test_served_white_box_greedy_equals_target_only(target_lm, verifier, prompts, dtype, lose):
    prompt = prompts[0]
    reference = speculative_generate(prompt, session_id="ref", drafters={}, chooser=FixedChooser(None),
                                     verifier=verifier, params=GREEDY, k=4).token_ids
    target = RemoteVerifier(FakeTargetDeployment(verifier, dtype))
    deployment = FakeDrafterDeployment(tiny_eagle(target_lm), lose_before_call=lose)
    remote = RemoteDrafter("eagle", deployment, None, verifier.feature_width, FeatureRelay(verifier.feature_width, dtype))
    result = speculative_generate(prompt, session_id="s", drafters={"eagle": remote}, chooser=FixedChooser("eagle"),
                                  verifier=target, params=GREEDY, k=4)
    assert result.token_ids == reference
    proposes = [m for method, m in deployment.calls if method == "Propose"]
    rounds = result.rounds
    drafted = [i for i, r in enumerate(rounds) if r.drafter == "eagle" and r.k > 0]
    assert drafted and drafted[0] == 1  # the first round is the target's prefill alone
    assert len(proposes) == len(drafted) + (1 if lose else 0)  # + the call made again after the loss
    # Bytes: the target sends each position's row once: the prompt's, then accepted + 1 a round ...
    per_round = [len(prompt)] + [r.accepted + 1 for r in rounds[1:]]
    assert target.features_received.rows == sum(per_round)
    assert target.features_received.bytes == sum(per_round) * verifier.feature_width * 2
    # ... and the router sends the deployment each row once more, up to the last round that drafted
    # (plus, after the loss, the rows before the failed call's start once again).
    again = proposes[lose - 1].features.start if lose else 0
    assert remote.features_sent.rows == sum(per_round[:drafted[-1]]) + again
    assert remote.resends == (1 if lose else 0) and (not lose or again > 0)


class RecordingTarget(FakeTargetDeployment):
    def __init__(self, verifier):
        super().__init__(verifier)
        self.requests: list[VerifyRequest] = []

    def call(self, method: str, message, session_id: str = "", timeout_s: float | None = None):
        if method == "Verify":
            self.requests.append(convert.verify_request_from_proto(wire(message)))
        return super().call(method, message, session_id, timeout_s)


def test_served_sampled_trees_only_for_a_target_that_says_it_verifies_them(target_lm, verifier, prompts):
    """Runner-up leaves served, sampled: the drafter deployment draws its tree (its Info says
    ``sampled_trees``) and the target deployment verifies it, both over the protos, only when the
    target's Info says ``sampled_trees``; an older target (which would verify a sampled tree as a
    chain: not exact) gets chains. Seeded either way: a request run twice gives the same tokens."""
    params = SamplingParams(temperature=0.8, max_new_tokens=16, seed=11)
    drafter = tiny_eagle(target_lm, alternatives=2, alt_min_prob=0.0)
    outputs = {}
    for says in (True, False):
        target = RecordingTarget(verifier)
        for run in ("a", "b"):
            remote = RemoteDrafter("eagle", FakeDrafterDeployment(drafter), None, verifier.feature_width,
                                   tree_nodes=drafter.tree_nodes, sampled_trees=drafter.sampled_trees)
            session = f"st-{says}-{run}"
            result = speculative_generate(prompts[1], session_id=session, drafters={"eagle": remote},
                                          chooser=FixedChooser("eagle"), params=params, k=4,
                                          verifier=RemoteVerifier(target, sampled_trees=says))
            assert len(result.token_ids) == params.max_new_tokens
            outputs.setdefault(says, set()).add(tuple(result.token_ids))
            verifier.release(session)
            drafter.release(session)
        trees = [r for r in target.requests if r.tree_parents is not None]
        if says:
            assert trees and all(not r.params.greedy for r in trees)
            assert all(len(r.draft_tokens) > len(primary_chain(r.tree_parents)) for r in trees)  # leaves beside the chain
        else:
            assert not trees
    assert all(len(tokens) == 1 for tokens in outputs.values())


def test_a_target_that_returns_no_features_fails_a_white_box_arm_clearly(target_lm, verifier, prompts):
    target = RemoteVerifier(FakeTargetDeployment(verifier, strip_features=True))
    remote = RemoteDrafter("eagle", FakeDrafterDeployment(tiny_eagle(target_lm)), None, verifier.feature_width)
    with pytest.raises(FailedPrecondition, match="no features"):
        speculative_generate(prompts[0], session_id="s", drafters={"eagle": remote}, chooser=FixedChooser("eagle"),
                             verifier=target, params=GREEDY, k=4)


def test_feature_bytes_reach_the_metrics_by_link():
    from specpool.services.metrics import PrometheusMetrics

    metrics = PrometheusMetrics()
    deployment = FakeDrafterDeployment(RecordingWhiteBox())
    remote = RemoteDrafter("wb", deployment, None, feature_width=WIDTH)
    remote.features_sent.observer = lambda count: metrics.feature_bytes("drafter", "wb", count)
    remote.observe_features("s", rows(0, 3))
    remote.propose("s", [1, 2, 3, 4], 2, GREEDY)
    sample = metrics.registry.get_sample_value("specpool_feature_bytes_total", {"link": "drafter", "drafter": "wb"})
    assert sample == 3 * WIDTH * 2 == remote.features_sent.bytes
