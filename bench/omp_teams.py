"""One forward, timed on the thread that loaded the model and on a second thread, alternately.

    python -m bench.omp_teams --threads 2 --out bench-results/omp-teams

Why: a served replica loaded its model on Serve's init thread and ran every forward on its model
thread. Each thread that runs a parallel torch op holds its own OpenMP team of ``--threads``
threads, alive after its last op, so the process then held two teams on the machine's cores
(specpool/services/serve_app.py, ``_model_thread``). This measures that without Ray: the default
target (float32, CPU) decodes ``--draft`` tokens over a ``--context``-token cache, ``--forwards``
times per block, the blocks alternating between the main thread and one worker thread. The first
main-thread block runs before the worker has ever run torch: one team. Every later block, on
either thread, runs with two.

``--stray-op`` measures the second way to a second team: one parallel op on another thread. The
model thread does every forward, and between two blocks another thread encodes a 300-row prefill's
features once (what a target replica's event loop did in ``Verify``). A thread takes torch's
process-wide thread count at its first parallel op, and ``torch.set_num_threads`` on the model
thread had set it to ``--threads``, so that one op started a second team. Each variant runs in a
fresh process (a team, once started, stays): ``model-thread-only`` sets the count on the model
thread as the replicas did; ``latched`` is ``serve_app._model_thread``, which then puts the
process-wide count back to 1. The two alternate ``--alternations`` times.

Writes results.json (per block: the thread and the median forward, ms) to --out and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import default_out, machine_info
from specpool.core.defaults import DEFAULT_TARGET
from specpool.services.config import settings_from_env
from specpool.target.models import ModelConfig, load_causal_lm


def median_forward_ms(model, cache, draft: int, forwards: int, vocab: int) -> float:
    """Median time of ``forwards`` forwards of ``draft`` new tokens, each cropped back off the cache."""
    times = []
    for _ in range(forwards):
        tokens = torch.randint(0, vocab, (1, draft))
        started = time.perf_counter()
        with torch.no_grad():
            model(tokens, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - started)
        cache.crop(-draft)
    return statistics.median(times) * 1000


def model_with_cache(target: str, context: int):
    """The target (float32, CPU) and a KV cache of ``context`` random positions, built on the calling thread."""
    model, _ = load_causal_lm(ModelConfig(target, "cpu", dtype="float32"), settings_from_env().home)
    with torch.no_grad():
        cache = model(torch.randint(0, int(model.config.vocab_size), (1, context)), use_cache=True).past_key_values
    return model, cache


def write_results(results: dict, out: str, shown: dict) -> None:
    """results.json in ``out``; ``shown`` printed."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(shown))


def stray_op_blocks(latched: bool, threads: int, context: int, draft: int, forwards: int, target: str) -> dict:
    """One fresh process's medians: forwards on the model thread before and after another thread's
    one parallel op (see the module doc)."""
    from specpool.services.serve_app import _model_thread
    from specpool.target.features import Features, encode_features

    if latched:
        worker = _model_thread(threads, "model")
    else:
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        worker.submit(torch.set_num_threads, threads).result()

    model, cache = worker.submit(model_with_cache, target, context).result()
    vocab = int(model.config.vocab_size)
    before = worker.submit(median_forward_ms, model, cache, draft, forwards, vocab).result()
    encode_features(Features(0, torch.randn(300, int(model.config.hidden_size))))  # the stray op, on this thread
    after = worker.submit(median_forward_ms, model, cache, draft, forwards, vocab).result()
    worker.shutdown()
    return {"before_ms": round(before, 1), "after_ms": round(after, 1), "stray_thread_torch_threads": torch.get_num_threads()}


def _stray_op_child(conn, *args) -> None:
    conn.send(stray_op_blocks(*args))


def run_stray_op(args: argparse.Namespace) -> dict:
    """Both variants, each in a fresh spawned process, alternating."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    blocks = []
    for _ in range(args.alternations):
        for variant in ("model-thread-only", "latched"):
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_stray_op_child, args=(send, variant == "latched", args.threads, args.context,
                                                                  args.draft, args.forwards, args.target))
            child.start()
            blocks.append({"variant": variant, **receive.recv()})
            child.join()
    summary = {}
    for variant in ("model-thread-only", "latched"):
        mine = [b for b in blocks if b["variant"] == variant]
        summary[variant] = {"before_ms": statistics.median(b["before_ms"] for b in mine),
                            "after_ms": statistics.median(b["after_ms"] for b in mine)}
    return {"blocks": blocks, "medians": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the replica's)")
    parser.add_argument("--context", type=int, default=300, help="cached positions before each forward")
    parser.add_argument("--draft", type=int, default=6, help="tokens per forward (a k = 5 verify)")
    parser.add_argument("--forwards", type=int, default=15, help="forwards per block")
    parser.add_argument("--alternations", type=int, default=8, help="main-thread / worker-thread block pairs")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model (default: the embedded default)")
    parser.add_argument("--stray-op", action="store_true",
                        help="measure one parallel op on another thread instead, with and without serve_app._model_thread's latch")
    parser.add_argument("--out", default=default_out("omp-teams"))
    args = parser.parse_args(argv)
    if args.stray_op:
        results = {"machine": machine_info("cpu"), "config": vars(args), **run_stray_op(args)}
        write_results(results, args.out, results["medians"])
        return 0

    torch.set_num_threads(args.threads)
    model, cache = model_with_cache(args.target, args.context)
    vocab = int(model.config.vocab_size)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker")
    worker.submit(torch.set_num_threads, args.threads).result()  # (sets no team up: no parallel op)
    blocks = []
    for _ in range(args.alternations):
        blocks.append({"thread": "main", "ms": round(median_forward_ms(model, cache, args.draft, args.forwards, vocab), 1)})
        ms = worker.submit(median_forward_ms, model, cache, args.draft, args.forwards, vocab).result()
        blocks.append({"thread": "worker", "ms": round(ms, 1)})
    worker.shutdown()
    results = {"machine": machine_info("cpu"), "config": vars(args), "blocks": blocks,
               "one_team_ms": blocks[0]["ms"], "two_teams_median_ms": statistics.median(b["ms"] for b in blocks[1:])}
    write_results(results, args.out, {k: results[k] for k in ("blocks", "one_team_ms", "two_teams_median_ms")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
