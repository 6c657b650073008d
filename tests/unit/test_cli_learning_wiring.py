"""The command-line wiring of online learning (issue 6), on the tiny target and a tiny zoo drafter:

- ``specpool generate --learn``: the learner thread trains while generating, publishes to the model
  store, and the next run drafts with the learned version; output stays the target's own; opted-out
  tenants and other tenants are left alone; bad options fail in one line before the model load;
- ``specpool learner``: its loop (``run_learner``) with ``once`` / ``max_records`` / a stream that
  goes away, and its errors without Redis (the run against the real Redis is
  tests/integration/test_learner_cli_redis.py);
- ``specpool bench --online``: the same benchmark and results.json rows as ``python -m bench.online``.
"""

from __future__ import annotations

import argparse
import json
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cli_helpers import assert_one_line_error
from specpool.learning.feedback import InProcessFeedbackStream
from specpool.learning.model_store import DirectoryModelStore, VariantKey
from specpool.learning.online import OnlineConfig
from online_helpers import target_records, tiny_zoo_model, write_tiny_zoo
from specpool.core.errors import StoreUnavailable
from specpool.learning.learner_loop import Learner
from specpool.learning.learner_process import run_learner
from specpool.learning.learning_config import LearningConfig

MAX_NEW = "24"


@pytest.fixture(scope="module")
def zoo_spec(model_dirs, target_lm, tmp_path_factory) -> str:
    folder = write_tiny_zoo(model_dirs.target, target_lm[1], tmp_path_factory.mktemp("zoo") / "tiny")
    return f"zoo:{folder}"


@pytest.fixture(scope="module")
def prompt(prompt_texts) -> str:
    return prompt_texts[1]  # repeats a phrase: the tiny zoo drafter gets some drafts accepted


def generate_json(cli, *args: str) -> dict:
    code, out, err = cli("generate", *args, "--raw", "--json", "--max-new-tokens", MAX_NEW)
    assert code == 0, err
    return json.loads(out)


# --- specpool generate --learn ----------------------------------------------------------------------


def test_generate_learn_publishes_and_the_next_run_drafts_with_it(cli, zoo_spec, prompt, tmp_path):
    store = tmp_path / "store"
    reference = generate_json(cli, prompt, "--drafter", "none")["token_ids"]
    learn = ("--drafter", zoo_spec, "-k", "4", "--learn", "--model-store", str(store), "--learn-publish-every", "4",
             "--learn-lr", "0.1")

    first = generate_json(cli, prompt, *learn, "--tenant", "acme")
    assert first["token_ids"] == reference  # learning never changes the output (greedy: the target's own)
    stats = first["stats"]["learning"]
    assert stats["algorithm"] == "ogd" and stats["store"] == str(store) and stats["committed"]
    assert stats["records"] > 0 and stats["applied"] > 0 and stats["published"] >= 1
    served = stats["versions"][zoo_spec]
    assert served["drafted_with"] == 0 and served["serving"] >= 1
    assert DirectoryModelStore(store).serving(VariantKey("acme", zoo_spec)) == served["serving"]

    # A new process (a new CLI run) starts from the store: it drafts with the learned version...
    second = generate_json(cli, prompt, *learn, "--tenant", "acme")
    assert second["token_ids"] == reference
    assert second["stats"]["learning"]["versions"][zoo_spec]["drafted_with"] == served["serving"]
    assert second["stats"]["learning"]["versions"][zoo_spec]["serving"] > served["serving"]  # and learns on
    # ...while another tenant still drafts with the shipped weights (its own variant).
    other = generate_json(cli, prompt, *learn, "--tenant", "beta")
    assert other["stats"]["learning"]["versions"][zoo_spec]["drafted_with"] == 0
    assert DirectoryModelStore(store).serving(VariantKey("acme", zoo_spec)) == \
        second["stats"]["learning"]["versions"][zoo_spec]["serving"]  # beta's run left acme's alone


def test_generate_learn_respects_tenant_opt_out(cli, zoo_spec, prompt, tmp_path):
    store = tmp_path / "store"
    result = generate_json(cli, prompt, "--drafter", zoo_spec, "-k", "4", "--learn", "--model-store", str(store),
                           "--learn-publish-every", "1", "--tenant", "quiet", "--learn-opt-out", "loud, quiet")
    stats = result["stats"]["learning"]
    assert stats["opted_out"] and stats["records"] == 0 and stats["applied"] == 0 and stats["published"] == 0
    assert result["stats"]["rounds"] > 0
    assert not (store / "quiet").exists()  # nothing of that tenant's was ever stored


def test_generate_learn_text_output_and_algorithm_alias(cli, zoo_spec, prompt, tmp_path):
    code, out, err = cli("generate", prompt, "--raw", "--max-new-tokens", MAX_NEW, "--drafter", zoo_spec, "-k", "4",
                         "--learn", "--learner-algo", "hedge", "--learn-store", str(tmp_path / "store"),
                         "--learn-publish-every", "4")
    assert code == 0, err
    line = out.strip().splitlines()[-1]
    assert line.startswith("[learn (hedge):") and f"{zoo_spec} v0 -> v" in line and str(tmp_path / "store") in line
    state = DirectoryModelStore(tmp_path / "store").load_state(VariantKey("default", zoo_spec))
    assert state is not None and state["learner"]["config"]["algorithm"] == "hedge"
    assert len(state["learner"]["members"]) == 3  # the default three step sizes


def test_generate_learn_with_no_zoo_drafter_says_so(cli, prompt, tmp_path):
    code, out, err = cli("generate", prompt, "--raw", "--max-new-tokens", "8", "--drafter", "ngram", "--learn",
                         "--model-store", str(tmp_path / "store"))
    assert code == 0, err
    assert out.strip().splitlines()[-1] == "[learn: no zoo drafter in use, nothing to learn]"
    assert not (tmp_path / "store").exists()


def test_generate_learn_default_store_is_under_the_home(cli, zoo_spec, prompt, tmp_path):
    # The cli fixture sets SPECPOOL_HOME to tmp_path / "home".
    result = generate_json(cli, prompt, "--drafter", zoo_spec, "-k", "4", "--learn", "--learn-publish-every", "4")
    assert result["stats"]["learning"]["store"] == str(tmp_path / "home" / "online")
    assert DirectoryModelStore(tmp_path / "home" / "online").serving(VariantKey("default", zoo_spec)) >= 1


def test_generate_learn_refuses_a_checkpoint_of_another_algorithm(cli, zoo_spec, prompt, tmp_path):
    store = str(tmp_path / "store")
    generate_json(cli, prompt, "--drafter", zoo_spec, "-k", "4", "--learn", "--model-store", store, "--learn-publish-every", "4")
    code, out, err = cli("generate", prompt, "--raw", "--json", "--drafter", zoo_spec, "-k", "4", "--learn",
                         "--model-store", store, "--learner-algo", "hedge")
    assert_one_line_error(code, err, "made by ogd (1 member), not hedge (3 members)", store)
    assert out == ""  # refused before generating
    # Another tenant has no checkpoint yet: any algorithm may start there.
    assert generate_json(cli, prompt, "--drafter", zoo_spec, "-k", "4", "--learn", "--model-store", store,
                         "--learner-algo", "hedge", "--tenant", "other")["stats"]["learning"]["published"] >= 1


def test_learner_leaves_records_of_a_conflicting_checkpoint_pending(tmp_path, zoo_base, records):
    store = DirectoryModelStore(tmp_path / "store")
    Learner(CONFIG, filled(records[:4]), store, lambda name: zoo_base).drain()  # optimistic checkpoint
    stream = filled(records[4:8])
    hedge = Learner(LearningConfig(online=OnlineConfig(algorithm="hedge"), holdout_every=0), stream, store,
                    lambda name: zoo_base)
    hedge.drain()
    assert hedge.counters["errors"] == 4 and hedge.counters["applied"] == 0 and hedge.counters["acked"] == 0
    assert stream.pending() == 4  # not dropped: a learner with the right algorithm takes them over
    again = Learner(replace(CONFIG, claim_idle_s=0.0), stream, store, lambda name: zoo_base, consumer="learner-2")
    assert again.recover() == 4
    again.drain()
    assert again.counters["applied"] == 4 and stream.pending() == 0


@pytest.mark.parametrize("options, fragments", [
    (["--learn-feedback", "redis://127.0.0.1:1/0"], ["redis://127.0.0.1:1/0", "unreachable", "--learn-feedback"]),
    (["--model-store", "s3://bucket/x"], ["no model store for s3://"]),
    (["--learn-hedge-lrs", "0.1,fast"], ["hedge step sizes", "'0.1,fast'"]),
    (["--learn-lr", "-1"], ["learning rates"]),
    (["--learn-publish-every", "0"], ["--learn-publish-every"]),
    (["--learner-algo", "sgd"], ["invalid choice", "sgd"]),
    (["--learn-supervision", "hard"], ["invalid choice", "hard"]),
    (["--learn-copy-window", "-4"], ["copy_window", "-4"]),
])
def test_generate_learn_bad_options_fail_before_the_model_load(cli, options, fragments):
    # The target does not exist: an error about the options shows they were checked first.
    code, out, err = cli("generate", "hello", "--learn", *options, target="/nonexistent/target")
    assert_one_line_error(code, err, *fragments)


# --- specpool learner: the loop -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zoo_base(model_dirs):
    return tiny_zoo_model(model_dirs.target)


@pytest.fixture(scope="module")
def records(target_lm, prompts):
    return target_records(target_lm[0], prompts[:6], k=4, per_prompt=2, drafter="d")  # 12 records


def filled(records) -> InProcessFeedbackStream:
    stream = InProcessFeedbackStream(capacity=1000)
    for record in records:
        stream.emit(record.encode())
    return stream


CONFIG = LearningConfig(online=OnlineConfig(algorithm="optimistic", lr=0.05), publish_every=4, holdout_every=0,
                        read_count=3, read_block_s=0.01)
KEY = VariantKey("t1", "d")


def test_run_learner_max_records_then_once_equals_one_pass(tmp_path, zoo_base, records):
    stream = filled(records)
    store = DirectoryModelStore(tmp_path / "store")
    seen: list[int] = []
    first = run_learner(CONFIG, stream, store, lambda name: zoo_base, "c1", threading.Event(), max_records=5,
                        on_progress=lambda learner: seen.append(learner.counters["processed"]))
    assert first.counters["processed"] == 5 and first.counters["acked"] == 5  # never read a sixth
    assert stream.backlog() == 7 and stream.pending() == 0  # what it read is committed and acknowledged
    assert store.serving(KEY) is not None
    assert seen == sorted(seen) and seen[-1] == 5

    second = run_learner(CONFIG, stream, store, lambda name: zoo_base, "c2", threading.Event(), once=True)
    assert second.counters["processed"] == 7 and stream.backlog() == 0 and stream.pending() == 0
    assert second.counters["duplicates"] == 0

    reference = Learner(CONFIG, filled(records), DirectoryModelStore(tmp_path / "ref"), lambda name: zoo_base)
    reference.drain()
    want = reference.variants[KEY].learner.state_dict()
    got = store.load_state(KEY)["learner"]
    assert want["steps"] == got["steps"] == 12
    for name, tensor in want["members"][0].items():
        assert torch.equal(tensor, got["members"][0][name]), name

    third = run_learner(CONFIG, stream, store, lambda name: zoo_base, "c3", threading.Event(), once=True)
    assert third.counters["processed"] == 0 and third.counters["published"] == 0  # nothing new: no new version


class FlakySource:
    """An in-process stream whose first ``failures`` reads fail as an unreachable Redis does."""

    def __init__(self, inner: InProcessFeedbackStream, failures: int):
        self.inner, self.failures = inner, failures
        self.describe = "flaky"

    def read(self, consumer, count, block_s=0.0):
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("lost the feedback stream flaky while reading (Connection refused)")
        return self.inner.read(consumer, count, block_s)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_run_learner_retries_a_lost_stream_unless_once(tmp_path, zoo_base, records):
    source = FlakySource(filled(records[:4]), failures=2)
    learner = run_learner(CONFIG, source, DirectoryModelStore(tmp_path / "a"), lambda name: zoo_base, "c1",
                          threading.Event(), max_records=4, retry_after_s=0.01)
    assert learner.counters["processed"] == 4 and learner.counters["errors"] == 2 and source.inner.pending() == 0

    once = FlakySource(filled(records[:4]), failures=1)
    with pytest.raises(StoreUnavailable, match="Connection refused"):
        run_learner(CONFIG, once, DirectoryModelStore(tmp_path / "b"), lambda name: zoo_base, "c1",
                    threading.Event(), once=True)


def test_run_learner_stops_when_asked(tmp_path, zoo_base, records):
    stream = filled(records[:3])
    stop = threading.Event()
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("learner", run_learner(
        CONFIG, stream, DirectoryModelStore(tmp_path / "s"), lambda name: zoo_base, "c1", stop)))
    thread.start()
    for _ in range(500):
        if stream.backlog() == 0 and stream.pending() == 3:
            break
        threading.Event().wait(0.01)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert box["learner"].counters["applied"] == 3 and stream.pending() == 0  # committed on the way out


# --- specpool learner: the command without Redis --------------------------------------------------------


def test_learner_unreachable_redis_is_one_clear_line(cli, zoo_spec, tmp_path):
    code, out, err = cli("learner", "--redis", "redis://127.0.0.1:1/0", "--once", "--drafters", zoo_spec,
                         "--store", str(tmp_path / "store"))
    assert_one_line_error(code, err, "redis://127.0.0.1:1/0", "unreachable", "Connection refused", "redis-server")


@pytest.mark.parametrize("options, fragments", [
    (["--redis", "http://127.0.0.1:6379"], ["invalid Redis URL", "http://127.0.0.1:6379"]),
    (["--max-records", "0"], ["--max-records must be >= 1"]),
    (["--drafters", "nosuch:x"], ["unknown drafter 'nosuch:x'"]),
    (["--store", "s3://bucket"], ["no model store for s3://"]),
    (["--algo", "adam"], ["invalid choice", "adam"]),
    (["--hedge-lrs", "x"], ["hedge step sizes", "'x'"]),
])
def test_learner_bad_options(cli, zoo_spec, options, fragments):
    argv = ["learner", "--redis", "redis://127.0.0.1:1/0", "--once", *options]
    if "--drafters" not in options:
        argv += ["--drafters", zoo_spec]
    code, out, err = cli(*argv)
    assert_one_line_error(code, err, *fragments)


def test_learner_short_and_long_option_names_agree():
    from specpool.cli.main import build_parser

    parser = build_parser()
    short = parser.parse_args(["learner", "--algo", "hedge", "--store", "/s", "--lr", "0.2", "--hedge-lrs", "0.1,1",
                               "--opt-out", "x", "--budget-records", "7", "--budget-tokens", "9", "--shared",
                               "--publish-every", "3", "--commit-after-s", "120", "--precondition", "none",
                               "--supervision", "argmax", "--copy-window", "32", "--merge-records", "--no-detach-context", "--trainable-blocks", "1"])
    long = parser.parse_args(["learner", "--learn-algorithm", "hedge", "--learn-store", "/s", "--learn-lr", "0.2",
                              "--learn-hedge-lrs", "0.1,1", "--learn-opt-out", "x", "--learn-budget-records", "7",
                              "--learn-budget-tokens", "9", "--learn-shared", "--learn-publish-every", "3", "--learn-commit-after-s", "120",
                              "--learn-precondition", "none", "--learn-supervision", "argmax", "--learn-copy-window", "32",
                              "--learn-merge-records", "--no-learn-detach-context", "--learn-trainable-blocks", "1"])
    assert vars(short) == vars(long)
    from specpool.cli.learning import learning_config_from_args

    config = learning_config_from_args(short, ("chat",), claim_idle_s=5.0)
    assert (config.online.algorithm, config.online.hedge_lrs, config.online.precondition, config.online.supervision,
            config.online.copy_window, config.store, config.opt_out) == ("hedge", (0.1, 1.0), "none", "argmax", 32, "/s", frozenset({"x"}))
    assert (config.online.merge_records, config.online.detach_context, config.online.trainable_blocks) == (True, False, 1)
    # Without the option: the library's default (AdaGrad), with its default step sizes.
    from specpool.learning.online import OnlineConfig

    default = learning_config_from_args(parser.parse_args(["learner", "--algo", "ogd"]))
    assert (default.online.precondition, default.online.lr) == (OnlineConfig().precondition, OnlineConfig().lr) == ("adagrad", 0.002)
    assert default.online.copy_window == OnlineConfig().copy_window
    for option in ("merge_records", "detach_context", "trainable_blocks"):
        assert getattr(default.online, option) == getattr(OnlineConfig(), option)
    assert (config.budget_records, config.budget_tokens, config.shared_pool, config.publish_every, config.commit_after_s,
            config.claim_idle_s, config.drafters) == (7, 9, True, 3, 120.0, 5.0, ("chat",))
    from specpool.learning.learning_config import LearningConfig

    assert default.commit_after_s == LearningConfig().commit_after_s
    from specpool.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="commit-after-s must be > 0"):
        learning_config_from_args(parser.parse_args(["learner", "--commit-after-s", "0"]))


# --- specpool bench --online ------------------------------------------------------------------------


def online_namespace(argv: list[str]) -> dict:
    """What ``python -m bench.online ARGV`` runs, with the defaults spelled out."""
    from bench.online import add_online_arguments
    from specpool.target.models import DEFAULT_TARGET

    parser = argparse.ArgumentParser()
    add_online_arguments(parser)
    args = vars(parser.parse_args(argv))
    args["target"] = args["target"] or DEFAULT_TARGET
    return args


def bench_namespace(argv: list[str]) -> dict:
    """What ``specpool bench --online ARGV`` runs (bench/online.py's namespace)."""
    from bench.online_args import online_args_from_bench
    from specpool.cli.main import build_parser

    args = vars(online_args_from_bench(build_parser().parse_args(["bench", "--online", *argv])))
    assert args.pop("via_specpool") and args.pop("dtype") == "auto"
    return args


def test_bench_online_defaults_are_bench_online_defaults():
    assert bench_namespace(["--prompts", "corpus"]) == online_namespace(["--corpus", "corpus"])
    assert online_namespace(["--corpus", "corpus"])["max_new_tokens"] == 64  # not the speed bench's 128


def test_bench_online_options_map_one_to_one():
    shared = ["--limit", "9", "--systems", "frozen,hedge", "-k", "3", "--max-new-tokens", "12", "--lr", "0.2",
              "--hedge-lrs", "0.1,0.3", "--precondition", "adagrad", "--batch-records", "2", "--concurrent",
              "--out", "o", "--target", "t", "--device", "cpu", "--forgetting-prompts", "q.jsonl",
              "--forgetting-per-category", "3", "--forgetting-categories", "chat,qa", "--forgetting-only",
              "--merge-records", "--no-detach-context", "--publish-every", "64", "--commit-after-s", "45"]
    assert bench_namespace(["--prompts", "c", "--drafters", "math", *shared]) == \
        online_namespace(["--corpus", "c", "--drafter", "math", *shared])


def test_bench_without_online_keeps_its_defaults():
    from bench.cli import resolve_bench_defaults
    from specpool.cli.main import build_parser

    args = resolve_bench_defaults(build_parser().parse_args(["bench", "--prompts", "p.jsonl"]))
    assert (args.online, args.max_new_tokens, args.drafters, args.out) == (False, 128, "ngram", "bench-results/latest")


@pytest.mark.parametrize("options, fragments", [
    (["--policies", "metasd-ucb"], ["--online or --policies"]),
    (["--drafters", "chat,code"], ["one drafter"]),
    (["--in-domain"], ["--in-domain"]),
    (["--in-domain-lookup"], ["--in-domain-lookup"]),
    (["--limit", "2"], ["--limit must be >= 3"]),
    (["--systems", "frozen,sgd"], ["--systems"]),
    (["--commit-after-s", "0"], ["--commit-after-s must be > 0"]),
])
def test_bench_online_bad_options(cli, tmp_path, options, fragments):
    corpus = tmp_path / "book.txt"
    corpus.write_text(" ".join(["word"] * 50))
    code, out, err = cli("bench", "--online", "--prompts", str(corpus), "--out", str(tmp_path / "out"), *options,
                         target="/nonexistent/target")
    assert_one_line_error(code, err, *fragments)


@pytest.mark.slow  # a whole run / a regret sweep: the fast lane skips it
def test_specpool_bench_online_gives_the_rows_of_bench_online(cli, tmp_path, zoo_spec, home, model_dirs):
    from bench.online import add_online_arguments, run_online_bench

    corpus = tmp_path / "book.txt"
    corpus.write_text("\n\n".join(" ".join(["the cat sat on the mat and the dog ran to the house"] * 4) for _ in range(4)))
    common = ["--limit", "3", "--max-new-tokens", "8", "--lr", "0.1", "--systems", "frozen,ogd", "-k", "4"]
    code, out, err = cli("bench", "--online", "--prompts", str(corpus), "--drafters", zoo_spec,
                         "--out", str(tmp_path / "specpool"), *common)
    assert code == 0, err

    parser = argparse.ArgumentParser()
    add_online_arguments(parser)
    args = parser.parse_args(["--corpus", str(corpus), "--drafter", zoo_spec, "--out", str(tmp_path / "module"),
                              "--target", str(model_dirs.target), *common])
    assert run_online_bench(args, SimpleNamespace(home=home)) == 0

    def rows(folder: Path) -> list[dict]:
        return json.loads((folder / "results.json").read_text())

    ours, theirs = rows(tmp_path / "specpool"), rows(tmp_path / "module")
    assert [(r["system"], r["segment"], r["n_prompts"]) for r in ours] == \
        [(r["system"], r["segment"], r["n_prompts"]) for r in theirs] == \
        [(s, g, n) for s in ("frozen", "ogd") for g, n in (("first_third", 1), ("last_third", 1), ("all", 3))]
    assert [set(r) for r in ours] == [set(r) for r in theirs]
    assert all({"system", "segment", "mean_accepted_length", "tokens_per_s", "n_prompts"} <= set(r) for r in ours)
    frozen = lambda rs: [r["mean_accepted_length"] for r in rs if r["system"] == "frozen"]  # noqa: E731
    assert frozen(ours) == frozen(theirs)  # the frozen drafter's numbers are deterministic
    first = lambda rs: {r["system"]: r["mean_accepted_length"] for r in rs if r["segment"] == "first_third"}  # noqa: E731
    assert first(ours)["ogd"] == first(ours)["frozen"]  # before any feedback, learning drafts as frozen
    report = (tmp_path / "specpool" / "report.md").read_text()
    assert "specpool bench --online --prompts" in report
    assert {"per_prompt.jsonl", "report.md", "results.json"} <= {p.name for p in (tmp_path / "specpool").iterdir()}
