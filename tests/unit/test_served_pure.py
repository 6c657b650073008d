"""Served mode, the pure parts: builder args, the status mapping, proto <-> dataclass conversion,
benchmark aggregation, and the CLI paths that fail before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch

from cli_helpers import assert_one_line_error
from specpool.drafters.base import Proposal
from specpool.core.errors import (Cancelled, DeadlineExceeded, FailedPrecondition, IncompatibleModels, InvalidArgument, ModelUnavailable, NotFound,
                           SessionBusy, SpecpoolError, StoreUnavailable)
from specpool.services import api, convert, serve_config
from specpool.v1 import common_pb2, specpool_pb2
from specpool.services.serve_config import DrafterArgs, RouterArgs, TargetArgs, default_serve_config, load_serve_config, plan_from_config
from specpool.services.status import grpc_status, is_unavailable, unwrap
from specpool.target.features import Features
from specpool.target.rejection import SparseDist
from specpool.target.sampling import SamplingParams
from specpool.target.verifier import VerifyRequest, VerifyResult

REPO = Path(__file__).resolve().parents[2]


# -- builder args ---------------------------------------------------------------------------------------------
def test_served_and_embedded_take_the_one_set_of_defaults():
    """Defaults are written once (specpool/core/defaults.py); the served router's args, the policies and
    the CLI read them instead of repeating the numbers."""
    from specpool.cli.main import build_parser
    from specpool.core import defaults
    from specpool.router.policies import PolicyOptions

    router = RouterArgs.parse({"drafter_apps": {"code": "d"}})
    assert (router.policy, router.k, router.beta, router.probe_rounds, router.max_new_tokens) == (
        defaults.DEFAULT_POLICY, defaults.DEFAULT_K, defaults.DEFAULT_BETA, defaults.DEFAULT_PROBE_ROUNDS,
        defaults.DEFAULT_MAX_NEW_TOKENS)
    assert (PolicyOptions().beta, PolicyOptions().probe_rounds) == (defaults.DEFAULT_BETA, defaults.DEFAULT_PROBE_ROUNDS)
    generate = build_parser().parse_args(["generate", "a prompt"])
    assert (generate.k, generate.beta, generate.probe_rounds, generate.max_new_tokens, generate.tenant, generate.target) == (
        defaults.DEFAULT_K, defaults.DEFAULT_BETA, defaults.DEFAULT_PROBE_ROUNDS, defaults.DEFAULT_MAX_NEW_TOKENS,
        defaults.DEFAULT_TENANT, defaults.DEFAULT_TARGET)
    assert SamplingParams().max_new_tokens == defaults.DEFAULT_MAX_NEW_TOKENS


def test_router_args_parse_and_keep_the_pool_order():
    args = RouterArgs.parse({"redis_url": "redis://r:6379/0", "policy": "thompson", "k": 3,
                             "drafter_apps": {"ngram": "drafter-ngram", "code": "drafter-code"}, "num_replicas": 2,
                             "ray_actor_options": {"num_cpus": 1, "num_gpus": 0}})
    assert args.pool == ["ngram", "code"] and args.k == 3 and args.num_replicas == 2 and args.transport == "grpc"
    assert args.direct_calls and not RouterArgs.parse({"drafter_apps": {"code": "d"}, "direct_calls": False}).direct_calls
    assert not args.feedback  # online-learning feedback is opt-in
    assert args.probe_rounds == 4 and RouterArgs.parse({"drafter_apps": {"code": "d"}, "probe_rounds": 2}).probe_rounds == 2
    learning = RouterArgs.parse({"drafter_apps": {"code": "d"}, "feedback": True, "feedback_stream": "fb",
                                 "feedback_top_k": 32, "feedback_opt_out": ["acme", "beta.co"]})
    assert (learning.feedback, learning.feedback_stream, learning.feedback_top_k, learning.feedback_opt_out) == \
        (True, "fb", 32, ("acme", "beta.co"))


@pytest.mark.parametrize("args,message", [
    ({}, "drafter_apps is required"),
    ({"drafter_apps": {}}, "non-empty mapping"),
    ({"drafter_apps": {"ngram": "a", "code": "a"}}, "one application for two drafters"),
    ({"drafter_apps": {"ngram": "a"}, "polcy": "x"}, "unknown key 'polcy'"),
    ({"drafter_apps": {"ngram": "a"}, "k": 0}, "k must be in 1..32"),
    ({"drafter_apps": {"ngram": "a"}, "k": True}, "k must be an integer"),
    ({"drafter_apps": {"ngram": "a"}, "num_replicas": 0}, "num_replicas must be >= 1"),
    ({"drafter_apps": {"ngram": "a"}, "redis_url": "http://x"}, "redis_url must be"),
    ({"drafter_apps": {"ngram": "a"}, "policy": "nope"}, "unknown policy"),
    ({"drafter_apps": {"ngram": "a"}, "policy": "fixed:code"}, "does not serve"),
    ({"drafter_apps": {"ngram": "a"}, "ray_actor_options": {"num_cpus": -1}}, "num_cpus must be >= 0"),
    ({"drafter_apps": {"ngram": "a"}, "transport": "udp"}, "transport must be grpc or actor"),
    ({"drafter_apps": {"ngram": "a"}, "feedback": "yes"}, "feedback must be true or false"),
    ({"drafter_apps": {"ngram": "a"}, "direct_calls": 1}, "direct_calls must be true or false"),
    ({"drafter_apps": {"ngram": "a"}, "feedback_top_k": 65}, "feedback_top_k must be in 1..64"),
    ({"drafter_apps": {"ngram": "a"}, "probe_rounds": 0}, "probe_rounds must be >= 1"),
    ({"drafter_apps": {"ngram": "a"}, "feedback_opt_out": "acme"}, "feedback_opt_out must be a list of tenant ids"),
    ({"drafter_apps": {"ngram": "a"}, "feedback_opt_out": ["bad tenant"]}, "feedback_opt_out must be a list of tenant ids"),
    ("not a mapping", "args must be a mapping"),
])
def test_router_args_errors(args, message):
    with pytest.raises(SpecpoolError, match=message):
        RouterArgs.parse(args)


def test_target_args():
    args = TargetArgs.parse({"model": "m", "max_batch_size": 4, "ray_actor_options": {"num_cpus": 3, "num_gpus": 0}})
    assert args.threads == 3 and args.ongoing == 32 and args.dtype == "auto"
    assert TargetArgs.parse({"ray_actor_options": {"num_cpus": 0.5}}).threads == 1
    assert TargetArgs.parse({"device": "cuda", "ray_actor_options": {"num_gpus": 1}}).device == "cuda"
    assert args.feature_dtype == "float16" and TargetArgs.parse({"feature_dtype": "bfloat16"}).feature_dtype == "bfloat16"
    assert args.load_gate and not TargetArgs.parse({"load_gate": False}).load_gate


@pytest.mark.parametrize("args,message", [
    ({"device": "cuda", "ray_actor_options": {"num_cpus": 1, "num_gpus": 0}}, "needs a GPU"),
    ({"device": "tpu"}, "unknown device"),
    ({"dtype": "int8"}, "unknown dtype"),
    ({"max_batch_size": 0}, "max_batch_size must be in 1..256"),
    ({"batch_wait_timeout_s": -1}, "batch_wait_timeout_s must be >= 0"),
    ({"max_batch_size": 16, "max_ongoing_requests": 8}, "must be >= max_batch_size"),
    ({"cache_capacity": 0}, "cache_capacity must be >= 1"),
    ({"modle": "x"}, "unknown key 'modle'"),
    ({"feature_dtype": "float32"}, "feature_dtype must be one of float16, bfloat16"),
    ({"load_gate": "yes"}, "load_gate must be true or false"),
])
def test_target_args_errors(args, message):
    with pytest.raises(InvalidArgument, match=message):
        TargetArgs.parse(args)


def test_drafter_args():
    assert DrafterArgs.parse({"name": "ngram"}).threads == 1
    with pytest.raises(InvalidArgument, match="name is required"):
        DrafterArgs.parse({})
    with pytest.raises(NotFound, match="unknown drafter 'bogus'"):
        DrafterArgs.parse({"name": "bogus"})
    plain = DrafterArgs.parse({"name": "code"})
    assert (plain.model_store, plain.learn_shared, plain.refresh_s) == (None, False, 5.0)  # learned versions: opt-in
    learning = DrafterArgs.parse({"name": "code", "model_store": "/shared/online", "learn_shared": True, "refresh_s": 0})
    assert (learning.model_store, learning.learn_shared, learning.refresh_s) == ("/shared/online", True, 0.0)
    for bad, message in (({"model_store": ""}, "model_store must be a non-empty string"),
                         ({"learn_shared": "yes"}, "learn_shared must be true or false"),
                         ({"refresh_s": -1}, "refresh_s must be >= 0")):
        with pytest.raises(InvalidArgument, match=message):
            DrafterArgs.parse({"name": "code", **bad})


@pytest.fixture
def torch_threads_restored():
    """serve_app._model_thread sets torch's process-wide thread count (and the calling thread's) to 1;
    the tests after these keep this process's own."""
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_a_replica_does_all_its_torch_work_on_its_model_thread(model_dirs, home, monkeypatch, torch_threads_restored):
    """Model loading too: a second thread running torch ops would hold a second OpenMP team
    (serve_app._model_thread). The target and a drafter are built the way Serve builds them."""
    import threading

    from specpool.services import serve_app

    monkeypatch.setenv("SPECPOOL_HOME", str(home))
    loaded_on = []
    for name in ("load_causal_lm", "create_drafter"):
        real = getattr(serve_app, name)
        monkeypatch.setattr(serve_app, name, lambda *a, _real=real, **kw: (loaded_on.append(threading.current_thread().name), _real(*a, **kw))[1])
    threads = torch_threads_restored
    target = serve_app.TargetServer.func_or_class(TargetArgs(model=str(model_dirs.target), torch_threads=threads))
    drafter = serve_app.DrafterServer.func_or_class(DrafterArgs(name=f"hf:{model_dirs.noisy}", target=str(model_dirs.target)))
    assert [n.split("_")[0] for n in loaded_on] == ["target-model", "drafter-model"]
    assert target._model_thread.submit(torch.get_num_threads).result() == threads
    assert drafter._model_thread.submit(torch.get_num_threads).result() == 1  # a drafter's default: one thread
    assert target.info["stop_token_ids"] and target.info["feature_width"] == target.verifier.feature_width
    target._model_thread.shutdown()
    drafter._model_thread.shutdown()


def test_a_targets_batches_stop_waiting_for_a_session_whose_request_ended(model_dirs, home, monkeypatch,
                                                                         torch_threads_restored):
    """A verify batch waits (up to batch_wait_timeout_s) for a call from each session of the last one.
    Release with keep_caches (the router's end-of-request notice) takes the session off that list
    and keeps its cache; without it, a lone session's next request waited the timeout, once."""
    import asyncio

    from specpool.services import serve_app

    monkeypatch.setenv("SPECPOOL_HOME", str(home))
    target = serve_app.TargetServer.func_or_class(TargetArgs(model=str(model_dirs.target)))

    async def scenario():
        # What a batch of s1's verify leaves (@serve.batch runs only inside Serve: the integration
        # test tests/integration/test_served.py goes through it).
        request = VerifyRequest("s1", [1, 2, 3], [], [], SamplingParams(max_new_tokens=4))
        target._model_thread.submit(target._run_batch, [(request, None)]).result()
        target._batch_gate.expected = {"s1"}
        assert (await target.Stats())["waiting_for"] == ["s1"]
        kept = await target.Release(common_pb2.ReleaseRequest(session_id="s1", keep_caches=True))
        assert not kept.released and (await target.Stats())["waiting_for"] == []
        assert await target.Sessions() == ["s1"]  # the cache stays for the session's next request
        assert (await target.Release(common_pb2.ReleaseRequest(session_id="s1"))).released
        assert await target.Sessions() == []

    try:
        asyncio.run(scenario())
    finally:
        target._model_thread.shutdown()


def test_the_targets_batches_are_assembled_by_its_gate_and_sealed_whole(model_dirs, home, monkeypatch,
                                                                        torch_threads_restored):
    """Through the real @serve.batch on an event loop (specpool/services/batch_gate.py): the calls
    the gate releases make one batch, sealed at once; a call that arrives while the last batch's
    answers are still being written waits until they have all left, so the batch it joins waits for
    those sessions' next calls from then on (bench/results/batch-trace). A failed call leaves the
    gate open, and a gate still shut a while after a forward opens anyway."""
    import asyncio
    import time

    from specpool.services import serve_app

    from ray.serve import batching

    monkeypatch.setenv("SPECPOOL_HOME", str(home))
    # Serve's batch queue reads the replica's max_ongoing_requests for a warning; there is no replica here.
    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
    # The queue this test's event loop creates hangs on the class's batch method (one per process
    # in Serve); put back "none yet" afterwards, or the class no longer pickles for a deployment.
    monkeypatch.setattr(serve_app.TargetServer.func_or_class._verify_batch.set_max_batch_size.__self__, "_queue", None)
    target = serve_app.TargetServer.func_or_class(TargetArgs(model=str(model_dirs.target)))
    fired: list[tuple[list[str], float]] = []
    left: dict[str, float] = {}
    run_batch = target._run_batch

    def recording_run_batch(items):
        fired.append(([r.session_id for r, _ in items], time.perf_counter()))
        return run_batch(items)

    target._run_batch = recording_run_batch
    offer_route = serve_app._offer_route

    async def slow_for_a(endpoint, response):  # a's answer takes 300 ms to leave, on the event loop's time
        if slow["a"]:
            await asyncio.sleep(0.3)
        await offer_route(endpoint, response)

    slow = {"a": False}
    monkeypatch.setattr(serve_app, "_offer_route", slow_for_a)
    params = SamplingParams(max_new_tokens=4)

    def call(session: str, context: list[int]):
        return convert.verify_request_to_proto(VerifyRequest(session, context, [], [], params))

    async def verify(session, context):
        response = await target.Verify(call(session, context))
        left[session] = time.perf_counter()
        return response

    async def scenario():
        # Three sessions' first calls: the first goes alone (no batch before it to wait for), the
        # two that came meanwhile wait for its answer and then for its next call: one batch of 3.
        first = [asyncio.ensure_future(verify(s, [1, 2, 3])) for s in ("x", "y")]
        await asyncio.sleep(0)
        await asyncio.gather(*first, verify("z", [1, 2]))
        assert [sorted(sessions) for sessions, _ in fired] == [["x"], ["y", "z"]]
        seen = len(fired)
        # The next rounds of all three: the batch waits for y and z (the last batch), takes x on the
        # way, and goes the moment z is in: one batch of three, sealed whole by Serve.
        await asyncio.gather(*(verify(s, [1, 2, 3, 4]) for s in ("x", "y", "z")))
        assert [sorted(sessions) for sessions, _ in fired[seen:]] == [["x", "y", "z"]]
        for s in ("x", "y", "z"):
            await target.Release(common_pb2.ReleaseRequest(session_id=s, keep_caches=True))
        fired.clear()
        await verify("a", [1, 2, 3])  # a batch of a alone: the next batch waits for a
        slow["a"] = True
        a_round = asyncio.ensure_future(verify("a", [1, 2, 3, 4]))
        await asyncio.sleep(0.05)  # a's forward is done, its answer not yet sent
        assert not target._batch_gate.is_open
        await verify("b", [1, 2])
        await a_round
        assert [sessions for sessions, _ in fired] == [["a"], ["a"], ["b"]]
        assert fired[2][1] >= left["a"], "b's batch fired before a's answer had left"
        # A failed call leaves the gate open.
        slow["a"] = False
        with pytest.raises(Exception):
            await target.Verify(call("c", []))  # no context: refused
        assert target._batch_gate.is_open
        # Insurance: a batch whose answers never all leave opens the gate after fallback_s.
        target._batch_gate.fallback_s = 0.1
        target._batch_gate.expected.clear()
        target._run_batch = lambda items: (target._batch_gate._answering.add("ghost"), run_batch(items))[1]
        await verify("d", [1, 2])
        assert not target._batch_gate.is_open
        await asyncio.sleep(0.2)
        assert target._batch_gate.is_open
        await target._direct.stop()

    try:
        asyncio.run(scenario())
    finally:
        target._model_thread.shutdown()


def test_a_target_that_hosts_a_drafter_drafts_inside_its_verify_batch(model_dirs, home, monkeypatch, torch_threads_restored):
    """TargetArgs.hosted_drafters (specpool/router/hosted.py): the target replica loads the drafter on its
    model thread, lists it in Info, drafts with it in a verify batch beside a round that carries its
    own draft, answers with the proposal on the wire, and frees the drafter's session with its own."""
    import asyncio

    from specpool.router.hosted import HostedDraft
    from specpool.services import serve_app

    monkeypatch.setenv("SPECPOOL_HOME", str(home))
    name = f"hf:{model_dirs.noisy}"
    target = serve_app.TargetServer.func_or_class(TargetArgs(model=str(model_dirs.target), hosted_drafters=(name,)))
    try:
        assert target.info["hosted"] == {name: {"tokenizer_fingerprint": target.verifier.tokenizer_fingerprint,
                                                "feature_width": 0, "tree_nodes": 0, "sampled_trees": False}}
        assert target.info["sampled_trees"] is True  # routers may send it sampled trees
        params = SamplingParams(max_new_tokens=8)
        hosted = VerifyRequest("h", [1, 2, 3, 4], [], [], params)
        own = VerifyRequest("o", [1, 2, 3, 4], [5], [SparseDist.one_hot(5)], params)
        (proposal, result), (own_proposal, own_result) = target._model_thread.submit(
            target._run_batch, [(hosted, HostedDraft(name, 3)), (own, None)]).result()
        assert 1 <= len(proposal.tokens) <= 3 and len(result.tokens) == result.accepted + 1
        assert own_proposal.tokens == [5] and len(own_result.tokens) == own_result.accepted + 1
        response = convert.verify_result_to_proto(result, drafted=proposal)
        assert convert.proposal_from_proto(response.drafted).tokens == proposal.tokens
        drafter = target.hosting.drafters[name]
        assert "h" in drafter.caches.sessions()
        assert (asyncio.run(target.Release(common_pb2.ReleaseRequest(session_id="h")))).released
        assert "h" not in drafter.caches.sessions()
        stats = asyncio.run(target.Stats())
        assert stats["hosted_draft_failures"] == 0 and stats["plain_batches"] == 0  # a batch of two drafts first
        assert target.hosting.gate is not None  # on by default (TargetArgs.load_gate)
    finally:
        target._model_thread.shutdown()


def test_a_hosted_draft_on_the_wire_round_trips_and_bad_ones_are_refused():
    from specpool.router.hosted import HostedDraft

    request = VerifyRequest("s", [1, 2], [], [], SamplingParams())
    msg = convert.verify_request_to_proto(request, HostedDraft("lookup:eagle:general", 5, True, ("lookup:eagle:general", "eagle:code")))
    assert convert.hosted_draft_from_proto(msg) == HostedDraft("lookup:eagle:general", 5, True, ("lookup:eagle:general", "eagle:code"))
    assert convert.hosted_draft_from_proto(convert.verify_request_to_proto(request)) is None
    feed_only = convert.verify_request_to_proto(request, HostedDraft(None, feed=("eagle:code",)))
    assert convert.hosted_draft_from_proto(feed_only) == HostedDraft(None, 0, False, ("eagle:code",))
    with pytest.raises(InvalidArgument, match="k in 1..32"):
        convert.hosted_draft_from_proto(convert.verify_request_to_proto(request, HostedDraft("eagle:code", 0)))
    drafted = convert.verify_request_to_proto(VerifyRequest("s", [1], [5], [SparseDist.one_hot(5)], SamplingParams()),
                                              HostedDraft("eagle:code", 3))
    with pytest.raises(InvalidArgument, match="carries no draft tokens"):
        convert.hosted_draft_from_proto(drafted)


def test_the_router_reads_a_hosted_drafts_proposal_and_refuses_a_target_that_drafted_none():
    from specpool.router.hosted import HostedDraft
    from specpool.services.remote import RemoteVerifier
    from specpool.v1 import target_pb2

    sent = []

    class Caller:
        def __init__(self, drafted: bool):
            self.drafted = drafted

        def call(self, method, message, session_id="", timeout_s=None):
            sent.append(message)
            response = target_pb2.VerifyResponse(accepted=1, tokens=[7, 9], tv=[0.0])
            if self.drafted:
                response.drafted.CopyFrom(convert.proposal_to_proto(Proposal([7], [SparseDist.one_hot(7)], 0.004)))
            return response

    request = VerifyRequest("s", [1, 2], [], [], SamplingParams())
    proposal, result = RemoteVerifier(Caller(True)).draft_and_verify(request, HostedDraft("eagle:code", 3, feed=("eagle:code",)))
    assert proposal.tokens == [7] and proposal.forward_s == 0.004 and result.tokens == [7, 9]
    assert convert.hosted_draft_from_proto(sent[-1]) == HostedDraft("eagle:code", 3, False, ("eagle:code",))
    with pytest.raises(FailedPrecondition, match="did not draft with hosted drafter 'eagle:code'"):
        RemoteVerifier(Caller(False)).draft_and_verify(request, HostedDraft("eagle:code", 3))


def test_the_routers_end_of_request_notice_is_a_keep_caches_release_sent_without_waiting():
    """RemoteVerifier.request_finished returns at once; its Release(keep_caches) follows on a thread
    of its own, and a failure there is swallowed (a lost notice costs one batch timeout)."""
    import threading

    from specpool.services.remote import NOTICE_TIMEOUT_S, RemoteVerifier

    sent, release = [], threading.Event()

    class Caller:
        def call(self, method, message, session_id="", timeout_s=None):
            release.wait(5)
            sent.append((method, message.session_id, message.keep_caches, session_id, timeout_s))
            raise ModelUnavailable("the target is restarting")

    verifier = RemoteVerifier(Caller())
    verifier.request_finished("acme/s1")
    assert sent == []  # not waited for
    release.set()
    verifier._notices.shutdown(wait=True)
    assert sent == [("Release", "acme/s1", True, "acme/s1", NOTICE_TIMEOUT_S)]


def test_a_stray_torch_op_on_another_thread_of_a_replica_starts_no_second_team(torch_threads_restored):
    """A thread takes torch's process-wide thread count at its first parallel op. The target's model
    thread runs at 2, and Serve's event-loop thread encodes a prefill's features (a parallel copy):
    at 2 threads too it would start a second OpenMP team, and every later forward slows
    (``python -m bench.omp_teams --stray-op``). serve_app._model_thread leaves every thread but the
    model thread at 1."""
    import threading

    from specpool.services import serve_app

    model_thread = serve_app._model_thread(2, "target-model")
    try:
        assert model_thread.submit(torch.get_num_threads).result() == 2
        seen = []

        def event_loop_work():  # what TargetServer.Verify does on Serve's loop for a prefill of 300 rows
            convert.features_to_proto(Features(0, torch.randn(300, 576)))
            seen.append(torch.get_num_threads())

        other = threading.Thread(target=event_loop_work)
        other.start()
        other.join()
        assert seen == [1]
        assert model_thread.submit(torch.get_num_threads).result() == 2  # the model thread keeps its team
    finally:
        model_thread.shutdown()


def test_the_router_leaves_every_session_thread_at_one_torch_thread(torch_threads_restored, monkeypatch):
    """The router has no model but decodes features on each session's thread; whatever torch's count
    was before (Ray sets it from the replica's num_cpus), none of those threads starts a team."""
    import asyncio
    import gc
    import threading
    import warnings

    from specpool.services import serve_app

    torch.set_num_threads(2)  # as a router replica given num_cpus: 2 would start

    class Stop(Exception):
        pass

    def stop_here(*args, **kwargs):
        raise Stop  # the rest of the constructor needs Redis and Serve

    monkeypatch.setattr(serve_app, "RedisSessionStore", stop_here)
    router_class = serve_app.RouterServer.func_or_class
    router = router_class.__new__(router_class)  # Serve awaits an async constructor the same way
    with pytest.raises(Stop):
        asyncio.run(router.__init__(RouterArgs.parse({"drafter_apps": {"code": "d"}})))
    with warnings.catch_warnings():  # Serve's ingress wrapper has an async __del__, never awaited outside Serve
        warnings.simplefilter("ignore", RuntimeWarning)
        del router
        gc.collect()
    seen = []

    def session_thread():  # what a session's thread does with a prefill's features
        convert.features_from_proto(convert.features_to_proto(Features(0, torch.randn(300, 576))))
        seen.append(torch.get_num_threads())

    other = threading.Thread(target=session_thread)
    other.start()
    other.join()
    assert seen == [1]


def test_white_box_drafters_deploy_like_any_drafter_spec():
    """``specpool serve --pool eagle:PATH,lookup:eagle:PATH``: one drafter application each, named
    from the spec (a long head path still gives a valid, distinct application name)."""
    from specpool.cli.main import build_parser
    from specpool.cli.served import serve_config_from_args

    long_path = "/srv/" + "heads/" * 20 + "code"
    pool = ["eagle:/tmp/heads/t1", "lookup:eagle:/tmp/heads/t1", f"eagle:{long_path}", f"eagle:{long_path}2"]
    args = build_parser().parse_args(["serve", "--pool", ",".join(pool), "--feature-dtype", "bfloat16", "--no-host-heads"])
    config, _ = serve_config_from_args(args)
    plan = plan_from_config(config)
    names = [a.name for a in plan.apps]
    assert names[:3] == ["target", "drafter-eagle-tmp-heads-t1", "drafter-lookup-eagle-tmp-heads-t1"]
    assert len(set(names)) == len(names) and all(len(n) <= 100 for n in names)
    assert RouterArgs.parse(plan.router.args).pool == pool
    assert [DrafterArgs.parse(a.args).name for a in plan.apps[1:-1]] == pool
    assert TargetArgs.parse(plan.apps[0].args).feature_dtype == "bfloat16"
    assert "feature_dtype" not in default_serve_config(["eagle:/h"])["applications"][1]["args"]  # float16: the default
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config)  # Serve itself accepts the names


def test_by_default_the_target_hosts_the_pools_white_box_heads():
    """``specpool serve --pool eagle:A,ngram,lookup:eagle:B``: the target application hosts both heads
    (specpool/router/hosted.py), the router maps them to it, only ngram gets a drafter application;
    a head mapped to a target that does not host it, and a hosted head with feedback, are refused."""
    from specpool.cli.main import build_parser
    from specpool.cli.served import serve_config_from_args

    pool = ["eagle:/h/a", "ngram", "lookup:eagle:/h/b"]
    config, _ = serve_config_from_args(build_parser().parse_args(["serve", "--pool", ",".join(pool)]))
    plan = plan_from_config(config)
    assert [a.name for a in plan.apps] == ["target", "drafter-ngram", "router"]
    assert TargetArgs.parse(plan.apps[0].args).hosted_drafters == ("eagle:/h/a", "lookup:eagle:/h/b")
    router = RouterArgs.parse(plan.router.args)
    assert router.pool == pool and dict(router.drafter_apps) == {"eagle:/h/a": "target", "ngram": "drafter-ngram",
                                                                 "lookup:eagle:/h/b": "target"}
    assert serve_config.is_white_box_spec("lookup:lookup:eagle-tree:x") and not serve_config.is_white_box_spec("lookup:code")
    target = config["applications"][1]
    target["args"]["hosted_drafters"] = ["eagle:/h/a"]
    with pytest.raises(InvalidArgument, match="hosted_drafters do not include 'lookup:eagle:/h/b'"):
        plan_from_config(config)
    target["args"]["hosted_drafters"] = ["eagle:/h/a", "eagle:/h/a"]
    with pytest.raises(InvalidArgument, match="names a drafter twice"):
        plan_from_config(config)
    target["args"]["hosted_drafters"] = ["eagle:/h/a", "lookup:eagle:/h/b"]
    config["applications"][0]["args"]["feedback"] = True
    with pytest.raises(InvalidArgument, match="hosted by the target, which serves its shipped weights"):
        plan_from_config(config)
    with pytest.raises(InvalidArgument, match="with --config, set it in"):
        serve_config_from_args(build_parser().parse_args(["serve", "--config", "x.yaml", "--no-host-heads"]))


def test_the_load_gate_is_on_by_default_and_a_flag_turns_it_off():
    from specpool.cli.main import build_parser
    from specpool.cli.served import serve_config_from_args

    def target_args(*flags):
        config, _ = serve_config_from_args(build_parser().parse_args(["serve", "--pool", "eagle:/h/a,ngram", *flags]))
        return TargetArgs.parse(plan_from_config(config).apps[0].args)

    assert target_args().load_gate and target_args("--load-gate").load_gate
    assert not target_args("--no-load-gate").load_gate
    with pytest.raises(InvalidArgument, match="--load-gate/--no-load-gate is for the default config"):
        serve_config_from_args(build_parser().parse_args(["serve", "--config", "x.yaml", "--no-load-gate"]))


def test_the_kubernetes_serve_config_is_a_valid_plan():
    config = load_serve_config(REPO / "k8s" / "rayservice.yaml")  # a RayService: its serveConfigV2
    plan = plan_from_config(config, "k8s/rayservice.yaml")
    assert plan.apps[-1].name == "router"  # deployed last
    assert plan.grpc_port == 9000
    from specpool.services.engine import default_pool

    assert RouterArgs.parse(plan.router.args).pool == default_pool()  # what `specpool serve` deploys


def test_the_default_config_serves_the_pool():
    config = default_serve_config(["ngram", "code"], cores=2)
    plan = plan_from_config(config)
    assert [a.name for a in plan.apps] == ["target", "drafter-ngram", "drafter-code", "router"]
    assert plan.grpc_port == 50051 and serve_config.GRPC_SERVICER_FUNCTIONS[0] in plan.grpc_servicer_functions
    assert plan.cpus_wanted() == 1 + 2 + 0.5 + 1
    # The target's forwards use every core (serve_config.target_threads_for says why).
    assert TargetArgs.parse(plan.apps[0].args).threads == 2
    assert [serve_config.target_threads_for(c) for c in (1, 2, 8)] == [1, 2, 8]
    # The model applications' per-round calls are not access-logged; the router's requests are.
    assert {a.name: a.logging_config for a in plan.apps} == {
        "target": serve_config.MODEL_APP_LOGGING, "drafter-ngram": serve_config.MODEL_APP_LOGGING,
        "drafter-code": serve_config.MODEL_APP_LOGGING, "router": None}
    from ray.serve.schema import ServeDeploySchema  # ray[serve] is a runtime dependency

    validated = ServeDeploySchema.model_validate(config)  # Serve itself accepts it
    assert sorted(app.name for app in validated.applications) == sorted(a.name for a in plan.apps)


def test_the_kubernetes_model_applications_log_like_the_default_config():
    plan = plan_from_config(load_serve_config(REPO / "k8s" / "rayservice.yaml"), "k8s/rayservice.yaml")
    for app in plan.apps:
        expected = None if app.name == "router" else serve_config.MODEL_APP_LOGGING
        assert app.logging_config == expected, app.name


@pytest.mark.parametrize("mutate,message", [
    (lambda c: c["applications"].pop(0), "exactly one router"),
    (lambda c: c["applications"][1].update(route_prefix="/t"), "only the router may have a route_prefix"),
    (lambda c: c["applications"][2]["args"].update(name="code"), "serves drafter 'code'"),
    (lambda c: c["applications"][0]["args"].update(target_app="nothere"), "target_app 'nothere'"),
    (lambda c: c["applications"][1].update(import_path="x.y:z"), "import_path must be one of"),
    (lambda c: c["grpc_options"].update(grpc_servicer_functions=["a.b:c"]), "must include"),
    (lambda c: c["applications"][1].update(logging_config="quiet"), "logging_config must be a mapping"),
    (lambda c: c["applications"][1].update(logging_config={"log_level": "LOUD"}), r"invalid logging_config \(log_level: .*LOUD"),
    (lambda c: c["applications"][1].update(logging_config={"colour": True}), r"invalid logging_config \(colour: Extra inputs"),
])
def test_plan_errors(mutate, message):
    config = default_serve_config(["ngram"], cores=1)
    mutate(config)
    with pytest.raises(SpecpoolError, match=message):
        plan_from_config(config)


def test_load_serve_config_errors(tmp_path):
    with pytest.raises(NotFound):
        load_serve_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [\n")
    with pytest.raises(InvalidArgument, match="not valid YAML"):
        load_serve_config(bad)


def test_builders_validate_their_args():
    from specpool.services import serve_app

    with pytest.raises(InvalidArgument, match="drafter_apps is required"):
        serve_app.build_router_app({})
    with pytest.raises(InvalidArgument, match="unknown dtype"):
        serve_app.build_target_app({"dtype": "int3"})
    with pytest.raises(NotFound):
        serve_app.build_drafter_app({"name": "bogus"})
    app = serve_app.build_target_app({"max_batch_size": 4})
    assert type(app).__name__ == "Application"


# -- status mapping --------------------------------------------------------------------------------------------
class RayTaskError(Exception):  # named like Ray's wrapper: the mapping looks at names, not imports
    def __init__(self, cause):
        super().__init__(f"Traceback (most recent call last):\n  File x\n{cause!r}")
        self.cause = cause


class ActorDiedError(Exception):
    pass


class BackPressureError(Exception):
    pass


@pytest.mark.parametrize("exc,code", [
    (InvalidArgument("bad k"), grpc.StatusCode.INVALID_ARGUMENT),
    (IncompatibleModels("tokenizers differ"), grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound("no such drafter"), grpc.StatusCode.NOT_FOUND),
    (ModelUnavailable("down"), grpc.StatusCode.UNAVAILABLE),
    (StoreUnavailable("redis down"), grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (Cancelled("gone"), grpc.StatusCode.CANCELLED),
    (SessionBusy("busy"), grpc.StatusCode.ABORTED),
    (SpecpoolError("plain"), grpc.StatusCode.INTERNAL),
    (RayTaskError(NotFound("wrapped")), grpc.StatusCode.NOT_FOUND),
    (ActorDiedError("x"), grpc.StatusCode.UNAVAILABLE),
    (BackPressureError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
    (ZeroDivisionError("division by zero"), grpc.StatusCode.INTERNAL),
])
def test_one_mapping_from_errors_to_status_codes(exc, code):
    got, message = grpc_status(exc)
    assert got == code
    assert "\n" not in message and "Traceback" not in message and message


def test_status_messages():
    assert grpc_status(RayTaskError(InvalidArgument("k must be in 1..32")))[1] == "k must be in 1..32"
    assert "ZeroDivisionError" in grpc_status(ZeroDivisionError("x"))[1]  # the type, not the trace
    assert len(grpc_status(InvalidArgument("x" * 5000))[1]) <= 1000
    assert unwrap(RayTaskError(RayTaskError(Cancelled("c")))).__class__ is Cancelled
    assert is_unavailable(RayTaskError(ActorDiedError())) and not is_unavailable(RayTaskError(InvalidArgument("x")))


# -- proto <-> dataclass ---------------------------------------------------------------------------------------
def test_verify_round_trip():
    q = [SparseDist(torch.tensor([5, 9]), torch.tensor([0.75, 0.25])), SparseDist.one_hot(3)]
    request = VerifyRequest("s", [1, 2, 3], [5, 3], q, SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=11), 4)
    back = convert.verify_request_from_proto(convert.verify_request_to_proto(request))
    assert (back.session_id, back.context_ids, back.draft_tokens, back.return_top_k) == ("s", [1, 2, 3], [5, 3], 4)
    assert back.params == SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=11)  # 0.7 stays 0.7 (float32 wire)
    for a, b in zip(back.q, q):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.probs, b.probs.float())
    result = VerifyResult(1, [5, 7], [0.1234567890123, 0.5], [SparseDist(torch.tensor([1]), torch.tensor([1.0]))] * 3, 0.02)
    back = convert.verify_result_from_proto(convert.verify_result_to_proto(result))
    assert back.tv == result.tv  # double on the wire: rewards equal the embedded engine's exactly
    assert (back.accepted, back.tokens, len(back.target_top_k), back.forward_s) == (1, [5, 7], 3, 0.02)


def test_verify_request_errors():
    msg = convert.verify_request_to_proto(VerifyRequest("s", [1], [5], [SparseDist.one_hot(5)], SamplingParams()))
    del msg.q[:]
    with pytest.raises(InvalidArgument, match="one q per draft token"):
        convert.verify_request_from_proto(msg)
    msg = convert.verify_request_to_proto(VerifyRequest("", [1], [], [], SamplingParams()))
    with pytest.raises(InvalidArgument, match="session_id is empty"):
        convert.verify_request_from_proto(msg)


def test_proposal_round_trip():
    proposal = Proposal([4, 8], [SparseDist(torch.tensor([4, 2]), torch.tensor([0.5, 0.5])), SparseDist.one_hot(8)], 0.01)
    back = convert.proposal_from_proto(convert.proposal_to_proto(proposal))
    assert back.tokens == [4, 8] and back.forward_s == 0.01 and torch.equal(back.q[0].probs, proposal.q[0].probs)
    args = convert.propose_request_from_proto(convert.propose_request_to_proto("s", [1, 2], 5, SamplingParams(seed=3)))
    assert (args.session_id, args.context_ids, args.k, args.params.seed, args.drafter) == ("s", [1, 2], 5, 3, "")
    assert (args.tenant, args.weight_version) == ("", None)  # a first round: the serving version
    for version in (0, 7):  # later rounds: exactly the first round's version (0 = the shipped weights)
        pinned = convert.propose_request_from_proto(convert.propose_request_to_proto(
            "s", [1], 2, SamplingParams(), tenant="acme", weight_version=version))
        assert (pinned.tenant, pinned.weight_version) == ("acme", version)
    assert convert.proposal_from_proto(convert.proposal_to_proto(proposal, 7)).tokens == [4, 8]
    assert convert.proposal_to_proto(proposal, 7).weight_version == 7
    with pytest.raises(InvalidArgument, match="invalid tenant"):
        convert.propose_request_from_proto(convert.propose_request_to_proto("s", [1], 2, SamplingParams(), tenant="a b"))
    with pytest.raises(InvalidArgument, match="k \\(draft length\\)"):
        convert.propose_request_from_proto(convert.propose_request_to_proto("s", [1], 0, SamplingParams()))


def test_replay_round_trip():
    args = convert.replay_request_from_proto(convert.replay_request_to_proto("s", [1, 2], [7, 8, 9], 4, SamplingParams()))
    assert (args.session_id, args.context_ids, args.continuation, args.k, args.drafter) == ("s", [1, 2], [7, 8, 9], 4, "")
    assert args.params.greedy and (args.tenant, args.weight_version) == ("", None)
    pinned = convert.replay_request_from_proto(convert.replay_request_to_proto(
        "s", [1], [3], 2, SamplingParams(), drafter="code", tenant="acme", weight_version=0))
    assert (pinned.drafter, pinned.tenant, pinned.weight_version) == ("code", "acme", 0)
    for accepted in (0, 3, None):  # None: the drafter cannot say
        assert convert.replay_from_proto(convert.replay_to_proto(accepted, 0.01)) == accepted


@pytest.mark.parametrize("context, continuation, k, params, message", [
    ([1], [3], 0, SamplingParams(), "k \\(draft length\\)"),
    ([], [3], 2, SamplingParams(), "non-empty context"),
    ([1], [], 2, SamplingParams(), "1..k\\+1 of the target's tokens"),
    ([1], [3, 4, 5, 6], 2, SamplingParams(), "1..k\\+1 of the target's tokens"),
    ([1], [3], 2, SamplingParams(temperature=0.7), "greedy"),
])
def test_replay_request_errors(context, continuation, k, params, message):
    with pytest.raises(InvalidArgument, match=message):
        convert.replay_request_from_proto(convert.replay_request_to_proto("s", context, continuation, k, params))


def test_generate_request_round_trip():
    msg = api.request_to_proto("hi", max_new_tokens=7, temperature=0.7, top_p=0.9, seed=3, stop=["\n\n"], policy="fixed:code",
                               k=4, session_id="s1", tenant="acme")
    spec = api.spec_from_proto(specpool_pb2.GenerateRequest.FromString(msg.SerializeToString()))
    assert spec == api.GenerationSpec("prompt", "hi", (), 0.7, 0.9, 0, 3, 7, ("\n\n",), (), "fixed:code", 4, "s1", "acme")
    chat = api.spec_from_proto(api.request_to_proto(chat=[("system", "be brief"), ("user", "hi")]))
    assert chat.input_kind == "chat" and chat.messages == (("system", "be brief"), ("user", "hi"))
    assert api.spec_from_proto(api.request_to_proto(raw_prompt="def f(")).input_kind == "raw"
    assert api.spec_from_proto(api.request_to_proto("x")).top_p == 1.0  # unset top_p means 1


@pytest.mark.parametrize("msg,message", [
    (specpool_pb2.GenerateRequest(), "no input"),
    (specpool_pb2.GenerateRequest(prompt="   "), "the prompt is empty"),
    (specpool_pb2.GenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(top_p=0.0)), "top-p must be in"),
    (specpool_pb2.GenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(temperature=-1)), "temperature must be"),
    (specpool_pb2.GenerateRequest(prompt="x", k=33), "k \\(draft length\\)"),
    (specpool_pb2.GenerateRequest(prompt="x", stop=[""]), "stop strings"),
    (specpool_pb2.GenerateRequest(chat=specpool_pb2.Chat()), "chat has no messages"),
    (specpool_pb2.GenerateRequest(chat=specpool_pb2.Chat(messages=[common_pb2.ChatMessage(content="x")])), "no role"),
])
def test_generate_request_errors(msg, message):
    with pytest.raises(InvalidArgument, match=message):
        api.spec_from_proto(msg)


def test_stats_and_finish_reasons():
    stats = api.Stats(3, 10, 20, 10 / 3, {"ngram": 2, "code": 1}, 12, 7, 1.5, 0.2, 1.1, 0.15, 0.9)
    assert api.stats_from_proto(api.stats_to_proto(stats)) == stats
    for name in ("stop", "length", "cancelled"):
        assert api.finish_reason_name(api.finish_reason_to_proto(name)) == name
    assert api.finish_reason_name(0) == "unspecified"


# -- metrics -----------------------------------------------------------------------------------------------------
def test_round_observations():
    from specpool.router.loop import RoundRecord
    from specpool.services.metrics import round_observations

    record = RoundRecord("code", 4, 3, 2, 3, 0.8, 0.01, 0.1, 0.12)
    obs = round_observations(record)
    assert obs["counters"] == {"specpool_rounds": 1, "specpool_draft_tokens": 3, "specpool_accepted_tokens": 2,
                               "specpool_emitted_tokens": 3}
    assert obs["histograms"]["specpool_block_divergence"] == pytest.approx(0.8 * 3 / 4)  # over the k asked for
    assert obs["seconds"]["router"] == pytest.approx(0.01)
    plain = round_observations(RoundRecord(None, 0, 0, 0, 1, None, 0.0, 0.1, 0.1))
    assert plain["drafter"] == "none" and "specpool_block_divergence" not in plain["histograms"]


# -- benchmark aggregation -----------------------------------------------------------------------------------------
def test_bench_served_aggregation():
    from bench.served import StreamTiming, latency_summary, markdown_report, parse_levels, percentile, single_session_summary

    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile(list(range(101)), 99) == 99
    timing = StreamTiming([(0.5, 2), (0.6, 0), (0.9, 4)], 0.9)
    assert timing.ttft() == 0.5 and timing.tokens == 6
    assert timing.inter_token() == pytest.approx([0.1] * 4)
    lat = latency_summary([timing])
    assert lat["ttft_p50_s"] == 0.5 and lat["itl_p99_s"] == pytest.approx(0.1)
    records = [{"served_tokens": 10, "served_s": 2.0, "served_tps": 5.0, "embedded_tokens": 10, "embedded_s": 1.0,
                "embedded_tps": 10.0, "identical": True}]
    single = single_session_summary(records)
    assert single["ratio_pooled"] == 0.5 and single["identical_outputs"] == 1
    result = {"command": "specpool bench-served", "machine": {"cpu": "x", "cores": 2}, "single_session": single,
              "config": {"target": "t", "pool": ["ngram"], "policy": "p", "k": 5, "max_new_tokens": 8, "prompts_file": "f",
                         "limit_per_category": 1, "max_batch_size": 8},
              "concurrency": [{"sessions": 1, "requests": 1, "tokens": 6, "wall_s": 1.0, "tokens_per_s": 6.0, "latency": lat,
                               "batch_sizes": {"1": 3}}]}
    text = markdown_report(result, "throughput.png")
    assert "served / embedded = 0.500" in text and "| 1 | 1 | 6 |" in text
    assert "Where a round's time goes" not in text  # no split recorded, no table
    assert parse_levels("8,1,4,4") == [1, 4, 8]
    with pytest.raises(InvalidArgument):
        parse_levels("a,b")


def test_bench_served_sampled_says_how_it_sampled():
    """--temperature: the report names the temperature and the seed rule, and reads identical
    outputs as same-seed agreement, not as the lossless check; the command line carries the flag."""
    import argparse

    from bench.served import command_line, markdown_report, prompt_seed, single_session_summary

    records = [{"served_tokens": 10, "served_s": 2.0, "served_tps": 5.0, "embedded_tokens": 12, "embedded_s": 2.0,
                "embedded_tps": 6.0, "identical": False}]
    single = single_session_summary(records)
    assert single["identical_outputs"] == 0 and single["ratio_pooled"] == pytest.approx(10 / 12)
    result = {"command": "c", "machine": {}, "single_session": single, "concurrency": [],
              "config": {"target": "t", "pool": ["ngram"], "policy": "p", "k": 5, "max_new_tokens": 8, "prompts_file": "f",
                         "limit_per_category": 1, "max_batch_size": 8, "temperature": 0.7}}
    text = markdown_report(result, None)
    assert "sampled at T = 0.7 (seed = prompt length in characters)" in text
    assert "Identical sampled outputs (same seeds): 0 of 1" in text and "Identical greedy outputs" not in text
    greedy = markdown_report({**result, "single_session": single_session_summary([dict(records[0], identical=True)]),
                              "config": {**result["config"], "temperature": 0.0}}, None)
    assert ", greedy, " in greedy and "Identical greedy outputs: 1 of 1." in greedy
    assert prompt_seed("abc") == 3
    args = argparse.Namespace(prompts="p.jsonl", limit_per_category=1, max_new_tokens=8, pool="ngram", policy="p", k=5,
                              concurrency="1,8", max_batch_size=8, out="o", requests_per_level=0, host_heads=None,
                              load_gate=None, temperature=0.7)
    assert command_line(args).endswith("--temperature 0.7")
    assert "--temperature" not in command_line(argparse.Namespace(**{**vars(args), "temperature": 0.0}))


def test_bench_served_time_split():
    from bench.served import markdown_report, single_session_summary, split_per_round, time_split

    # 4 rounds in 1.0 s at the client, 0.9 s in the loop: 0.2 drafting (0.15 forward), 0.6 verifying (0.5 forward).
    split = time_split(rounds=4, wall_s=1.0, loop_s=0.9, draft_s=0.2, draft_forward_s=0.15, verify_s=0.6, verify_forward_s=0.5)
    assert split["draft_reach_s"] == pytest.approx(0.05) and split["verify_reach_s"] == pytest.approx(0.1)
    assert split["loop_other_s"] == pytest.approx(0.1) and split["outside_loop_s"] == pytest.approx(0.1)
    parts = ("draft_forward_s", "draft_reach_s", "verify_forward_s", "verify_reach_s", "loop_other_s", "outside_loop_s")
    assert sum(split[p] for p in parts) == pytest.approx(split["wall_s"])  # the parts add up to the whole
    # A forward timed longer than its call (clock granularity) never gives a negative part.
    assert time_split(rounds=1, wall_s=1, loop_s=1, draft_s=0.1, draft_forward_s=0.2, verify_s=0, verify_forward_s=0)["draft_reach_s"] == 0
    # A head the target hosts drafts inside the verify call: its forward is taken out of reaching the target.
    hosted = time_split(rounds=4, wall_s=1.0, loop_s=0.9, draft_s=0.001, draft_forward_s=0.1, verify_s=0.8, verify_forward_s=0.6)
    assert hosted["verify_reach_s"] == pytest.approx(0.101) and hosted["draft_reach_s"] == 0
    assert sum(hosted[p] for p in parts) == pytest.approx(hosted["wall_s"])
    other = time_split(rounds=6, wall_s=2.0, loop_s=2.0, draft_s=0.0, draft_forward_s=0.0, verify_s=1.0, verify_forward_s=1.0)
    pooled = split_per_round([split, other])
    assert pooled["rounds"] == 10 and pooled["total_s"] == pytest.approx(0.3)
    assert pooled["verify_forward_s"] == pytest.approx(0.15) and pooled["loop_other_s"] == pytest.approx(0.11)
    assert split_per_round([]) is None
    records = [{"served_tokens": 8, "served_s": 1.0, "served_tps": 8.0, "embedded_tokens": 8, "embedded_s": 0.8,
                "embedded_tps": 10.0, "identical": True, "served_split": split, "embedded_split": other}]
    single = single_session_summary(records)
    assert single["ms_per_round"]["served"]["total_s"] == pytest.approx(0.25)
    result = {"command": "c", "machine": {}, "single_session": single, "concurrency": [],
              "config": {"target": "t", "pool": ["ngram"], "policy": "p", "k": 5, "max_new_tokens": 8, "prompts_file": "f",
                         "limit_per_category": 1, "max_batch_size": 8}}
    text = markdown_report(result, None)
    assert "| served | 4 | 37.5 | 12.5 | 125.0 | 25.0 | 25.0 | 25.0 | 250.0 |" in text
    assert "| embedded | 6 | 0.0 | 0.0 | 166.7 | 0.0 | 166.7 | 0.0 | 333.3 |" in text


# -- the CLI, before anything starts -----------------------------------------------------------------------------
def test_serve_fails_fast_on_unreachable_redis(cli):
    code, out, err = cli("serve", "--pool", "ngram", "--redis-url", "redis://127.0.0.1:1/0", target=None)
    assert_one_line_error(code, err, "cannot reach Redis at redis://127.0.0.1:1/0", "redis-server")


def test_serve_print_config(cli):
    code, out, err = cli("serve", "--pool", "ngram,code", "--port", "50999", "--print-config", target=None)
    import yaml

    assert code == 0, err
    config = yaml.safe_load(out)
    assert config["grpc_options"]["port"] == 50999
    assert [a["name"] for a in config["applications"]] == ["router", "target", "drafter-ngram", "drafter-code"]


def test_serve_without_pool_serves_the_default_pool(cli):
    """No --pool: a drafter application per arm of the default pool (the white-box heads behind
    lookup and ngram, for the default target), the router's pool exactly those, and its default
    policy the default drafter fixed (engine.default_policy)."""
    from specpool.core.defaults import DEFAULT_DRAFTER
    from specpool.services.engine import default_pool
    from specpool.services.serve_config import drafter_app_name
    import yaml

    code, out, err = cli("serve", "--print-config", target=None)
    assert code == 0, err
    apps = {a["name"]: a for a in yaml.safe_load(out)["applications"]}
    pool = default_pool()
    # The heads hosted by the target (serve_config.DEFAULT_HOST_WHITE_BOX), the rest an application each.
    hosted = [name for name in pool if serve_config.DEFAULT_HOST_WHITE_BOX and serve_config.is_white_box_spec(name)]
    assert apps["router"]["args"]["drafter_apps"] == {name: "target" if name in hosted else drafter_app_name(name) for name in pool}
    assert apps["target"]["args"].get("hosted_drafters", []) == hosted
    assert [apps[drafter_app_name(name)]["args"]["name"] for name in pool if name not in hosted] == [n for n in pool if n not in hosted]
    assert "ngram" in pool and "ngram" not in hosted
    assert pool[0] == DEFAULT_DRAFTER == "lookup:eagle-alt-int8:general"
    # A request that names no policy gets the fastest measured configuration; the pool is there for
    # a request that names one. Over a pool given on the command line: the bandit.
    assert apps["router"]["args"]["policy"] == f"fixed:{DEFAULT_DRAFTER}"
    code, out, err = cli("serve", "--print-config", "--pool", "lookup:eagle:code,ngram", target=None)
    assert code == 0, err
    (router,) = [a for a in yaml.safe_load(out)["applications"] if a["name"] == "router"]
    assert router["args"]["policy"] == "metasd-ucb+warm"
    code, out, err = cli("serve", "--print-config", "--policy", "thompson", target=None)
    assert code == 0, err
    (router,) = [a for a in yaml.safe_load(out)["applications"] if a["name"] == "router"]
    assert router["args"]["policy"] == "thompson"


@pytest.mark.parametrize("args,fragment", [
    (["serve", "--pool", "ngram,bogus"], "unknown drafter 'bogus'"),
    (["serve", "--config", "/no/such/file.yaml"], "does not exist"),
    (["serve", "--config", str(REPO / "k8s" / "rayservice.yaml"), "--pool", "ngram"], "--pool is for the default config"),
    (["serve", "--config", str(REPO / "k8s" / "rayservice.yaml"), "--feature-dtype", "bfloat16"],
     "--feature-dtype is for the default config"),
    (["client", "generate", "  "], "the prompt is empty"),
    (["client", "generate", "x", "--address", "nowhere"], "--address must be HOST:PORT"),
    (["client", "generate", "x", "-k", "40"], "-k must be in 1..32"),
])
def test_served_commands_reject_bad_input(cli, args, fragment):
    code, out, err = cli(*args, target=None)
    assert_one_line_error(code, err, fragment)


def test_client_without_a_server_is_one_line_and_exit_1(cli):
    code, out, err = cli("client", "generate", "hi", "--address", "127.0.0.1:1", "--timeout", "5", target=None)
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specpool: error: UNAVAILABLE: cannot reach the specpool server at 127.0.0.1:1")


def test_client_errors_map_to_domain_classes():
    from specpool.services.client import RemoteError, error_from_rpc

    class Rpc(grpc.RpcError):
        def __init__(self, code, details):
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self):
            return self._details

    assert isinstance(error_from_rpc(Rpc(grpc.StatusCode.INVALID_ARGUMENT, "bad"), "a:1"), InvalidArgument)
    assert isinstance(error_from_rpc(Rpc(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "a:1"), DeadlineExceeded)
    other = error_from_rpc(Rpc(grpc.StatusCode.INTERNAL, "boom"), "a:1")
    assert isinstance(other, RemoteError) and other.code == "INTERNAL" and str(other) == "boom"
    # Serve's proxy words a replica that died under the request as INTERNAL (the router killed mid-stream:
    # tests/integration/test_served_faults.py); the client says what it is, a retryable UNAVAILABLE.
    died = error_from_rpc(Rpc(grpc.StatusCode.INTERNAL, "The actor died unexpectedly before finishing this task.\n"
                                                        "\tclass_name: ServeReplica:router:Router"), "a:1")
    assert isinstance(died, RemoteError) and died.code == "UNAVAILABLE" and "retry" in str(died)
    assert "\n" not in str(died) and "died unexpectedly" in str(died)
    assert json.dumps(api.Stats().as_dict())  # JSON-ready for --json


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_ray_daemons_are_lowered_to_the_given_niceness_and_nothing_else_is():
    import os
    import subprocess
    import sys
    import time

    from specpool.services.local_serve import _children, _descendants, lower_daemon_priority

    # The scene is built under a root process of the test's own and searched from there: the pytest
    # process may hold other children (a Ray cluster another test left behind), not this test's business.
    # Under the root: a daemon, a replica and a daemon one level further down (Ray's agents are the
    # raylet's children). The markers are joined at run time, so no parent's own command line holds them.
    spawn_scene = (
        "import subprocess, sys, time\n"
        "def sleeper(*extra): return subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', *extra])\n"
        "grandparent = ('import subprocess, sys, time; subprocess.Popen([sys.executable, \"-c\", '\n"
        "               '\"import time; time.sleep(60)\", \"ray::\" + \"DashboardAgent\"]); time.sleep(60)')\n"
        "kids = [sleeper('ray::' + 'ServeController'), sleeper('ray::' + 'ServeReplica:target:Target'),\n"
        "        subprocess.Popen([sys.executable, '-c', grandparent, 'raylet/' + 'raylet'])]\n"
        "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
        "time.sleep(60)\n")
    root = subprocess.Popen([sys.executable, "-c", spawn_scene], stdout=subprocess.PIPE, text=True)
    try:
        controller, replica, raylet = (int(pid) for pid in root.stdout.readline().split())
        deadline = time.monotonic() + 20
        grandchild = None
        while grandchild is None and time.monotonic() < deadline:
            found = _children().get(raylet, [])
            grandchild = found[0] if found else None
            time.sleep(0.05)
        assert grandchild is not None
        base = os.getpriority(os.PRIO_PROCESS, 0)
        level = min(19, base + 7)
        lowered = lower_daemon_priority(level, root=root.pid)
        assert lowered == {controller: "Serve controller", grandchild: "dashboard agent"}
        assert os.getpriority(os.PRIO_PROCESS, controller) == level
        assert os.getpriority(os.PRIO_PROCESS, grandchild) == level
        assert os.getpriority(os.PRIO_PROCESS, replica) == base  # a replica keeps its priority
        assert os.getpriority(os.PRIO_PROCESS, raylet) == base  # and so does the raylet
        assert os.getpriority(os.PRIO_PROCESS, root.pid) == base  # and the root
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # and the caller
        assert lower_daemon_priority(base, root=root.pid) == lowered  # never raises a priority back
        assert os.getpriority(os.PRIO_PROCESS, controller) == level
    finally:
        for pid in [*_descendants(root.pid), root.pid]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        root.wait(10)


def test_a_port_is_taken_while_something_listens_not_while_old_connections_linger():
    import socket

    from specpool.services.local_serve import check_port_free

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    with pytest.raises(InvalidArgument, match=f"port {port} .* already in use"):
        check_port_free(port, "gRPC")
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    client.close()
    server.close()
    check_port_free(port, "gRPC")  # a restarted server may bind it again


def test_router_args_check_the_quota_file_against_the_key_files_tenants(tmp_path):
    from specpool.core.errors import InvalidArgument
    from specpool.services.auth import add_key

    keys = tmp_path / "keys.yaml"
    add_key(keys, "acme")
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text("default: {max_concurrent: 4}\ntenants: {acme: {max_concurrent: 8}, acne: {max_concurrent: 1}}\n")
    base = {"drafter_apps": {"code": "d"}, "api_keys_file": str(keys)}
    with pytest.raises(InvalidArgument) as info:
        RouterArgs.parse({**base, "quotas_file": str(quotas)})
    assert str(info.value) == f"unknown tenant 'acne' in {quotas} (the key file has: acme)"
    quotas.write_text("tenants: {acme: {max_concurrent: 8}}\n")
    parsed = RouterArgs.parse({**base, "quotas_file": str(quotas), "max_queued_requests": 32})
    assert parsed.quotas_file == str(quotas) and parsed.max_queued_requests == 32
    assert RouterArgs.parse({"drafter_apps": {"code": "d"}}).quotas_file is None


def test_a_replicas_session_bookkeeping_is_bounded():
    from specpool.services.serve_app import _RecentSessions

    recent = _RecentSessions(limit=3)
    for i in range(5):
        recent.add(f"s{i}")
    recent.add("s2")  # used again: most recent
    recent.update(["s7"])
    assert sorted(recent) == ["s2", "s4", "s7"] and len(recent) == 3
    recent.discard("s4")
    recent.discard("never")
    assert "s4" not in recent and sorted(recent) == ["s2", "s7"]


def test_the_replicas_read_only_args_their_builders_parse():
    """Every ``args.X`` a replica's constructor (or ``self.args.X`` any method) reads must exist on
    its args class: a missing field only shows when Serve starts the replica."""
    import ast
    import dataclasses
    import inspect

    import specpool.services.serve_app as serve_app
    from specpool.services.serve_config import DrafterArgs, RouterArgs, TargetArgs

    tree = ast.parse(inspect.getsource(serve_app))
    wanted = {"TargetServer": TargetArgs, "DrafterServer": DrafterArgs, "RouterServer": RouterArgs}
    checked = 0
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in wanted):
        known = set(dir(wanted[cls.name])) | {f.name for f in dataclasses.fields(wanted[cls.name])}
        for method in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(method):
                if not isinstance(node, ast.Attribute):
                    continue
                value = node.value
                self_args = (isinstance(value, ast.Attribute) and value.attr == "args"
                             and isinstance(value.value, ast.Name) and value.value.id == "self")
                init_args = method.name == "__init__" and isinstance(value, ast.Name) and value.id == "args"
                if self_args or init_args:
                    checked += 1
                    assert node.attr in known, f"{cls.name}.{method.name} reads args.{node.attr}, which {wanted[cls.name].__name__} lacks"
    assert checked > 20


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_a_ray_start_that_times_out_is_torn_down_and_tried_once_more(monkeypatch):
    """Injected fault: ``ray.init`` starts processes, then raises as Ray does when its raylet does not
    register in time. What it left is killed before the second try; the second try's cluster stays."""
    import subprocess
    import sys

    import ray

    from specpool.services.local_serve import init_ray

    started: list[subprocess.Popen] = []
    failures = ["The current node timed out during startup. This could happen because some of the raylet "
                "failed to startup or the GCS has become overloaded."]

    def flaky_init(**kwargs):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        if failures:
            raise Exception(failures.pop())

    monkeypatch.setattr(ray, "init", flaky_init)
    messages: list[str] = []
    try:
        init_ray({"address": "local"}, messages.append, pauses_s=(0.0,))
        assert len(started) == 2
        assert started[0].wait(10) == -9  # the failed start's process: killed
        assert started[1].poll() is None  # the good start's process: running
        assert len(messages) == 1 and "timed out during startup" in messages[0] and "start 2 of 3" in messages[0]
    finally:
        for process in started:
            process.kill()
            process.wait(10)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_a_ray_start_that_keeps_failing_is_one_line_and_leaves_nothing(monkeypatch, tmp_path):
    import subprocess
    import sys

    import ray

    from specpool.services.local_serve import init_ray

    started: list[subprocess.Popen] = []

    def failing_init(**kwargs):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", failing_init)
    # What the raylet logged is named in the error (a glog error line; info lines are passed over).
    logs = tmp_path / "ray" / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text(
        "[2026-12-06 19:50:36,874 E 6871 6898] (raylet) agent_manager.cc:83: Agent process exited, exit code 1.\n"
        "[2026-12-06 19:50:36,877 I 6871 6871] (raylet) stats.h:176: Stats module has shutdown.\n")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    pauses: list[float] = []
    try:
        with pytest.raises(ModelUnavailable) as caught, monkeypatch.context() as patched:
            patched.setattr("specpool.services.local_serve.time.sleep", pauses.append)
            init_ray({"address": "local"})
        assert len(started) == 3 and all(p.wait(10) == -9 for p in started)
        assert pauses == [5.0, 15.0]  # the machine is given time to settle between starts
        message = str(caught.value)
        assert "\n" not in message and message.startswith("Ray did not start: The current node")
        assert "Last error Ray logged: (raylet) agent_manager.cc:83: Agent process exited, exit code 1." in message
        assert message.endswith(f"(logs under {logs})")
        started.clear()
        (logs / "raylet.out").unlink()  # no log: the error is Ray's alone
        with pytest.raises(ModelUnavailable) as caught:
            init_ray({"address": "local"}, attempts=2, pauses_s=())
        assert len(started) == 2 and "Last error" not in str(caught.value)
        started.clear()
        with pytest.raises(ModelUnavailable):  # a cluster given by address is not started twice
            init_ray({"address": "ray://elsewhere:10001"}, attempts=1)
        assert len(started) == 1 and started[0].wait(10) == -9
    finally:
        for process in started:
            process.kill()
            process.wait(10)
