"""Policies in the loop (specpool/router/bandit.py): lossless under every policy, state carried by the
session store, seeds repeat, and the CLI's --policy / --trace / --pool / --store."""

from __future__ import annotations

import json

import pytest

from cli_helpers import assert_one_line_error
from specpool.core.defaults import DEFAULT_POLICY
from specpool.drafters.hf_model import HFModelDrafter
from specpool.drafters.ngram import NGramDrafter
from specpool.router.bandit import BanditChooser
from specpool.router.loop import RoundRecord, speculative_generate
from specpool.router.policies import POLICIES, make_policy
from specpool.router.session_store import InMemorySessionStore, SessionKey
from specpool.target.sampling import SamplingParams

EVERY_POLICY = list(POLICIES) + ["fixed:noisy", "metasd-ucb+warm"]
# The fast lane keeps the default policy, MetaSD's own and ucb-replay (the one that drives the loop's replay
# path); the choice rules themselves are unit-tested in test_policies.py. The full sweep is slow.
FAST_LANE_POLICIES = {DEFAULT_POLICY, "metasd-ucb", "ucb-replay"}
POLICY_CASES = [name if name in FAST_LANE_POLICIES else pytest.param(name, marks=pytest.mark.slow) for name in EVERY_POLICY]


@pytest.fixture(scope="module")
def pool(target_lm, noisy_lm, random_lm):
    return {
        "noisy": HFModelDrafter("noisy", *noisy_lm),
        "random": HFModelDrafter("random", *random_lm),
        "ngram": NGramDrafter(),
    }


def generate(verifier, pool, policy_name, prompt, params, store, key, k=4, trace=False):
    policy = make_policy(policy_name, list(pool))
    chooser = BanditChooser(policy, store, key, seed=params.seed, trace=trace)
    result = speculative_generate(prompt, session_id=f"{key.tenant}/{key.session}", drafters=pool, chooser=chooser,
                                  verifier=verifier, params=params, k=k)
    verifier.release(f"{key.tenant}/{key.session}")
    for d in pool.values():
        d.release(f"{key.tenant}/{key.session}")
    return result, chooser


@pytest.mark.parametrize("policy_name", POLICY_CASES)
def test_greedy_output_is_the_targets_under_every_policy(policy_name, verifier, pool, prompts, target_lm, greedy_reference):
    store = InMemorySessionStore()
    played: set[str] = set()
    for i, prompt in enumerate(prompts[:6]):
        params = SamplingParams(max_new_tokens=20)
        result, _ = generate(verifier, pool, policy_name, prompt, params, store, SessionKey("t", f"s{i}"))
        assert result.token_ids == greedy_reference(target_lm[0], prompt, 20), (policy_name, i)
        played |= {r.drafter for r in result.rounds}
    if not policy_name.startswith("fixed:"):
        assert len(played) >= 2, played  # the policy really switched drafters while staying lossless


def test_state_lives_in_the_store_and_carries_over(verifier, pool, prompts):
    store = InMemorySessionStore()
    key = SessionKey("acme", "chat-1")
    params = SamplingParams(max_new_tokens=16)
    first, _ = generate(verifier, pool, "metasd-ucb", prompts[0], params, store, key)
    state, tenant = store.read(key)
    drafted = [r for r in first.rounds if r.k > 0]
    assert state["t"] == len(drafted)
    assert sum(st["n"] for st in state["arms"].values()) == len(drafted)
    assert sum(st["n"] for st in tenant.values()) == len(drafted)
    # A second request of the same session continues from that state (another router would too).
    generate(verifier, pool, "metasd-ucb", prompts[1], params, store, key)
    assert store.read(key)[0]["t"] > state["t"]
    # Another tenant with the same session id starts from nothing.
    assert store.read(SessionKey("other", "chat-1")) == (None, {})


def test_same_seed_same_choices_and_trace(verifier, pool, prompts):
    runs = []
    for _ in range(2):
        params = SamplingParams(temperature=0.8, seed=11, max_new_tokens=18)
        result, chooser = generate(verifier, pool, "thompson", prompts[2], params, InMemorySessionStore(), SessionKey("t", "s"), trace=True)
        runs.append((result.token_ids, [r.drafter for r in result.rounds], chooser.trace))
    assert runs[0] == runs[1]
    trace = runs[0][2]
    assert [t.round for t in trace] == list(range(len(trace)))
    assert all(t.leader in pool for t in trace)


def test_arm_k_choices_set_the_draft_length(verifier, pool, prompts):
    result, chooser = generate(verifier, pool, "ucb-cost-k", prompts[3], SamplingParams(max_new_tokens=40),
                               InMemorySessionStore(), SessionKey("t", "s"), k=5, trace=True)
    for record, entry in zip([r for r in result.rounds if r.k > 0], chooser.trace):
        drafter, _, k = entry.arm.rpartition("@")
        assert record.drafter == drafter
        assert record.k <= int(k)
    assert {int(t.arm.rpartition("@")[2]) for t in chooser.trace} >= {2, 3}


# -- the CLI -----------------------------------------------------------------------------------------


def test_cli_policy_json_and_trace(cli, model_dirs):
    code, out, err = cli("generate", "the cat sat on the mat and the cat sat on the", "--json", "--max-new-tokens", "16",
                         "--policy", "metasd-ucb", "--pool", f"ngram,hf:{model_dirs.noisy}", "--trace")
    assert code == 0, err
    payload = json.loads(out)
    stats = payload["stats"]
    assert stats["policy"] == "metasd-ucb"
    assert set(stats["drafters"]) == {"ngram", f"hf:{model_dirs.noisy}"}  # each arm played once at least
    assert sum(stats["drafters"].values()) == stats["rounds"]
    trace = [line for line in err.splitlines() if line.startswith("round ")]
    assert len(trace) == stats["rounds"]
    assert all(" k " in line and " accepted " in line and " BD " in line for line in trace)
    code, out, err = cli("generate", "the cat sat on the mat and the cat sat on the", "--json", "--max-new-tokens", "16", "--drafter", "none")
    assert json.loads(out)["token_ids"] == payload["token_ids"]


BAD_POLICY = {
    "unknown-policy": (["--policy", "bogus"], ["unknown policy 'bogus'", "metasd-ucb"]),
    "beta-0": (["--policy", "metasd-ucb", "--beta", "0", "--pool", "ngram"], ["beta must be > 0", "got 0"]),
    "beta-negative": (["--policy", "metasd-ucb", "--beta", "-0.5", "--pool", "ngram"], ["beta must be > 0"]),
    "oracle": (["--policy", "oracle"], ["evaluation"]),
    "drafter-and-policy": (["--policy", "metasd-ucb", "--drafter", "ngram"], ["either --drafter or --policy"]),
    "pool-without-policy": (["--pool", "ngram"], ["--pool needs --policy"]),
    "empty-pool": (["--policy", "metasd-ucb", "--pool", ","], ["--pool is empty"]),
    "unknown-pool-drafter": (["--policy", "metasd-ucb", "--pool", "ngram,bogus"], ["unknown drafter 'bogus'"]),
    "bad-tenant": (["--policy", "metasd-ucb", "--pool", "ngram", "--tenant", "a:*"], ["tenant"]),
    "bad-store": (["--policy", "metasd-ucb", "--pool", "ngram", "--store", "postgres://x"], ["memory", "redis://"]),
    "redis-unreachable": (["--policy", "metasd-ucb", "--pool", "ngram", "--store", "redis://127.0.0.1:1/0"],
                          ["cannot reach Redis at redis://127.0.0.1:1/0"]),
}


@pytest.mark.parametrize("case", list(BAD_POLICY))
def test_bad_policy_input(cli, case):
    argv, fragments = BAD_POLICY[case]
    code, out, err = cli("generate", "the cat", *argv)
    assert_one_line_error(code, err, *fragments)
    assert out == ""


class CountingStore(InMemorySessionStore):
    """The in-memory store, counting reads (a test double for round trips)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def read(self, key):
        self.reads += 1
        return super().read(key)


def _round(drafter: str, accepted: int) -> RoundRecord:
    return RoundRecord(drafter, 4, 4, accepted, accepted + 1, 1.0 - 0.2 * (4 - accepted), 0.01, 0.05, 0.07)


def test_a_request_reads_its_session_once_and_loses_no_concurrent_update():
    store = CountingStore()
    key = SessionKey("acme", "s")
    policy = make_policy("metasd-ucb", ["ngram", "code"])
    chooser = BanditChooser(policy, store, key)
    for accepted in (4, 0, 2, 3):
        choice = chooser.select()
        chooser.update(_round(choice.drafter, accepted))
    assert store.reads == 1  # later rounds choose from the state their own update committed
    assert store.read(key)[0]["t"] == 4
    # Two requests of one session at once: each chooses from its own view, both updates land.
    a, b = BanditChooser(policy, store, key), BanditChooser(policy, store, key)
    for chooser in (a, b, a, b):
        choice = chooser.select()
        chooser.update(_round(choice.drafter, 1))
    state = store.read(key)[0]
    assert state["t"] == 8 and sum(arm["n"] for arm in state["arms"].values()) == 8
