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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the replica's)")
    parser.add_argument("--context", type=int, default=300, help="cached positions before each forward")
    parser.add_argument("--draft", type=int, default=6, help="tokens per forward (a k = 5 verify)")
    parser.add_argument("--forwards", type=int, default=15, help="forwards per block")
    parser.add_argument("--alternations", type=int, default=8, help="main-thread / worker-thread block pairs")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model (default: the embedded default)")
    parser.add_argument("--out", default=default_out("omp-teams"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, _ = load_causal_lm(ModelConfig(args.target, "cpu", dtype="float32"), settings_from_env().home)
    vocab = int(model.config.vocab_size)
    with torch.no_grad():
        cache = model(torch.randint(0, vocab, (1, args.context)), use_cache=True).past_key_values
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("blocks", "one_team_ms", "two_teams_median_ms")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
