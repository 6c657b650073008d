"""``specpool bench`` with extra white-box kinds: the runner-up-leaf and tree settings of
bench/results/white-box-leaves, side by side with the shipped kinds.

    python -m bench.leaf_sweep bench --prompts ../shared/data/prompts/dev.jsonl --limit-per-category 4 \\
        --max-new-tokens 64 -k 5 --drafters lookup:eagle:general,lookup:eagle-alt3p05r3:general --out DIR

Each kind below is ``eagle-...:NAME``, the head of ``eagle:NAME`` with the settings of its row
(``EagleDrafter``'s arguments); any ``specpool`` command follows (argv as the CLI's). They are
registered in this process only: the package ships ``eagle-alt`` (its defaults are the sweep's
choice, specpool/drafters/eagle.py) and ``eagle-tree``.
"""

from __future__ import annotations

import sys

from specpool.cli.main import main
from specpool.drafters import eagle
from specpool.drafters.registry import register_drafter

# kind suffix -> EagleDrafter arguments: altD-pP-rR = runner-up leaves at D depths, at least 0.P,
# R a depth; treeNbB = EAGLE-2's tree of N nodes expanding B nodes a level.
SWEEP = {
    "alt5p05": dict(alternatives=5, alt_min_prob=0.05, alt_per_depth=1),
    "alt5p02": dict(alternatives=5, alt_min_prob=0.02, alt_per_depth=1),
    "alt3p10": dict(alternatives=3, alt_min_prob=0.10, alt_per_depth=1),
    "alt5p10": dict(alternatives=5, alt_min_prob=0.10, alt_per_depth=1),
    "alt5p05r2": dict(alternatives=5, alt_min_prob=0.05, alt_per_depth=2),
    "alt5p03r2": dict(alternatives=5, alt_min_prob=0.03, alt_per_depth=2),
    "alt3p05r3": dict(alternatives=3, alt_min_prob=0.05, alt_per_depth=3),
    "alt5p05r3": dict(alternatives=5, alt_min_prob=0.05, alt_per_depth=3),
    # The shipped leaves (alt3p05r3) with a lower confidence stop (c02: 0.2, c0: never), or int8 kernels.
    "altc02": dict(alternatives=3, alt_min_prob=0.05, alt_per_depth=3, confidence_threshold=0.2),
    "altc01": dict(alternatives=3, alt_min_prob=0.05, alt_per_depth=3, confidence_threshold=0.1),
    "altc0": dict(alternatives=3, alt_min_prob=0.05, alt_per_depth=3, confidence_threshold=0.0),
    "altint8": dict(alternatives=3, alt_min_prob=0.05, alt_per_depth=3, precision="int8"),
    "tree6b2": dict(tree_nodes=6, tree_beam=2),
    "tree8b2": dict(tree_nodes=8, tree_beam=2),
    "tree10b3": dict(tree_nodes=10, tree_beam=3),
}


def register_sweep() -> None:
    for suffix, options in SWEEP.items():
        def make(name: str, argument: str, context, options=options):
            return eagle._head_drafter(name, argument, context, **options)
        register_drafter(f"eagle-{suffix}")(make)


if __name__ == "__main__":
    register_sweep()
    sys.exit(main(sys.argv[1:]))
