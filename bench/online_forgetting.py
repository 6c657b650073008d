"""The online benchmark's forgetting check: after the stream, the drafter's shipped weights and
each learning system's final version draft for the first prompts of the drafter's own Spec-Bench
categories, greedy; a version that forgot its domain shows as a ratio below the shipped weights'.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import IN_DOMAIN_DRAFTERS, load_prompts
from specpool.core.errors import check
from specpool.learning.hot_swap import DrafterSlot
from specpool.learning.model_store import VariantKey, open_model_store
from specpool.target.sampling import SamplingParams


def forgetting_categories(args: argparse.Namespace) -> list[str]:
    """The categories of the check: --forgetting-categories, else those whose in-domain drafter
    (bench/common.py) is the stream's drafter; [] when the check is off or has none."""
    if args.forgetting_per_category <= 0:
        return []
    if args.forgetting_categories:
        return [c.strip() for c in args.forgetting_categories.split(",") if c.strip()]
    return [c for c, d in IN_DOMAIN_DRAFTERS.items() if d == args.drafter]


def forgetting_prompts(path: Path, categories: list[str], per_category: int) -> list[tuple[str, str]]:
    """(category, first turn) of the first ``per_category`` questions of each category."""
    check(path.is_file(), f"forgetting prompts {path} do not exist (give --forgetting-prompts, or --forgetting-per-category 0)")
    questions = load_prompts(path)
    picked = [(c, [q for qc, q in questions if qc == c][:per_category]) for c in categories]
    missing = [c for c, qs in picked if not qs]
    check(not missing, f"no prompts of category {', '.join(missing)} in {path}")
    return [(c, q) for c, qs in picked for q in qs]


def newest_store(out: Path, system: str) -> Path | None:
    """The model store a run of ``system`` left in ``out``/stores (the newest, if several)."""
    stores = sorted((out / "stores").glob(f"{system}-*"), key=lambda p: p.stat().st_mtime)
    return stores[-1] if stores else None


class _PinnedVersion:
    """Stands in for the engine's learning: every request drafts with one given drafter version
    and emits no feedback, so the check itself teaches nothing."""

    top_k = 0

    def __init__(self, name: str, drafter):
        self.name, self.drafter = name, drafter

    def prepare(self, tenant: str, drafters: dict):
        return {n: (self.drafter if n == self.name else d) for n, d in drafters.items()}, None


def run_forgetting_check(engine, args: argparse.Namespace, stores: dict[str, Path]) -> tuple[list[dict], int]:
    """Rows {system, category, version, mean_accepted_length, vs_frozen, n_prompts} for the shipped
    weights (system frozen) and each system's serving version in ``stores``; and the number of
    prompts whose greedy outputs differ between versions (must be 0)."""
    categories = forgetting_categories(args)
    if not categories:
        return [], 0
    questions = forgetting_prompts(Path(args.forgetting_prompts).expanduser(), categories, args.forgetting_per_category)
    base = engine.drafter(args.drafter)
    versions = {"frozen": (0, base)}
    for system, path in stores.items():
        slot = DrafterSlot(VariantKey("bench", args.drafter), base, open_model_store(path))
        slot.refresh()
        versions[system] = slot.pin()
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=engine.stop_token_ids())
    totals: dict[tuple[str, str], list[int]] = {}
    mismatches = 0
    saved = engine.learning
    try:
        for category, text in questions:
            ids = engine.encode_prompt(text)
            outputs = set()
            for system, (_, drafter) in versions.items():
                engine.learning = _PinnedVersion(args.drafter, drafter)
                result = engine.generate(ids, params, args.drafter, k=args.k, tenant="bench")
                outputs.add(tuple(result.token_ids))
                tokens, rounds = totals.setdefault((system, category), [0, 0])
                totals[(system, category)] = [tokens + len(result.token_ids), rounds + len(result.rounds)]
            mismatches += len(outputs) > 1
    finally:
        engine.learning = saved
    rows = []
    for (system, category), (tokens, rounds) in totals.items():
        mal = tokens / max(rounds, 1)
        frozen_tokens, frozen_rounds = totals[("frozen", category)]
        frozen = frozen_tokens / max(frozen_rounds, 1)
        rows.append({"system": system, "category": category, "version": versions[system][0],
                     "mean_accepted_length": round(mal, 4), "vs_frozen": round(mal / frozen, 4) if frozen else None,
                     "n_prompts": sum(1 for c, _ in questions if c == category)})
    return rows, mismatches
