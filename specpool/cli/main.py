"""``specpool`` command line. Bad input gives one clear line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Sequence

from specpool.core.defaults import (DEFAULT_BETA, DEFAULT_DRAFTER, DEFAULT_K, DEFAULT_MAX_NEW_TOKENS, DEFAULT_PROBE_ROUNDS,
                                     DEFAULT_TARGET, DEFAULT_TENANT, FALLBACK_DRAFTER, MAX_DRAFT_LENGTH)
from specpool.cli.bench_loader import add_bench_command, load_bench
from specpool.core.errors import SpecpoolError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (no usage dump), like domain errors."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"specpool: error: {message} (see {self.prog} --help)\n")


def _quiet_libraries() -> None:
    # transformers and torch talk a lot on load; a user of the CLI wants the answer.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    from specpool.target.cpu_linear import CPU_LINEAR_MODES
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: embedded name, folder or hub id (default {DEFAULT_TARGET})")
    parser.add_argument("--device", default="cpu", help="device for the target and model drafters: cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16")
    parser.add_argument("--cpu-linear", default="auto", choices=CPU_LINEAR_MODES,
                        help="target's linear layers on a CPU: auto (oneDNN-packed weights for float32, the default), packed, plain")


def build_parser() -> argparse.ArgumentParser:
    # A table of commands and flags, read as one: splitting it by command would hide the shared options.
    parser = _Parser(prog="specpool", description="Lossless speculative decoding with a pool of drafters.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = commands.add_parser("generate", help="generate text for one prompt (embedded mode)")
    gen.add_argument("prompt")
    gen.add_argument("--drafter", default=None,
                     help="one fixed drafter: a spec (ngram, code, eagle:general, hf:PATH, ...) or none; default unless --policy "
                          f"is given: {DEFAULT_DRAFTER} for the default target, {FALLBACK_DRAFTER} for any other")
    gen.add_argument("--policy", default=None,
                     help="choose the drafter each round with a bandit policy: metasd-ucb, ucb-be, thompson, exp3, "
                          "ucb-discounted, sequential-halving, ucb-cost, ucb-cost-k, ucb-replay, random, fixed:NAME; append +warm for tenant warm start")
    gen.add_argument("--pool", default=None, help="comma-separated drafters the policy chooses among (default for the default target: every shipped white-box head behind prompt lookup and ngram; other targets: ngram and the zoo)")
    gen.add_argument("--beta", type=float, default=DEFAULT_BETA, help=f"UCB exploration weight β > 0 (default {DEFAULT_BETA})")
    gen.add_argument("--probe-rounds", type=int, default=DEFAULT_PROBE_ROUNDS,
                     help=f"ucb-replay: rounds in which every drafter is replayed on the target's tokens (default {DEFAULT_PROBE_ROUNDS})")
    gen.add_argument("--tenant", default=DEFAULT_TENANT, help=f"tenant whose statistics a +warm policy starts from (default: {DEFAULT_TENANT})")
    gen.add_argument("--session", default=None, help="session id: bandit state carries over between requests of one session")
    gen.add_argument("--store", default="memory", help="bandit state store: memory (default) or redis://HOST:PORT/DB")
    gen.add_argument("--trace", action="store_true", help="print one line per round to stderr: drafter, k, accepted, BD")
    gen.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft length per round (1..{MAX_DRAFT_LENGTH}, default {DEFAULT_K})")
    gen.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _add_model_options(gen)
    from specpool.cli.learning import add_learner_command, add_learning_arguments

    add_learning_arguments(gen)  # --learn and its options (specpool/cli/learning.py)

    models = commands.add_parser("models", help="manage cached models")
    model_commands = models.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    fetch = model_commands.add_parser("fetch", help="download and convert the embedded default target")
    fetch.add_argument("name", nargs="?", default=None, help="embedded model name (default: the default target)")

    zoo = commands.add_parser("zoo", help="train and evaluate the domain drafters")
    zoo_commands = zoo.add_subparsers(dest="zoo_command", required=True, parser_class=_Parser)
    train = zoo_commands.add_parser("train", help="distil a domain drafter from the target")
    train.add_argument("--domain", required=True, help="code, math, translation, summarization_qa, chat or general")
    train.add_argument("--data", nargs="+", metavar="PATH", help="corpus files or folders")
    train.add_argument("--data-root", default=None, help="instead of --data: a shared/data folder; use the domain's default recipe")
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--out", default=None, help="output folder (default: $SPECPOOL_HOME/zoo/drafters/DOMAIN)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--max-prompts", type=int, default=320, help="prompts the target answers for teacher data")
    train.add_argument("--max-new-tokens", type=int, default=64, help="teacher answer length")
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (warm-up, then cosine decay)")
    train.add_argument("--warmup", type=int, default=50, help="warm-up steps")
    train.add_argument("--context-tokens", type=int, default=160, help="prompt tokens kept before each answer in training")
    train.add_argument("--save-every", type=int, default=100, help="checkpoint (and held-out check) period, in steps")
    train.add_argument("--reduced-vocab", type=int, default=8192, metavar="N",
                       help="tokens the drafter can propose (its output head); eagle --init-from keeps the source head's "
                            "vocabulary and fills the rest from the new data")
    train.add_argument("--teacher-batch", type=int, default=32, help="prompts per batched teacher generate call")
    train.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the teacher answers and the drafter trains")
    train.add_argument("--time-limit", type=float, default=0.0, metavar="MIN",
                       help="stop training at the first checkpoint after MIN minutes, keeping the best weights so far")
    train.add_argument("--teacher-time-limit", type=float, default=0.0, metavar="MIN",
                       help="start no new teacher batch after MIN minutes; train on the prompts answered so far")
    train.add_argument("--teacher-only", action="store_true", help="only precompute the target's answers (the teacher store), then stop")
    train.add_argument("--arch", choices=("zoo", "eagle"), default="zoo",
                       help="zoo: a black-box drafter; eagle: a white-box head that reads the target's features")
    train.add_argument("--recipe", default="eagle", help="eagle only: eagle (teacher-forced, EAGLE-1) or unroll "
                       "(trained on its own guessed features, EAGLE-3's training-time test simplified)")
    train.add_argument("--unroll", type=int, default=3, help="eagle --recipe unroll: steps unrolled")
    train.add_argument("--regression-weight", type=float, default=1.0,
                       help="eagle only: weight of the feature regression beside the token cross-entropy (0: tokens only)")
    train.add_argument("--reference-answers", type=int, default=0, metavar="N",
                       help="eagle only: also read up to N corpus (prompt, reference answer) pairs teacher-forced "
                            "(one target forward each, far cheaper than answering): more data per CPU hour")
    train.add_argument("--head-layers", type=int, default=1, metavar="N",
                       help="eagle only: decoder blocks in the head (EAGLE's 1; with --init-from, blocks the source "
                            "lacks start as the identity)")
    train.add_argument("--storage", choices=("float16", "int8"), default="float16",
                       help="eagle only: on-disk weights; int8 keeps the blocks' matrices as int8 with a float16 scale "
                            "per row (half the size: two blocks fit a 10 MB head)")
    train.add_argument("--onpolicy-weight", type=int, default=1, metavar="W",
                       help="eagle only: each on-policy answer counts W times beside the reference answers")
    train.add_argument("--init-from", default=None, metavar="DRAFTER",
                       help="start from a trained zoo drafter (shipped name or folder) instead of the target's layers: "
                            "fine-tune a broader drafter on a small domain")
    train.add_argument("--background", action="store_true", help="detach; log to OUT.log and return at once")
    train.add_argument("--target", default=None, help="target model (default: the embedded default)")
    prompts = zoo_commands.add_parser(
        "self-prompts", help="sample user requests from the target itself (Magpie): chat-like prompts for --data")
    prompts.add_argument("--count", type=int, default=2000, help="distinct requests to write")
    prompts.add_argument("--out", default=None, help="JSON lines file (default: $SPECPOOL_HOME/zoo/self-prompts.jsonl)")
    prompts.add_argument("--seed", type=int, default=0)
    prompts.add_argument("--batch-size", type=int, default=32, help="requests sampled per generate call")
    prompts.add_argument("--max-new-tokens", type=int, default=64, help="longest request; longer ones are dropped")
    prompts.add_argument("--temperature", type=float, default=1.0)
    prompts.add_argument("--top-p", type=float, default=0.95)
    prompts.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    prompts.add_argument("--target", default=None, help="target model (default: the embedded default)")
    zoo_commands.add_parser("manifest", help="hash the shipped drafters (specpool/drafters/zoo/) and record their reference acceptance")
    # The benchmarks' commands take their options from bench/ of the checkout (specpool/cli/bench_loader.py).
    add_bench_command(zoo_commands, "eval", command="zoo eval", help="cross-domain acceptance matrix of drafters x categories",
                      module="zoo_eval", add_arguments=lambda zoo_eval, parser: zoo_eval.add_zoo_eval_arguments(parser))

    def add_bench_options(bench_cli, parser: argparse.ArgumentParser) -> None:
        bench_cli.add_bench_arguments(parser)
        _add_model_options(parser)

    add_bench_command(commands, "bench", command="bench", help="benchmark speculative decoding against target-only and Hugging Face",
                      module="cli", add_arguments=add_bench_options)

    from specpool.cli.served import add_served_commands

    add_served_commands(commands)  # serve, client generate, bench-served (specpool/cli/served.py)
    learner = add_learner_command(commands)  # served mode's learner process (specpool/cli/learning.py)
    _add_model_options(learner)
    return parser


def _sampling_params(args: argparse.Namespace, stop_token_ids: tuple[int, ...]):
    from specpool.target.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop_token_ids=stop_token_ids,
    )


def cmd_generate(args: argparse.Namespace, settings) -> int:
    # Imported here, not at the top: they load torch, and `specpool --help` should not wait for it.
    from specpool.cli.learning import check_learning_store, learning_config_from_args, learning_versions
    from specpool.core.errors import InvalidArgument, NotFound, check
    from specpool.drafters.registry import drafter_kinds, known_spec
    from specpool.drafters.zoo import shipped_names
    from specpool.router.policies import PolicyOptions, make_policy, parse_arm
    from specpool.router.session_store import SessionKey, open_store
    from specpool.services.engine import EmbeddedEngine, EngineConfig, default_drafter, default_pool
    from specpool.target.models import ModelConfig
    from specpool.target.sampling import validate_draft_length

    # Everything checkable without a model is checked before the (slow) model load.
    check(bool(args.prompt.strip()), "the prompt is empty")
    validate_draft_length(args.k)
    _sampling_params(args, ()).validate()
    if args.policy is not None and args.drafter is not None:
        raise InvalidArgument("give either --drafter or --policy, not both (a fixed drafter is --policy fixed:NAME)")
    drafter = None if args.drafter == "none" else (args.drafter or (default_drafter(args.target) if args.policy is None else None))
    names = ", ".join(shipped_names() + [f"{kind}:..." for kind in drafter_kinds() if kind != "ngram"] + ["ngram", "none"])
    pool = None
    options = PolicyOptions(beta=args.beta, probe_rounds=args.probe_rounds)
    if args.policy is not None:
        pool = [p.strip() for p in args.pool.split(",") if p.strip()] if args.pool is not None else default_pool(args.target)
        check(bool(pool), "--pool is empty; give drafter names such as ngram,code,math")
        policy = make_policy(args.policy, pool, options)  # validates name, beta, pool
        pool = [d for d in dict.fromkeys(parse_arm(a)[0] for a in policy.arms)]
    elif args.pool is not None:
        raise InvalidArgument("--pool needs --policy (a pool is what a policy chooses among)")
    for spec in ([drafter] if drafter is not None else []) + (pool or []):
        if not known_spec(spec):
            raise NotFound(f"unknown drafter {spec!r}; known: {names}")
    SessionKey(args.tenant, args.session or "cli")  # validate ids before loading anything
    learning = learning_config_from_args(args)  # None without --learn
    check_learning_store(learning)
    store = open_store(args.store)  # a bad or unreachable store fails here, before the model load

    target = ModelConfig(args.target, args.device, args.dtype, args.cpu_linear)
    target.check_device()
    target.torch_dtype()
    engine = EmbeddedEngine(EngineConfig(home=settings.home, target=target, drafter_device=args.device, drafter_dtype=args.dtype),
                            store=store, learning=learning)
    specs = ([drafter] if drafter is not None else []) + (pool or [])
    try:
        for spec in specs:
            engine.drafter(spec)  # load and check the tokenizer before generating anything
        return _generate(engine, args, drafter, pool, options, store, learning_versions(engine, args.tenant, specs) if learning else None)
    finally:
        engine.close()  # stops the learner thread, if any


def _generate(engine, args: argparse.Namespace, drafter, pool, options, store, learn_before: dict | None) -> int:
    from specpool.cli.learning import finish_learning, learning_line

    prompt_ids = engine.encode_prompt(args.prompt, raw=args.raw)
    params = _sampling_params(args, engine.stop_token_ids())
    pieces: list[str] = []  # --json: the answer, printed at the end

    def write(text: str) -> None:  # streaming: each piece as soon as its characters are complete
        sys.stdout.write(text)
        sys.stdout.flush()

    trace_line = _trace_printer() if args.trace else None
    try:
        result = engine.generate(prompt_ids, params, drafter, k=args.k, session_id=args.session, policy=args.policy,
                                 pool=pool, tenant=args.tenant, policy_options=options, on_round=trace_line,
                                 on_text=pieces.append if args.json else write)
    finally:
        store.close()
    stats = {
        "new_tokens": len(result.token_ids),
        "rounds": len(result.rounds),
        "mean_accepted_length": round(result.mean_accepted_length, 4),
        "tokens_per_s": round(result.tokens_per_s, 3),
        "drafters": result.rounds_by_drafter(),
        "policy": args.policy or f"fixed:{drafter or 'none'}",
    }
    if learn_before is not None:  # --learn: apply this request's feedback and publish before exiting
        stats["learning"] = finish_learning(engine, args.tenant, learn_before)
    if args.json:
        print(json.dumps({"text": "".join(pieces), "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "stats": stats}))
    else:
        print(
            f"\n[{stats['new_tokens']} new tokens, {stats['rounds']} rounds, "
            f"mean accepted length {stats['mean_accepted_length']:.2f}, {stats['tokens_per_s']:.1f} tokens/s, "
            f"finish: {result.finish_reason}]"
        )
        if "learning" in stats:
            print(learning_line(stats["learning"], args.tenant), flush=True)
    return 0


def _trace_printer():
    """``--trace``: one compact line per round on stderr, so stdout keeps only the answer."""
    from specpool.router.policies import round_rewards

    counter = iter(range(1, 1 << 62))

    def print_round(record) -> None:
        # BD as the policies see it: over the k positions asked for (specpool/router/policies.py).
        bd = "-" if record.drafter is None or record.k == 0 else f"{round_rewards(record)['bd']:.2f}"
        source = f"  ({record.source})" if record.source else ""  # "(lookup)": made by the prompt lookup
        if record.replays:  # ucb-replay's side observations: what the other drafters would have had accepted
            source += "  replayed " + " ".join(f"{name}={n}" for name, n in record.replays.items())
        print(f"round {next(counter):>3}  drafter {record.drafter or 'none':<18} k {record.k}  "
              f"proposed {record.proposed}  accepted {record.accepted}  BD {bd}  {record.round_s * 1e3:.0f} ms{source}",
              file=sys.stderr, flush=True)

    return print_round


def cmd_models(args: argparse.Namespace, settings) -> int:
    from specpool.core.errors import NotFound
    from specpool.target.models import DEFAULT_TARGET, EMBEDDED_MODELS, fetch_embedded

    name = args.name or DEFAULT_TARGET
    if name not in EMBEDDED_MODELS:
        raise NotFound(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    import transformers

    transformers.utils.logging.enable_progress_bar()  # conversion is slow: show its progress
    path = fetch_embedded(name, settings.home)
    print(f"{name}: {path}")
    return 0


def cmd_zoo_train(args: argparse.Namespace, settings, argv: Sequence[str]) -> int:
    from pathlib import Path

    from specpool.learning.zoo_data import check_domain
    from specpool.learning.zoo_train import TrainConfig, check_output_dir, train_drafter
    from specpool.target.models import DEFAULT_TARGET

    from specpool.learning.zoo_data import DEFAULT_RECIPES
    from specpool.core.errors import InvalidArgument

    check_domain(args.domain)
    if bool(args.data) == bool(args.data_root):
        raise InvalidArgument("give either --data PATH... or --data-root DIR (the domain's default recipe)")
    data = args.data or [str(Path(args.data_root) / p) for p in DEFAULT_RECIPES[args.domain]]
    out = Path(args.out) if args.out else settings.home / "zoo" / ("heads" if args.arch == "eagle" else "drafters") / args.domain
    check_output_dir(out)
    if args.background:
        import subprocess

        log = out.with_suffix(".log")
        log.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "specpool.cli.main", *[a for a in argv if a != "--background"]]
        with open(log, "ab") as handle:
            proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        print(f"training {args.domain} in the background: pid {proc.pid}, log {log}; rerun with --resume after an interruption")
        return 0
    config = TrainConfig(
        domain=args.domain, data=tuple(data), steps=args.steps, seed=args.seed,
        max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        lr=args.lr, warmup=args.warmup, train_context_tokens=args.context_tokens, save_every=args.save_every,
        teacher_batch=args.teacher_batch, reduced_vocab=args.reduced_vocab, time_limit_s=max(args.time_limit, 0.0) * 60,
        teacher_time_limit_s=max(args.teacher_time_limit, 0.0) * 60, init_from=args.init_from,
    )
    if args.arch == "eagle":
        from dataclasses import replace

        from specpool.learning.eagle_train import HeadOptions, train_head

        options = HeadOptions(recipe=args.recipe, unroll=args.unroll, init_from=args.init_from,
                              regression_weight=args.regression_weight, reference_answers=args.reference_answers,
                              onpolicy_weight=args.onpolicy_weight, num_layers=args.head_layers,
                              storage=args.storage)
        metadata = train_head(replace(config, init_from=None), options, settings.home, out, args.resume,
                              args.target or DEFAULT_TARGET, device=args.device, teacher_only=args.teacher_only)
        if args.teacher_only:
            print(f"{args.domain}: teacher data with features for {metadata['teacher_prompts']} prompts in {metadata['store']}"
                  + (f"; {metadata['reference_pairs']} reference answers in {metadata['reference_store']}"
                     if metadata["reference_pairs"] else ""))
        else:
            print(f"{metadata['name']}: {out} (steps {metadata['steps']}, held-out tokens per round "
                  f"{metadata['best_heldout_acceptance']} at step {metadata['best_step']})")
        return 0
    metadata = train_drafter(config, settings.home, out, args.resume, args.target or DEFAULT_TARGET,
                             device=args.device, teacher_only=args.teacher_only)
    if args.teacher_only:
        print(f"{args.domain}: teacher data for {metadata['teacher_prompts']} prompts "
              f"({metadata['teacher_tokens']} answer tokens) in {metadata['store']}")
        return 0
    print(f"{metadata['name']}: {out} (steps {metadata['steps']}, final loss {metadata['final_loss']:.4f}, "
          f"best held-out loss {metadata['best_heldout_loss']} at step {metadata['best_step']})")
    return 0


def cmd_zoo_self_prompts(args: argparse.Namespace, settings) -> int:
    """``specpool zoo self-prompts``: specpool/learning/self_prompts.py."""
    from pathlib import Path

    from specpool.learning.self_prompts import SelfPromptConfig, check_output, write_self_prompts
    from specpool.target.models import DEFAULT_TARGET, ModelConfig, load_causal_lm

    config = SelfPromptConfig(count=args.count, seed=args.seed, batch_size=args.batch_size,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    config.check()  # before the model loads
    out = Path(args.out) if args.out else settings.home / "zoo" / "self-prompts.jsonl"
    check_output(out)
    model, tokenizer = load_causal_lm(ModelConfig(args.target or DEFAULT_TARGET, args.device, dtype="float32"), settings.home)
    report = write_self_prompts(model, tokenizer, out, config)
    print(f"{report['prompts']} self-written prompts in {out} ({report['dropped_unfinished']} unfinished and "
          f"{report['dropped_duplicate']} repeated requests dropped this run); train on them with "
          f"specpool zoo train --data {out} ...")
    return 0


def cmd_zoo_manifest(settings) -> int:
    import json

    from specpool.drafters import eagle
    from specpool.drafters.zoo import MANIFEST, REFERENCE_SETTINGS, SHIPPED_DIR, build_manifest, shipped_names
    from specpool.services.engine import EmbeddedEngine
    from specpool.target.models import DEFAULT_TARGET
    from specpool.target.sampling import SamplingParams

    engine = EmbeddedEngine.default(settings.home)
    # The black-box zoo (zoo:PATH) and the white-box heads (eagle:PATH), each with its manifest.
    for kind, folder, names, manifest_path in (("zoo", SHIPPED_DIR, shipped_names(), MANIFEST),
                                               ("eagle", eagle.SHIPPED_DIR, eagle.shipped_heads(), eagle.MANIFEST)):
        if not names:
            continue

        def measure(name: str, prompt: str) -> float:
            params = SamplingParams(max_new_tokens=REFERENCE_SETTINGS["max_new_tokens"], stop_token_ids=engine.stop_token_ids())
            result = engine.generate(engine.encode_prompt(prompt), params, f"{kind}:{folder / name}", k=REFERENCE_SETTINGS["k"])
            return result.mean_accepted_length

        manifest = build_manifest(names, DEFAULT_TARGET, engine.verifier.tokenizer_fingerprint, measure, folder)
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        total = sum((folder / n / f).stat().st_size for n in names for f in manifest["drafters"][n]["files"])
        print(f"wrote {manifest_path}: {len(names)} {'drafters' if kind == 'zoo' else 'white-box heads'}, {total / 1e6:.1f} MB")
    return 0


def cmd_bench(args: argparse.Namespace, settings) -> int:
    """``specpool bench``: bench/cli.py of the checkout, or the one-line hint where it is missing."""
    return load_bench("cli", "bench").run_bench(args, settings)


def cmd_zoo_eval(args: argparse.Namespace, settings) -> int:
    """``specpool zoo eval``: bench/zoo_eval.py of the checkout, or the one-line hint where it is missing."""
    return load_bench("zoo_eval", "zoo eval").run_zoo_eval(args, settings)


def main(argv: Sequence[str] | None = None) -> int:
    from specpool.services.config import settings_from_env

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    settings = settings_from_env()
    try:
        _quiet_libraries()
        if args.command == "generate":
            return cmd_generate(args, settings)
        if args.command == "models":
            return cmd_models(args, settings)
        if args.command == "zoo" and args.zoo_command == "train":
            return cmd_zoo_train(args, settings, argv)
        if args.command == "zoo" and args.zoo_command == "self-prompts":
            return cmd_zoo_self_prompts(args, settings)
        if args.command == "zoo" and args.zoo_command == "manifest":
            return cmd_zoo_manifest(settings)
        if args.command == "zoo" and args.zoo_command == "eval":
            return cmd_zoo_eval(args, settings)
        if args.command == "bench":
            return cmd_bench(args, settings)
        if args.command == "learner":
            from specpool.cli.learning import run_learner_command

            return run_learner_command(args, settings)
        if args.command in ("serve", "client", "bench-served", "keys"):
            from specpool.cli.served import run_served_command

            return run_served_command(args, settings)
    except SpecpoolError as exc:
        print(f"specpool: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("specpool: interrupted", file=sys.stderr)
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
