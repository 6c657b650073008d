"""Grouped-query attention read in place (specpool/target/attention.py) against transformers' SDPA,
which copies the key heads for every masked forward, on the real target.

    python -m bench.grouped_attention --out bench-results/grouped-attention

Two copies of the default target, float32 on the CPU: system G (the grouped implementation that
``load_causal_lm`` gives every SDPA model) and system S (``_attn_implementation = "sdpa"``,
transformers' own). For each draft count d (forward width d + 1, padded to the CPU's forward
widths as ever), both verify the same request through ``TargetVerifier.verify``, the first draft
wrong so both roll back to the same cache, alternating G S / S G, cycling over one prompt per
category (``bench.verify_width.alternate_verifications``). d = 0 is a decode step, which both
compute alike; each system's verify cost is also given in its own decode steps, the ratio that
decides whether speculation pays. Widths up to 16 cover the runner-up leaves and draft trees.

Then target-only greedy decoding by both, alternating (``bench.cpu_linear.target_only_decoding``):
tokens/s G / S per prompt, and whether both say the same tokens.

Writes results.json and report.md to --out.
"""

from __future__ import annotations

from bench.cpu_linear import compare_verifiers, parse_pair_args, render_pair
from specpool.services.config import settings_from_env
from specpool.target.attention import GROUPED_SDPA
from specpool.target.models import ModelConfig, load_causal_lm
from specpool.target.verifier import TargetVerifier

DRAFT_COUNTS = (0, 1, 2, 3, 4, 5, 7, 9, 11, 15)


def render(results: dict) -> str:
    return render_pair(results, "Grouped-query attention in place vs transformers' SDPA",
                       f"`TargetVerifier.verify` on two copies of {results['target']} (float32, oneDNN-packed linears): "
                       "G = the grouped implementation (`specpool/target/attention.py`, the default), S = transformers' SDPA "
                       "(copies the 3 key heads to 9 for every masked forward); the verifier's CPU forward widths", digits=3)


def main(argv: list[str] | None = None) -> int:
    args = parse_pair_args("python -m bench.grouped_attention", __doc__.split("\n\n")[0], "grouped-attention", 30, argv)
    home = settings_from_env().home
    verifiers = {}
    for system in ("G", "S"):
        model, tokenizer = load_causal_lm(ModelConfig(), home)
        if system == "S":
            model.config._attn_implementation = "sdpa"
        verifiers[system] = TargetVerifier(model, tokenizer)
    if verifiers["G"].model.config._attn_implementation != GROUPED_SDPA:
        raise SystemExit("python -m bench.grouped_attention: the target does not run SDPA attention: nothing to compare")
    return compare_verifiers("python -m bench.grouped_attention", argv, args, verifiers, "grouped vs sdpa", render,
                             DRAFT_COUNTS)


if __name__ == "__main__":
    raise SystemExit(main())
