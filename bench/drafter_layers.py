"""A white-box head's draft with its layers in three kernels: oneDNN-packed float32
(``InferenceLinear``, the default), plain ``F.linear``, and int8 (``eagle-int8``).

    python -m bench.drafter_layers --threads 2 --out bench-results/drafter-layers

Why: a drafter's own layers (the fusion, the block's projections) keep training while they serve,
so they were left as ``nn.Linear``; float32 ``F.linear`` is slow for the 2 to 8 rows of a catch-up
forward (specpool/target/cpu_linear.py). ``InferenceLinear`` packs them for oneDNN in inference and
packs again after each change. ``eagle-int8`` runs the block and the output head with fbgemm's int8
linear instead (``EagleHead.set_draft_precision``): a draft step reads a quarter of the bytes.

One process cycles the kernels: per repetition, ``--rounds`` rounds of ``EagleDrafter.propose`` on
the shipped head (k = 5, no confidence stop, 2 accepted positions a round after a 120-token
context, random features), the order rotated every repetition. Reports the median ms per propose
and, per repetition, each kernel's time over packed's, median [p25, p75]; and how many draft tokens
each kernel drafted as packed did (plain computes the same numbers; int8 other, close ones).

Writes results.json to --out and prints it.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import head_bench_parser, load_bench_head, machine_info, summary, write_results
from specpool.drafters.eagle import EagleDrafter
from specpool.target.cpu_linear import InferenceLinear
from specpool.target.features import Features
from specpool.target.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)
PACKED_FORWARD = InferenceLinear.forward
KERNELS = ("packed", "plain", "int8")


def plain_forward(self: InferenceLinear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight, self.bias)


def draft_rounds(head, metadata: dict, kernel: str, rounds: int) -> tuple[float, list[list[int]]]:
    """ms per propose over ``rounds`` rounds of one session drafting with ``kernel``, and the drafts."""
    InferenceLinear.forward = plain_forward if kernel == "plain" else PACKED_FORWARD
    head.set_draft_precision("int8" if kernel == "int8" else "float32")
    try:
        drafter = EagleDrafter("eagle:bench", head, metadata, confidence_threshold=0.0)
        generator = torch.Generator().manual_seed(0)
        d = head.config.hidden_size
        context = torch.randint(0, 1000, (120,), generator=generator).tolist()
        drafter.observe_features("s", Features(0, torch.randn(119, d, generator=generator)))
        drafter.propose("s", context, 5, GREEDY)  # the prompt's catch-up (and the packing): not timed
        drafts, started = [], time.perf_counter()
        for _ in range(rounds):
            drafter.observe_features("s", Features(len(context) - 1, torch.randn(2, d, generator=generator)))
            context = context + [5, 6]
            drafts.append(drafter.propose("s", context, 5, GREEDY).tokens)
        return (time.perf_counter() - started) / rounds * 1e3, drafts
    finally:
        InferenceLinear.forward = PACKED_FORWARD
        head.set_draft_precision("float32")


def same_tokens(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of draft positions where two kernels drafted the same token."""
    pairs = [(x, y) for da, db in zip(a, b) for x, y in zip(da, db)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def main(argv: list[str] | None = None) -> int:
    parser = head_bench_parser("python -m bench.drafter_layers", __doc__, "drafter-layers",
                               "shipped head (or head folder) that drafts")
    parser.add_argument("--rounds", type=int, default=40, help="propose calls per repetition (default 40)")
    parser.add_argument("--repetitions", type=int, default=12, help="repetitions of each (default 12)")
    args = parser.parse_args(argv)
    head, metadata = load_bench_head(args)
    times: dict[str, list[float]] = {k: [] for k in KERNELS}
    ratios: dict[str, list[float]] = {k: [] for k in KERNELS if k != "packed"}
    agreement: dict[str, list[float]] = {k: [] for k in KERNELS if k != "packed"}
    for repetition in range(args.repetitions):
        order = KERNELS[repetition % 3:] + KERNELS[:repetition % 3]
        got = {kernel: draft_rounds(head, metadata, kernel, args.rounds) for kernel in order}
        for kernel in KERNELS:
            times[kernel].append(got[kernel][0])
        for kernel in ratios:
            ratios[kernel].append(got[kernel][0] / got["packed"][0])
            agreement[kernel].append(same_tokens(got[kernel][1], got["packed"][1]))
    results = {"machine": machine_info("cpu"), "head": args.head, "rounds": args.rounds,
               "repetitions": args.repetitions,
               **{f"{k}_ms_per_propose": round(statistics.median(times[k]), 2) for k in KERNELS},
               **{f"{k}_over_packed": {s: round(v, 3) for s, v in summary(ratios[k]).items()} for k in ratios},
               **{f"{k}_same_draft_tokens_as_packed": round(statistics.mean(agreement[k]), 4) for k in agreement}}
    print(json.dumps(results), flush=True)
    print(f"wrote {write_results(args.out, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
