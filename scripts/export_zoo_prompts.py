"""Export the zoo's training prompts, one Spec-Bench-format JSONL file per domain.

The shipped drafters were trained on a GPU machine that cannot see ``../shared/data`` (only a
small working tree travels there). This writes exactly the prompts ``specpool zoo train`` would
take from each domain's default recipe, so ``--data OUT/DOMAIN.jsonl`` on that machine trains on
the same prompts as ``--data-root ../shared/data`` here. The general drafter's file mixes the
domain files (round-robin), so its teacher answers are all among the domains'.

    python scripts/export_zoo_prompts.py --data-root ../shared/data --out .dev/prompts
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specpool.learning.zoo_data import DEFAULT_RECIPES, collect_prompts

# Prompts per domain for the GPU run: everything the small corpora hold, a cap on the large ones.
GPU_PROMPTS = {"code": 4000, "math": 6000, "translation": 6000, "summarization_qa": 4000, "chat": 4000}
GENERAL_PROMPTS = 8000


def write_jsonl(path: Path, prompts: list[str]) -> None:
    with path.open("w") as handle:
        for n, prompt in enumerate(prompts):
            handle.write(json.dumps({"question_id": n, "category": path.stem, "turns": [prompt]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for domain, limit in GPU_PROMPTS.items():
        prompts = collect_prompts([Path(args.data_root) / p for p in DEFAULT_RECIPES[domain]], limit, args.seed)
        write_jsonl(out / f"{domain}.jsonl", prompts)
        files.append(out / f"{domain}.jsonl")
        print(f"{domain}: {len(prompts)} prompts")
    general = collect_prompts(files, GENERAL_PROMPTS, args.seed)
    write_jsonl(out / "general.jsonl", general)
    print(f"general: {len(general)} prompts")


if __name__ == "__main__":
    main()
