"""A white-box head's draft, its own layers packed (``InferenceLinear``) against plain ``F.linear``.

    python -m bench.drafter_layers --threads 2 --out bench-results/drafter-layers

Why: a drafter's own layers (the fusion, the block's projections) keep training while they serve,
so they were left as ``nn.Linear``; float32 ``F.linear`` is slow for the 2 to 8 rows of a catch-up
forward (specpool/target/cpu_linear.py). ``InferenceLinear`` packs them for oneDNN in inference and
packs again after each change. Here one process alternates the two (the output head is packed in
both, as it was before): per repetition, ``--rounds`` rounds of ``EagleDrafter.propose`` on the
shipped head (k = 5, no confidence stop, 2 accepted positions a round after a 120-token context),
the order swapped every repetition. Reports the median ms per propose and the per-repetition ratio
packed / plain, median [p25, p75]; the drafts of both are compared too.

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


def plain_forward(self: InferenceLinear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight, self.bias)


def draft_rounds(head, metadata: dict, packed: bool, rounds: int) -> tuple[float, list[list[int]]]:
    """ms per propose over ``rounds`` rounds of one session, and the drafts."""
    InferenceLinear.forward = PACKED_FORWARD if packed else plain_forward
    try:
        drafter = EagleDrafter("eagle:bench", head, metadata, confidence_threshold=0.0)
        generator = torch.Generator().manual_seed(0)
        d = head.config.hidden_size
        context = torch.randint(0, 1000, (120,), generator=generator).tolist()
        drafter.observe_features("s", Features(0, torch.randn(119, d, generator=generator)))
        drafter.propose("s", context, 5, GREEDY)  # the prompt's catch-up: not timed
        drafts, started = [], time.perf_counter()
        for _ in range(rounds):
            drafter.observe_features("s", Features(len(context) - 1, torch.randn(2, d, generator=generator)))
            context = context + [5, 6]
            drafts.append(drafter.propose("s", context, 5, GREEDY).tokens)
        return (time.perf_counter() - started) / rounds * 1e3, drafts
    finally:
        InferenceLinear.forward = PACKED_FORWARD


def main(argv: list[str] | None = None) -> int:
    parser = head_bench_parser("python -m bench.drafter_layers", __doc__, "drafter-layers",
                               "shipped head (or head folder) that drafts")
    parser.add_argument("--rounds", type=int, default=40, help="propose calls per repetition (default 40)")
    parser.add_argument("--repetitions", type=int, default=12, help="repetitions of each (default 12)")
    args = parser.parse_args(argv)
    head, metadata = load_bench_head(args)
    times: dict[bool, list[float]] = {True: [], False: []}
    ratios, same = [], True
    for repetition in range(args.repetitions):
        got = {}
        for packed in ((True, False) if repetition % 2 == 0 else (False, True)):
            got[packed] = draft_rounds(head, metadata, packed, args.rounds)
            times[packed].append(got[packed][0])
        ratios.append(got[True][0] / got[False][0])
        same = same and got[True][1] == got[False][1]
    results = {"machine": machine_info("cpu"), "head": args.head, "rounds": args.rounds,
               "repetitions": args.repetitions, "packed_ms_per_propose": round(statistics.median(times[True]), 2),
               "plain_ms_per_propose": round(statistics.median(times[False]), 2),
               "packed_over_plain": {k: round(v, 3) for k, v in summary(ratios).items()}, "identical_drafts": same}
    print(json.dumps(results), flush=True)
    print(f"wrote {write_results(args.out, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
