"""A drafter's output head, plain ``F.linear`` against the oneDNN-packed kernel of ``FrozenOutput``.

    python -m bench.output_head --threads 2 --out bench-results/output-head

Why: the reduced-vocabulary output head (V_r x d, 8,192 x 576 for the shipped white-box heads) is
most of a small drafter's draft step, and float32 ``F.linear`` is slow there, worst at the 2 to 8
rows a draft tree's level or a catch-up forward has (specpool/target/cpu_linear.py,
``FrozenOutput``). For each row count, ``--calls`` calls of each kernel alternate in blocks on the
shipped general head's gathered weight and bias; medians of the blocks' per-call times, and the
largest difference between the two outputs.

Writes results.json to --out and prints it.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import head_bench_parser, load_bench_head, machine_info, write_results
from specpool.target.cpu_linear import FrozenOutput


def per_call_us(kernel, hidden: torch.Tensor, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        kernel(hidden)
    return (time.perf_counter() - started) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = head_bench_parser("python -m bench.output_head", __doc__, "output-head",
                               "shipped head (or head folder) whose output head is timed")
    parser.add_argument("--rows", default="1,2,4,8,16", help="row counts (default 1,2,4,8,16)")
    parser.add_argument("--calls", type=int, default=30, help="calls per block (default 30)")
    parser.add_argument("--blocks", type=int, default=9, help="blocks per kernel and row count (default 9)")
    args = parser.parse_args(argv)
    head, _ = load_bench_head(args)
    weight, bias = head.head_weight().detach(), head.head_bias.detach()
    packed = FrozenOutput()
    kernels = {"plain": lambda h: F.linear(h, weight, bias), "packed": lambda h: packed(h, weight, bias)}
    rows_out = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            hidden = torch.randn(rows, weight.shape[1])
            difference = float((kernels["plain"](hidden) - kernels["packed"](hidden)).abs().max())
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(args.blocks):
                for name, kernel in kernels.items():
                    kernel(hidden)  # warm
                    times[name].append(per_call_us(kernel, hidden, args.calls))
            row = {"rows": rows, "max_abs_difference": difference,
                   **{f"{name}_us": round(statistics.median(t), 1) for name, t in times.items()}}
            row["packed_over_plain"] = round(row["packed_us"] / row["plain_us"], 3)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    results = {"machine": machine_info("cpu"), "head": args.head, "weight": list(weight.shape),
               "calls": args.calls, "blocks": args.blocks, "rows": rows_out}
    print(f"wrote {write_results(args.out, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
