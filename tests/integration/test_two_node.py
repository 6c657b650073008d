"""Integration: a two-node Ray cluster on this machine, the drafters on the worker node (issue 27).

The cluster is Ray's own multi-node test harness (``ray.cluster_utils.Cluster``): a head node and
a worker node, each its own raylet with its own resources, the same processes ``ray start --head``
and ``ray start --address`` launch; unlike the CLI it can remove exactly its worker node again,
where ``ray stop`` would stop every Ray cluster on the machine. The head has the CPUs for the
router and the target, which ask for its custom resource ``head_node``; only the worker has the
resource ``drafter_node`` that every drafter replica asks for, so Ray must place the drafters there
and every drafter call crosses nodes.

- The cross-node path answers exactly: greedy output equal to the embedded engine's, with the
  worker's drafter drafting every round.
- The worker node lost mid-stream (its raylet and workers killed): the stream still finishes with
  the embedded engine's tokens (the rounds after the loss run target-only, issue 27 item 4), and
  a new request on the one-node cluster, whose drafters cannot be placed again, is exact too.
"""

from __future__ import annotations

import os
import time
import uuid
from types import SimpleNamespace

import pytest

from serve_helpers import embedded_greedy, free_port as _free_port, wait_until as _wait
from specpool.services.client import SpecPoolClient

pytestmark = pytest.mark.integration

POOL = ["ngram", "code"]
K = 5
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a loop."
MAX_NEW = 48
DRAFTER_RESOURCE = "drafter_node"
HEAD_RESOURCE = "head_node"  # the router and the target ask for it: else Ray may put the target on the worker, leaving the drafters no room


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    from specpool.services.serve_config import SERVE_ENV

    # Read by every Ray process the cluster starts (as start_local sets them for its own cluster).
    os.environ.setdefault("RAY_worker_niceness", "0")
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False,
                                                          "resources": {HEAD_RESOURCE: 2}})
    # The driver joins while the head is the only node: with two raylets on one IP it could
    # otherwise attach to the worker's, and losing that node would take the driver with it.
    import ray

    ray.init(address=nodes.address, log_to_driver=False)  # what Cluster.connect() does, minus the replicas' logs
    worker = nodes.add_node(num_cpus=2, resources={DRAFTER_RESOURCE: len(POOL)})
    nodes.wait_for_nodes()
    yield SimpleNamespace(nodes=nodes, worker=worker)
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    from redis_helpers import URL, connect_or_skip, delete_namespace
    from specpool.services.local_serve import start_local
    from specpool.services.serve_config import default_serve_config, plan_from_config

    raw_redis = connect_or_skip()
    namespace = f"two-node-{uuid.uuid4().hex[:8]}"
    config = default_serve_config(POOL, URL, _free_port(), k=K, cores=2)
    for app in config["applications"]:
        if app["name"] == "router":
            app["args"].update(redis_namespace=namespace, http_api=False)
        if app["name"].startswith("drafter-"):
            app["args"]["ray_actor_options"]["resources"] = {DRAFTER_RESOURCE: 1}
        else:
            app["args"]["ray_actor_options"]["resources"] = {HEAD_RESOURCE: 1}
    local = start_local(plan_from_config(config, "the two-node config"), metrics_port=None,
                        ray_address=cluster.nodes.address, progress=lambda m: print(f"[served] {m}", flush=True))
    yield local
    local.shutdown()
    delete_namespace(raw_redis, namespace)
    raw_redis.close()


@pytest.fixture(scope="module")
def client(served):
    with SpecPoolClient(served.address) as c:
        yield c


@pytest.fixture(scope="module")
def expected():
    return embedded_greedy(PROMPT, MAX_NEW, K, POOL)


def test_drafters_on_the_worker_node_answer_exactly_across_nodes(served, client, expected):
    import ray

    # Every drafter replica holds the worker's resource: they can only run there.
    assert ray.available_resources().get(DRAFTER_RESOURCE, 0) == 0
    answer = client.generate(PROMPT, max_new_tokens=MAX_NEW, session_id=f"cross-{uuid.uuid4().hex[:8]}",
                             policy="fixed:code", timeout=300)
    assert answer.token_ids == expected
    assert answer.stats.draft_tokens > 0 and answer.stats.rounds_by_drafter.get("code", 0) == answer.stats.rounds


def test_losing_the_worker_node_mid_stream_degrades_to_target_only_and_stays_exact(cluster, served, client, expected):
    import ray

    tokens: list[int] = []
    removed_at = None
    stats = None  # the last message's (the stream finished, not broke off)
    for chunk in client.generate_stream(PROMPT, max_new_tokens=MAX_NEW, session_id=f"lose-{uuid.uuid4().hex[:8]}",
                                        policy="fixed:code", timeout=300):
        tokens.extend(chunk.token_ids)
        if removed_at is None and len(tokens) >= 8:
            cluster.nodes.remove_node(cluster.worker, allow_graceful=False)  # raylet and workers killed
            removed_at = len(tokens)
        if chunk.finish_reason:
            stats = chunk.stats
    assert removed_at is not None, "the stream ended before the node was removed"
    assert tokens == expected and stats is not None

    # The drafters cannot be placed again (no node has the resource): the server keeps answering.
    _wait(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 1, 120,
          "the GCS to mark the worker node dead (its health checks must fail first)", interval=1)
    started = time.monotonic()
    again = client.generate(PROMPT, max_new_tokens=MAX_NEW, session_id=f"after-{uuid.uuid4().hex[:8]}",
                            policy="fixed:code", timeout=300)
    assert again.token_ids == expected
    assert again.stats.draft_tokens == 0  # its drafter is gone: every round ran target-only
    assert time.monotonic() - started < 120  # a short drafter deadline and a cooldown, not a 60 s retry per round
