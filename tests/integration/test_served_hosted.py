"""Integration: white-box heads hosted by the target deployment (specpool/router/hosted.py), served for
real: Ray Serve on a local Ray cluster, the real default target, Redis at 127.0.0.1:6379, gRPC on
loopback; no mocks. The config is the one ``specpool serve --pool eagle:general,lookup:eagle:code,ngram
--host-heads`` runs: the target application hosts both shipped heads and drafts with them inside its
verify call (both read every round's features there); only ngram has a drafter application.

Every served answer equals the embedded engine's (the same pool drafting in process): greedy, sampled
with a seed, under a bandit beside a router-side arm, in concurrent batched sessions, and after the
head lost the session's earlier features. No feature crosses the wire."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.integration

from redis_helpers import URL, connect_or_skip, delete_namespace
from serve_helpers import call as _call, free_port as _free_port, generate_concurrently
from test_served_white_box import PROMPTS, client  # noqa: F401 - the client fixture, over this module's server

MAX_NEW = 24
K = 5


@pytest.fixture(scope="module")
def served():
    raw = connect_or_skip(decode_responses=True)
    from specpool.cli.main import build_parser
    from specpool.cli.served import serve_config_from_args
    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import plan_from_config

    pool = ["eagle:general", "lookup:eagle:code", "ngram"]
    config, _ = serve_config_from_args(build_parser().parse_args(["serve", "--pool", ",".join(pool), "--host-heads",
                                                                  "--port", str(_free_port())]))
    assert [a["name"] for a in config["applications"]] == ["router", "target", "drafter-ngram"]
    assert next(a for a in config["applications"] if a["name"] == "target")["args"]["hosted_drafters"] == pool[:2]
    namespace = f"specpool-hosted-{uuid.uuid4().hex[:8]}"
    router = next(a for a in config["applications"] if a["name"] == "router")
    router["args"].update(redis_url=URL, redis_namespace=namespace, k=K)
    local = start_local(plan_from_config(config, "the test config"), metrics_port=None,
                        progress=lambda m: print(f"[served] {m}", flush=True))
    from ray import serve

    yield SimpleNamespace(address=local.address, pool=pool, eagle=pool[0],
                          router=serve.get_deployment_handle("Router", app_name="router"),
                          target=serve.get_deployment_handle("Target", app_name="target"))
    local.shutdown()
    delete_namespace(raw, namespace)
    raw.close()


@pytest.fixture(scope="module")
def embedded(served):
    """The embedded engine's answers over the same pool (cached by prompt and settings)."""
    from specpool.services.config import settings_from_env
    from specpool.services.engine import EmbeddedEngine
    from specpool.target.sampling import SamplingParams

    engine = EmbeddedEngine.default(settings_from_env().home)
    cache: dict = {}

    def answer(prompt: str, policy: str, temperature: float = 0.0, seed: int = 0) -> list[int]:
        key = (prompt, policy, temperature, seed)
        if key not in cache:
            params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=MAX_NEW,
                                    stop_token_ids=engine.stop_token_ids())
            cache[key] = engine.generate(engine.encode_prompt(prompt), params, k=K, session_id=uuid.uuid4().hex,
                                         policy=policy, pool=served.pool).token_ids
        return cache[key]

    return answer


def test_a_hosted_head_drafts_inside_the_verify_call_and_answers_as_embedded(served, client, embedded):
    policy = f"fixed:{served.eagle}"
    before = _call(served.router, "FeatureStats")["received"]
    answer = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, session_id=uuid.uuid4().hex, policy=policy)
    assert answer.token_ids == embedded(PROMPTS[0], policy)
    stats = answer.stats
    assert stats.rounds_by_drafter.get(served.eagle, 0) == stats.rounds - 1  # the first round is the prefill
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0
    after = _call(served.router, "FeatureStats")["received"]
    assert after == before  # the target fed its hosted head in process: nothing on the wire
    assert _call(served.target, "Stats")["hosted_draft_failures"] == 0


@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[2]])
def test_a_hosted_head_and_a_router_side_arm_under_the_bandit_answer_as_embedded(served, client, embedded, prompt):
    answer = client.generate(prompt, max_new_tokens=MAX_NEW, session_id=uuid.uuid4().hex, policy="metasd-ucb")
    assert answer.token_ids == embedded(prompt, "metasd-ucb")
    assert set(answer.stats.rounds_by_drafter) <= {*served.pool, "none"}


def test_sampled_rounds_drafted_by_the_target_draw_what_embedded_draws(served, client, embedded):
    """Temperature 0.7 with a seed: every draw is seeded by its position, so the hosted head's drafts,
    the acceptance and the recovered tokens equal the embedded engine's, token for token."""
    policy = f"fixed:{served.eagle}"
    for seed in (3, 4):
        answer = client.generate(PROMPTS[1], max_new_tokens=MAX_NEW, temperature=0.7, seed=seed,
                                 session_id=uuid.uuid4().hex, policy=policy)
        assert answer.token_ids == embedded(PROMPTS[1], policy, 0.7, seed), seed


def test_concurrent_sessions_batch_their_hosted_rounds(served, client, embedded):
    policy = f"fixed:{served.eagle}"
    before = _call(served.target, "Stats")["batch_sizes"]
    results = generate_concurrently(client, PROMPTS, max_new_tokens=MAX_NEW, policy=policy)
    assert results == {p: embedded(p, policy) for p in PROMPTS}
    after = _call(served.target, "Stats")["batch_sizes"]
    assert sum(count - before.get(size, 0) for size, count in after.items() if size > 1) > 0, after


def test_a_hosted_head_without_the_sessions_earlier_features_gets_them_again(served, client, embedded):
    """The session's first request runs ngram alone: the target caches the context, the head sees
    none of it. Its next request drafts with the head: the target re-verifies that round from scratch
    so the head gets every row (as the loop does in process), and the answer is the target's own."""
    session = uuid.uuid4().hex
    first = client.generate(PROMPTS[2], max_new_tokens=MAX_NEW, session_id=session, policy="fixed:ngram")
    assert first.token_ids == embedded(PROMPTS[2], "fixed:ngram")
    second = client.generate(PROMPTS[2], max_new_tokens=MAX_NEW, session_id=session, policy=f"fixed:{served.eagle}")
    assert second.token_ids == embedded(PROMPTS[2], f"fixed:{served.eagle}")
    assert second.stats.draft_tokens > 0
