"""Integration: a white-box (EAGLE-style) drafter served for real. Ray Serve on a local Ray cluster,
the real default target, a drafter deployment hosting ``eagle:HEAD`` next to ``ngram``, Redis at
127.0.0.1:6379, gRPC on loopback; no mocks. The config is the one ``specpool serve --pool
eagle:HEAD,ngram,eagle-tree:HEAD --no-host-heads`` runs. The head is built here (the target's own embedding and last layer,
untrained: what it guesses does not matter, only that it drafts from the target's features), so the
test needs nothing outside git but the cached target.

Every served answer equals the embedded engine's greedy answer (the target's own tokens); the
feature traffic is measured: the target sends (a + 1) x 576 x 2 bytes a round, each position once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from specpool.core.defaults import DEFAULT_POLICY, DEFAULT_TARGET

pytestmark = pytest.mark.integration

from redis_helpers import URL, connect_or_skip, delete_namespace
from serve_helpers import free_port as _free_port, call as _call, feedback_records, generate_concurrently, wait_until as _wait

MAX_NEW = 24
TREES = "trees"  # a tenant opted out of feedback: its greedy rounds may draft trees
K = 5
WIDTH = 576  # the default target's hidden size
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: Where is the train station?",
    # Copy-heavy: the n-gram arm has drafts accepted, so rounds carry a + 1 > 1 rows.
    "Repeat this line three times: the quick brown fox jumps over the lazy dog.",
]


def make_head(folder: Path, home: Path) -> Path:
    """An untrained head for the real target, exported as ``specpool zoo train --arch eagle`` does."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from specpool.drafters.eagle import HEAD_KIND, target_card
    from specpool.drafters.eagle_model import EagleConfig, EagleHead, init_from_target
    from specpool.learning.zoo_train import export_drafter
    from specpool.target.models import resolve_model, tokenizer_fingerprint

    target_dir = Path(resolve_model(DEFAULT_TARGET, home))
    target = AutoConfig.from_pretrained(target_dir)
    state = load_file(str(target_dir / "model.safetensors"))
    config = EagleConfig(hidden_size=target.hidden_size, num_heads=target.num_attention_heads,
                         num_kv_heads=target.num_key_value_heads, intermediate_size=target.intermediate_size,
                         reduced_vocab=8192, rms_eps=float(target.rms_norm_eps),
                         max_positions=int(target.max_position_embeddings))
    head = EagleHead(config, state["model.embed_tokens.weight"].float(), torch.arange(config.reduced_vocab))
    init_from_target(head, {k: v.float() for k, v in state.items()}, target.num_hidden_layers - 1)
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(target_dir))
    metadata = {"name": folder.name, "kind": HEAD_KIND, "target": DEFAULT_TARGET, "target_tokenizer_fingerprint": fingerprint,
                "target_card": target_card(target_dir), "model": config.to_dict()}
    export_drafter(head, folder, metadata, "# test head (untrained)\n")
    return folder


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    from specpool.services.config import settings_from_env

    return make_head(tmp_path_factory.mktemp("heads") / "t1", settings_from_env().home)


@pytest.fixture(scope="module")
def served(head, tmp_path_factory):
    raw = connect_or_skip(decode_responses=True)
    from specpool.cli.main import build_parser
    from specpool.cli.served import serve_config_from_args
    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import drafter_app_name, plan_from_config

    # The same head drafting trees too (eagle-tree): for tenant TREES, whose rounds carry no
    # feedback (a round with feedback drafts chains).
    pool = [f"eagle:{head}", "ngram", f"eagle-tree:{head}"]
    port = _free_port()
    # What `specpool serve --pool eagle:HEAD,ngram --no-host-heads --port PORT` runs: a drafter deployment
    # per head, fed the target's features over the wire (tests/integration/test_served_hosted.py: hosted).
    config, _ = serve_config_from_args(build_parser().parse_args(["serve", "--pool", ",".join(pool), "--no-host-heads",
                                                                  "--port", str(port)]))
    namespace = f"specpool-wb-{uuid.uuid4().hex[:8]}"
    router = next(a for a in config["applications"] if a["name"] == "router")
    router["args"].update(redis_url=URL, redis_namespace=namespace, k=K)
    # Online learning on (so every test here also shows feedback changes no answer): the head's
    # deployment drafts each tenant's request with what `specpool learner` publishes to the store.
    router["args"].update(feedback=True, feedback_stream=f"{namespace}:feedback", feedback_opt_out=[TREES])
    store = tmp_path_factory.mktemp("online-store")
    eagle_app = next(a for a in config["applications"] if a["name"] == drafter_app_name(pool[0]))
    eagle_app["args"].update(model_store=str(store), refresh_s=0.0)
    local = start_local(plan_from_config(config, "the test config"), metrics_port=None,
                        progress=lambda m: print(f"[served] {m}", flush=True))
    from ray import serve

    yield SimpleNamespace(
        address=local.address, pool=pool, eagle=pool[0], tree=pool[2], namespace=namespace, store=store,
        router=serve.get_deployment_handle("Router", app_name="router"),
        target=serve.get_deployment_handle("Target", app_name="target"),
        drafter=serve.get_deployment_handle("Drafter", app_name=drafter_app_name(pool[0])),
    )
    local.shutdown()
    delete_namespace(raw, namespace)
    raw.close()


@pytest.fixture(scope="module")
def client(served):
    from specpool.services.client import SpecPoolClient

    with SpecPoolClient(served.address) as c:
        yield c


@pytest.fixture(scope="module")
def reference(head):
    """The embedded engine's greedy answer, with the same white-box pool (cached)."""
    from specpool.services.config import settings_from_env
    from specpool.services.engine import EmbeddedEngine
    from specpool.target.sampling import SamplingParams

    engine = EmbeddedEngine.default(settings_from_env().home)
    cache: dict[str, list[int]] = {}

    def answer(prompt: str) -> list[int]:
        if prompt not in cache:
            params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=engine.stop_token_ids())
            cache[prompt] = engine.generate(engine.encode_prompt(prompt), params, k=K, session_id=uuid.uuid4().hex,
                                            policy="metasd-ucb", pool=[f"eagle:{head}", "ngram"]).token_ids
        return cache[prompt]

    return answer


@pytest.mark.parametrize("prompt, policy", [(PROMPTS[0], "fixed:eagle"), (PROMPTS[2], "")])
def test_served_white_box_greedy_equals_embedded_and_features_cost_a_plus_1_rows_a_round(served, client, reference,
                                                                                          prompt, policy):
    """``fixed:eagle``: the head drafts every round; "": the server's default policy (DEFAULT_POLICY) over its pool."""
    policy = policy.replace("eagle", served.eagle)
    before = _call(served.router, "FeatureStats")
    answer = client.generate(prompt, max_new_tokens=MAX_NEW, session_id=uuid.uuid4().hex, policy=policy)
    after = _call(served.router, "FeatureStats")
    assert answer.token_ids == reference(prompt)
    stats = answer.stats
    received = {key: after["received"][key] - before["received"][key] for key in ("calls", "rows", "bytes")}
    sent = after["sent"][served.eagle]["bytes"] - before["sent"].get(served.eagle, {}).get("bytes", 0)
    # Every verify returned features: the prompt's rows on the prefill round (which drafts
    # nothing), then accepted + 1 a round (the positions the target's cache gained), 2 bytes a value.
    assert received["calls"] == stats.rounds
    assert received["rows"] == stats.prompt_tokens + (stats.rounds - 1) + stats.accepted_tokens
    assert received["bytes"] == received["rows"] * WIDTH * 2
    drafted_rounds = stats.rounds - 1
    per_round = (received["bytes"] - stats.prompt_tokens * WIDTH * 2) / drafted_rounds
    mean_a = stats.accepted_tokens / drafted_rounds
    print(f"\n[white-box served] {prompt[:30]!r} ({policy or DEFAULT_POLICY}): {stats.rounds} rounds "
          f"{dict(stats.rounds_by_drafter)}, mean accepted {mean_a:.2f}; target -> router {per_round:.0f} bytes a round "
          f"after the prefill = (a+1) x {WIDTH} x 2; router -> eagle deployment {sent} bytes in all")
    assert per_round == pytest.approx((mean_a + 1) * WIDTH * 2)
    # The drafter deployment is sent each row at most once (those before the rounds it drafted).
    assert sent <= received["bytes"]
    if policy:
        assert 0 < sent and stats.draft_tokens > 0
    else:
        assert stats.accepted_tokens > 0  # rounds of a + 1 > 1 rows


def test_served_draft_trees_are_verified_by_the_target_deployment(served, client, reference):
    """``eagle-tree``: the drafter deployment proposes trees (16 nodes, more than k = 5 drafts a round
    could be as a chain), the target deployment verifies them, and the answer is the target's own.
    With feedback (the default tenant here) the same arm drafts chains."""
    tree = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, session_id=uuid.uuid4().hex, tenant=TREES,
                           policy=f"fixed:{served.tree}")
    assert tree.token_ids == reference(PROMPTS[0])
    drafted = tree.stats.rounds - 1  # the white-box prefill round drafts nothing
    assert tree.stats.draft_tokens > K * drafted  # trees: no chain of k = 5 is that long
    chain = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, session_id=uuid.uuid4().hex, policy=f"fixed:{served.tree}")
    assert chain.token_ids == reference(PROMPTS[0])
    assert 0 < chain.stats.draft_tokens <= K * (chain.stats.rounds - 1)


def test_a_drafter_replica_that_lost_the_sessions_features_gets_them_again(served, client, reference):
    session = f"lost-{uuid.uuid4().hex[:8]}"
    from specpool.v1 import common_pb2

    first = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, session_id=session, policy=f"fixed:{served.eagle}")
    assert first.token_ids == reference(PROMPTS[0])
    # The replica forgets the session (as a restart or an eviction would); the router does not know.
    # (model servers know the session as tenant/session: Orchestrator.cache_id)
    assert _call(served.drafter, "Release", common_pb2.ReleaseRequest(session_id=f"default/{session}")).released
    resends = _call(served.router, "FeatureStats")["resends"][served.eagle]
    second = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, session_id=session, policy=f"fixed:{served.eagle}")
    assert second.token_ids == reference(PROMPTS[0])
    assert _call(served.router, "FeatureStats")["resends"][served.eagle] == resends + 1  # resent from 0, once
    assert second.stats.draft_tokens > 0  # and the head drafted again with them


def test_concurrent_sessions_batch_their_verifies_with_features(served, client, reference):
    before = _call(served.target, "Stats")["batch_sizes"]
    results = generate_concurrently(client, PROMPTS, max_new_tokens=MAX_NEW)
    assert results == {p: reference(p) for p in PROMPTS}
    after = _call(served.target, "Stats")["batch_sizes"]
    assert sum(count - before.get(size, 0) for size, count in after.items() if size > 1) > 0, after


def test_cli_client_generate_against_a_white_box_pool(served, reference):
    proc = subprocess.run(
        [sys.executable, "-m", "specpool.cli.main", "client", "generate", PROMPTS[1], "--address", served.address,
         "--max-new-tokens", str(MAX_NEW), "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == reference(PROMPTS[1])


def test_served_online_learning_of_a_head(served, client, reference):
    """The online learner over a served white-box head, end to end: every round the head drafts
    reaches the Redis stream with the target's features it read; `specpool learner` trains the
    tenant's variant of the head and publishes it; the head's deployment drafts that tenant's next
    request with the new version (one version for the whole request); answers stay the target's own."""
    from specpool.cli.main import main
    from specpool.learning.model_store import DirectoryModelStore, VariantKey

    raw = connect_or_skip(decode_responses=True)
    stream = f"{served.namespace}:feedback"
    tenant = f"learn-{uuid.uuid4().hex[:6]}"

    def records_of(session: str) -> list:
        return feedback_records(raw, stream, tenant, session)

    def ask(session: str):
        answer = client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, session_id=session, tenant=tenant,
                                 policy=f"fixed:{served.eagle}")
        assert answer.token_ids == reference(PROMPTS[0])  # lossless, whatever the weights
        return answer, _wait(lambda: records_of(session), 30, f"feedback records of {session}")

    answer, records = ask("before")
    assert sum(len(r.draft) for r in records) == answer.stats.draft_tokens > 0  # every drafted round, once
    assert all(r.drafter == served.eagle and r.version == 0 for r in records)
    for r in records:  # the target's features of the round, through its accepted positions
        features = r.features()
        assert features is not None and features.rows.shape[1] == WIDTH
        assert features.start <= r.position and features.start + features.rows.shape[0] == r.position + r.accepted
    assert main(["learner", "--once", "--redis", URL, "--stream", stream, "--drafters", served.eagle,
                 "--store", str(served.store), "--publish-every", "4", "--no-progress"]) == 0
    serving = DirectoryModelStore(served.store).serving(VariantKey(tenant, served.eagle))
    assert serving is not None and serving >= 1  # learned and published

    _, after = ask("after")
    assert {r.version for r in after} == {serving}  # the new version, for every round of the request
    raw.close()
