"""Online learning benchmark: drafters that learn from verification feedback on a stream of
prompts from a domain they were not trained on (issue 6).

    python -m bench.online --corpus ../shared/data/prose/gutenberg --drafter chat --limit 150

``--drafter`` is a zoo drafter or a white-box head (``eagle:general``: its feedback records carry
the target's features, and the learners train the head with the offline recipe's loss,
specpool/learning/online_heads.py). The prompts are passages of the corpus
(bench/online_stream.py). Every system answers every prompt, in one process, the order
rotating from prompt to prompt (A B C D, B C D A, ...):

    frozen       the shipped drafter, never updated
    ogd          online gradient descent on the distillation loss (specpool/learning/online.py)
    optimistic   optimistic OGD (hint = previous gradient)
    hedge        a Hedge-weighted ensemble of learning rates, mixed in output space

Each learning system has its own feedback stream, learner and model store (specpool/learning/learner.py).
By default the learner runs *between* requests (``commit_now`` after each prompt: that prompt's
feedback is applied and a version promoted, so the next prompt drafts with it) and its CPU time
is reported separately (``learner_s``): tokens/s is serving time only, as with a learner in a
separate process on other cores. ``--concurrent`` lets the learner threads train while requests
run instead (all on the same cores). ``--learner-process REDIS_URL`` measures *net* tokens/s: each
learning system sends its feedback to its own Redis stream, read by its own ``specpool learner``
process on the same machine (bench/online_learner.py), which runs only while its system serves,
so each system's tokens/s includes what its learner takes from serving; drafters pick up promoted
versions between requests. The learner's CPU seconds are reported as ``learner_cpu_s``.

Writes results.json (rows: system, segment = first_third | last_third | all, mean_accepted_length,
tokens_per_s, n_prompts), per_prompt.jsonl, report.md and learning_curves.png (bench/online_report.py).
The report also gives each learning system's ratios to frozen paired by prompt: the per-prompt
median with its interquartile range, and a 95 % bootstrap interval (over prompts) of the pooled ratio.

Forgetting check (bench/online_forgetting.py): after the stream, the drafter's shipped weights and
each system's final learned version draft for the first ``--forgetting-per-category`` prompts of
the drafter's own Spec-Bench categories (``--forgetting-prompts``, default dev.jsonl; chat for the
chat drafter), greedy; forgetting.json holds each version's mean accepted length there and its
ratio to the shipped weights (the target: within 5 %). ``--forgetting-only`` runs just this check
on the stores an earlier run left in ``--out``.

Modules: online_stream (prompts), online_args (options, ``specpool bench --online``),
online_learner (learner processes), online_forgetting, online_report; this one runs the stream.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from bench.common import WARMUP_PROMPT, WARMUP_TOKENS, machine_info
from bench.online_args import add_online_arguments, command_line
from bench.online_forgetting import forgetting_categories, newest_store, run_forgetting_check
from bench.online_learner import LearnerProcess, delete_streams
from bench.online_report import (FORGETTING_HEADING, SYSTEMS, render, render_spread, rerender, spread, write_forgetting,
                                 write_results)
from bench.online_stream import stream_prompts
from specpool.core.errors import check
from specpool.learning.learner import EmbeddedLearning
from specpool.learning.learning_config import LearningConfig
from specpool.learning.online import OnlineConfig, parse_step_sizes
from specpool.services.config import settings_from_env
from specpool.services.engine import EmbeddedEngine, EngineConfig
from specpool.target.models import DEFAULT_TARGET, ModelConfig
from specpool.target.sampling import SamplingParams, validate_draft_length


def run_online_bench(args: argparse.Namespace, settings) -> int:
    """The whole benchmark of ``args``: the stream, the forgetting check and the report. Exit
    status 0, or 1 when outputs differ between systems (greedy: each must be the target's own)."""
    systems = check_options(args)
    prompts = stream_prompts(Path(args.corpus).expanduser(), args.limit)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    target = args.target or DEFAULT_TARGET

    print(f"specpool bench --online: {len(prompts)} prompts, drafter {args.drafter}, systems {', '.join(systems)}", file=sys.stderr)
    dtype = getattr(args, "dtype", "auto")  # (specpool bench --dtype; python -m bench.online has none)
    engine = EmbeddedEngine(EngineConfig(home=settings.home, target=ModelConfig(target, args.device, dtype),
                                         drafter_device=args.device, drafter_dtype=dtype))
    engine.drafter(args.drafter)
    if args.forgetting_only:
        return forgetting_only(engine, args, systems, out)
    run_info = describe_run(args, target, len(prompts))
    (out / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")  # kept for a --rerender of a stopped run
    stream = OnlineStream.start(engine, args, systems, out, target, settings.home)
    records, mismatches = stream.run(prompts, out / "per_prompt.jsonl")

    forgetting, forgetting_mismatches = run_forgetting_check(
        engine, args, {s: Path(l.config.store) for s, l in stream.learnings.items() if l is not None})
    rows, plot = write_results(out, records)
    counters = {s: l.learner.counters for s, l in stream.learnings.items() if l is not None and l.learner is not None}
    counters.update(stream.learner_summaries)
    header = {
        **run_info,
        "prompts whose outputs differ between systems (must be 0)": mismatches,
        "learner counters": json.dumps(counters),
    }
    text = render(rows, header, plot) + render_spread(spread(records))
    if forgetting:
        text += write_forgetting(out, forgetting, forgetting_mismatches, command_line(args))
    (out / "report.md").write_text(text)
    print(text)
    return 0 if mismatches == 0 and forgetting_mismatches == 0 else 1


def check_options(args: argparse.Namespace) -> list[str]:
    """The systems to run; every option that can be checked before the model load is checked here."""
    validate_draft_length(args.k)
    check(args.limit >= 3, f"--limit must be >= 3 (the report compares thirds), got {args.limit}")
    process_mode = getattr(args, "learner_process", None) is not None
    check(not (process_mode and args.concurrent), "give --concurrent or --learner-process, not both")
    check(args.publish_every >= 1 and args.learner_threads >= 1, "--publish-every and --learner-threads must be >= 1")
    check(args.commit_after_s > 0, f"--commit-after-s must be > 0, got {args.commit_after_s}")
    check(args.batch_records >= 1 and args.context_tail >= 1, "--batch-records and --context-tail must be >= 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    check(bool(systems) and all(s in SYSTEMS for s in systems), f"--systems must name some of {', '.join(SYSTEMS)}")
    parse_step_sizes(args.hedge_lrs)
    return systems


def forgetting_only(engine, args: argparse.Namespace, systems: list[str], out: Path) -> int:
    """``--forgetting-only``: the check on the newest stores an earlier run left in ``out``; its
    section of that run's report.md is replaced."""
    stores = {s: newest_store(out, s) for s in systems if s != "frozen"}
    stores = {s: path for s, path in stores.items() if path is not None}
    check(bool(stores), f"--forgetting-only: no model stores of {', '.join(systems)} in {out / 'stores'}")
    check(bool(forgetting_categories(args)), f"--forgetting-only: no category to check for drafter {args.drafter!r}; "
                                             "give --forgetting-categories and a --forgetting-per-category above 0")
    rows, mismatches = run_forgetting_check(engine, args, stores)
    text = write_forgetting(out, rows, mismatches, command_line(args))
    report = out / "report.md"
    if report.is_file():  # the run's report gets this check in place of an earlier one
        kept = report.read_text().split(FORGETTING_HEADING)[0].rstrip("\n") + "\n"
        report.write_text(kept + text)
    print(text)
    return 0 if mismatches == 0 else 1


def describe_run(args: argparse.Namespace, target: str, n_prompts: int) -> dict:
    """The report's header: the command, machine, models, decoding and where the learners run."""
    process_mode = getattr(args, "learner_process", None) is not None
    return {
        "command": command_line(args), "machine": json.dumps(machine_info(args.device)), "target": target,
        "drafter": args.drafter, "k": args.k, "temperature": 0.0, "max_new_tokens": args.max_new_tokens,
        "prompts": n_prompts, "corpus": args.corpus,
        "learner": ("separate processes, each running only while its system serves (tokens/s is net of learning; "
                    f"nice {args.learner_nice}{', SCHED_IDLE' if args.learner_idle else ''}, {args.learner_threads} torch thread(s), a version every "
                    f"{args.publish_every} records)" if process_mode else
                    "concurrent threads" if args.concurrent else "between requests (learner_s, not in tokens/s)"),
    }


@dataclass
class OnlineStream:
    """The systems of one run over one engine: each learning system's learning (its feedback
    stream, learner and model store) and, with --learner-process, its paused learner process."""

    engine: object
    args: argparse.Namespace
    systems: list[str]
    run_tag: str
    learnings: dict[str, EmbeddedLearning | None]
    processes: dict[str, LearnerProcess]
    previous_sigterm: object = None
    learner_summaries: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, engine, args: argparse.Namespace, systems: list[str], out: Path, target: str, home: Path) -> "OnlineStream":
        """Set up every system's learning; with --learner-process, start each learner process and
        wait until it reads its stream, then pause it."""
        run_tag = uuid.uuid4().hex[:8]
        process_mode = getattr(args, "learner_process", None) is not None
        base = LearningConfig(publish_every=10**9, commit_after_s=10**9 if not args.concurrent else 5.0,
                              batch_records=args.batch_records, context_tail=args.context_tail, drafters=(args.drafter,),
                              read_block_s=0.01,
                              online=OnlineConfig(lr=args.lr, hedge_lrs=parse_step_sizes(args.hedge_lrs),
                                                  precondition=args.precondition, grow_vocab=args.grow_vocab,
                                                  copy_window=args.copy_window, merge_records=args.merge_records,
                                                  detach_context=args.detach_context, supervision=args.supervision))
        stream = cls(engine, args, systems, run_tag, {}, {})
        if process_mode:  # SIGTERM unwinds like Ctrl-C, so the learners are resumed, stopped and reaped
            stream.previous_sigterm = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        for system in systems:
            if system == "frozen":
                stream.learnings[system] = None
                continue
            config = replace(base, store=str(out / "stores" / f"{system}-{run_tag}"),
                             online=replace(base.online, algorithm=system))
            if process_mode:  # feedback to Redis; the system's own learner process trains and publishes
                config = replace(config, feedback_url=args.learner_process, feedback_stream=f"specpool:bench:{run_tag}:{system}")
                stream.processes[system] = LearnerProcess(system, args, config.feedback_stream, config.store, target,
                                                          out / f"learner-{system}.log", home)
            stream.learnings[system] = EmbeddedLearning(config, home, continuous=args.concurrent)
        try:
            for process in stream.processes.values():
                process.wait_ready()
                process.pause()
        except BaseException:
            for process in stream.processes.values():
                process.stop(timeout_s=30)
            stream._restore_sigterm()
            raise
        return stream

    def run(self, prompts: list[str], raw_path: Path) -> tuple[list[dict], int]:
        """Every system on every prompt, order rotated per prompt; the records (written to
        ``raw_path`` as they come, so a stopped run can be --rerender-ed) and the number of
        prompts whose outputs differ between systems. The learners are stopped at the end."""
        engine, args, systems = self.engine, self.args, self.systems
        stop_ids = engine.stop_token_ids()
        encoded = [engine.encode_prompt(p) for p in prompts]
        warmup = engine.encode_prompt(WARMUP_PROMPT)
        for _ in systems:
            engine.learning = None
            engine.generate(warmup, SamplingParams(temperature=0.0, max_new_tokens=WARMUP_TOKENS, stop_token_ids=stop_ids),
                            args.drafter, k=args.k)
        records: list[dict] = []
        mismatches = 0
        try:
            with raw_path.open("w") as raw:
                for i in tqdm(range(len(prompts)), desc="bench online", unit="prompt", file=sys.stderr, dynamic_ncols=True):
                    shift = i % len(systems)
                    runs = [self.generate(s, encoded[i], i, stop_ids) for s in systems[shift:] + systems[:shift]]
                    outputs = {tuple(r.pop("token_ids")) for r in runs}
                    mismatches += len(outputs) > 1  # greedy: every system must give the target's own output
                    for r in sorted(runs, key=lambda r: systems.index(r["system"])):
                        records.append(r)
                        raw.write(json.dumps(r) + "\n")
                    raw.flush()  # a stopped run can still be reported (--rerender)
        finally:
            self.close()
        return records, mismatches

    def generate(self, system: str, ids: list[int], index: int, stop_ids) -> dict:
        """One request of ``system``, then its learning step (between requests) or its learner's
        CPU time (--learner-process): the per-prompt record, output tokens included."""
        engine, args = self.engine, self.args
        learning = self.learnings[system]
        engine.learning = learning
        params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stop_ids)
        process = self.processes.get(system)
        if process is not None:  # its learner runs beside this request, and only then
            process.check_alive()
            cpu = process.cpu_s()
            process.resume()
        started = time.perf_counter()
        result = engine.generate(ids, params, args.drafter, k=args.k, session_id=f"{self.run_tag}-{system}-{index}", tenant="bench")
        wall = time.perf_counter() - started
        learner_s = 0.0
        extra = {}
        if process is not None:
            process.pause()
            extra["learner_cpu_s"] = round(process.cpu_s() - cpu, 3)
        elif learning is not None:
            busy = learning.learner.busy_s
            if not args.concurrent:
                learning.commit_now(timeout=600)
            learner_s = learning.learner.busy_s - busy  # (concurrent: what it did meanwhile)
        slot = learning.slot("bench", args.drafter) if learning is not None else None
        return {"prompt_index": index, "system": system, "new_tokens": len(result.token_ids), "rounds": len(result.rounds),
                "wall_s": wall, "learner_s": learner_s, "version": slot.version if slot else 0,
                "mean_accepted_length": result.mean_accepted_length, "tokens_per_s": len(result.token_ids) / wall,
                "accepted": sum(r.accepted for r in result.rounds), "proposed": sum(r.proposed for r in result.rounds),
                **extra, "token_ids": result.token_ids}

    def close(self) -> None:
        """Stop the learner processes (their last log lines kept), close the learnings, drop the
        run's Redis streams."""
        self.engine.learning = None
        self.learner_summaries = {s: p.stop() for s, p in self.processes.items()}
        self._restore_sigterm()
        for learning in self.learnings.values():
            if learning is not None:
                learning.close()
        if self.processes:
            delete_streams(self.args.learner_process, [self.learnings[s].config.feedback_stream for s in self.processes])

    def _restore_sigterm(self) -> None:
        if self.previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self.previous_sigterm)
            self.previous_sigterm = None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rerender"]:
        check(len(argv) == 2, "usage: python -m bench.online --rerender DIR")
        return rerender(Path(argv[1]))
    parser = argparse.ArgumentParser(prog="python -m bench.online", description=__doc__.split("\n\n")[0],
                                     epilog="python -m bench.online --rerender DIR: the report again from DIR/per_prompt.jsonl "
                                            "(the raw per-prompt log of a run; committed results keep only its report)")
    add_online_arguments(parser)
    return run_online_bench(parser.parse_args(argv), settings_from_env())


if __name__ == "__main__":
    sys.exit(main())
