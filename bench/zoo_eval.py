"""``specpool zoo eval``: the cross-domain acceptance matrix, drafters x prompt categories.

Each cell is a drafter's mean accepted length (tokens per round, bonus included) and mean block
divergence (BD = mean over draft positions of 1 - TV(p, q)) at draft length k, over the first
``--limit-per-category`` prompts of each category, greedy and again at temperature 0.7. A
heterogeneous pool shows up as a matrix whose best row differs from column to column.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from statistics import mean

from bench.common import default_out, load_questions, machine_info
from specpool.core.defaults import DEFAULT_K
from specpool.core.errors import InvalidArgument, NotFound, check

TEMPERATURES = (0.0, 0.7)


def add_zoo_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", required=True, help="Spec-Bench / MT-Bench question file")
    parser.add_argument("--drafters", default=None, help="comma-separated specs (default: every shipped zoo drafter, then ngram)")
    parser.add_argument("--limit-per-category", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft length (default {DEFAULT_K})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled (temperature 0.7) runs")
    parser.add_argument("--out", default=default_out("zoo"), help=f"output folder (default ./{default_out('zoo')} in the working directory)")
    parser.add_argument("--target", default=None, help="target model (default: the embedded default)")
    parser.add_argument("--write-cards", action="store_true",
                        help="write each shipped drafter's row into its model card (then rerun `specpool zoo manifest`)")


def aggregate_cells(records: list[dict]) -> list[dict]:
    """One row per (drafter, category, temperature) plus category "all"; pure, for tests."""
    groups: dict[tuple[str, str, float], list[dict]] = {}
    for rec in records:
        for category in (rec["category"], "all"):
            groups.setdefault((rec["drafter"], category, rec["temperature"]), []).append(rec)
    rows = []
    for (drafter, category, temperature), recs in groups.items():
        tokens, rounds = sum(r["new_tokens"] for r in recs), sum(r["rounds"] for r in recs)
        bds = [bd for r in recs for bd in r["bd"]]
        rows.append({
            "drafter": drafter, "category": category, "temperature": temperature,
            "mean_accepted_length": round(tokens / rounds, 4) if rounds else None,
            "mean_bd": round(mean(bds), 4) if bds else None,
            "n_prompts": len(recs),
        })
    return sorted(rows, key=lambda r: (r["temperature"], r["drafter"], r["category"] == "all", r["category"]))


def best_by_category(rows: list[dict], temperature: float, drafters: list[str] | None = None) -> dict[str, str]:
    """category -> the drafter with the highest mean accepted length (among ``drafters``)."""
    best: dict[str, tuple[float, str]] = {}
    for row in rows:
        if row["temperature"] != temperature or row["mean_accepted_length"] is None:
            continue
        if drafters is not None and row["drafter"] not in drafters:
            continue
        if row["category"] not in best or row["mean_accepted_length"] > best[row["category"]][0]:
            best[row["category"]] = (row["mean_accepted_length"], row["drafter"])
    return {category: name for category, (_, name) in best.items()}


def markdown_matrix(rows: list[dict], temperature: float, key: str) -> str:
    drafters = sorted({r["drafter"] for r in rows if r["temperature"] == temperature}, key=_drafter_order)
    categories = sorted({r["category"] for r in rows if r["category"] != "all"}) + ["all"]
    cell = {(r["drafter"], r["category"]): r[key] for r in rows if r["temperature"] == temperature}
    best = {c: max((cell.get((d, c)) or 0.0, d) for d in drafters)[1] for c in categories}
    lines = ["| drafter | " + " | ".join(categories) + " |", "|---|" + "---|" * len(categories)]
    for d in drafters:
        values = []
        for c in categories:
            v = cell.get((d, c))
            text = "–" if v is None else f"{v:.2f}"
            values.append(f"**{text}**" if best[c] == d and v is not None else text)
        lines.append(f"| `{d}` | " + " | ".join(values) + " |")
    return "\n".join(lines)


def _drafter_order(name: str) -> tuple[int, str]:
    return (1 if name.startswith("ngram") else 0, name)


def acceptance_row(rows: list[dict], drafter: str) -> str:
    """The drafter's row of the matrix as a small Markdown table, for its model card."""
    lines = []
    for temperature in TEMPERATURES:
        mine = {r["category"]: r for r in rows if r["drafter"] == drafter and r["temperature"] == temperature}
        if not mine:
            continue
        categories = sorted(c for c in mine if c != "all") + ["all"]
        if not lines:
            lines += ["| temperature | " + " | ".join(categories) + " |", "|---|" + "---|" * len(categories)]
        cells = [f"{mine[c]['mean_accepted_length']:.2f} (BD {mine[c]['mean_bd'] or 0:.2f})" for c in categories]
        lines.append(f"| {temperature} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_cards(rows: list[dict], source: str) -> list[str]:
    """Put each shipped drafter's acceptance row into its model card (README.md)."""
    from specpool.drafters.zoo import SHIPPED_DIR, shipped_names
    from specpool.learning.zoo_train import model_card

    written = []
    for name in shipped_names():
        row = acceptance_row(rows, name)
        if not row:
            continue
        metadata = json.loads((SHIPPED_DIR / name / "config.json").read_text())
        metadata["acceptance_row"] = f"Mean accepted length (and BD) per category, from `{source}`:\n\n{row}"
        (SHIPPED_DIR / name / "README.md").write_text(model_card(metadata))
        written.append(name)
    return written


def plot_heatmap(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(TEMPERATURES), figsize=(6 * len(TEMPERATURES), 4.5), squeeze=False)
    for ax, temperature in zip(axes[0], TEMPERATURES):
        sub = [r for r in rows if r["temperature"] == temperature]
        drafters = sorted({r["drafter"] for r in sub}, key=_drafter_order)
        categories = sorted({r["category"] for r in sub if r["category"] != "all"}) + ["all"]
        grid = np.full((len(drafters), len(categories)), np.nan)
        for r in sub:
            grid[drafters.index(r["drafter"]), categories.index(r["category"])] = r["mean_accepted_length"] or np.nan
        image = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
        ax.set_yticks(range(len(drafters)), drafters)
        for i in range(len(drafters)):
            for j in range(len(categories)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="white", fontsize=8)
        ax.set_title(f"mean accepted length, T = {temperature}")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_zoo_eval(args: argparse.Namespace, settings) -> int:
    from tqdm import tqdm

    from specpool.drafters.registry import known_spec
    from specpool.drafters.zoo import shipped_names
    from specpool.services.engine import EmbeddedEngine, EngineConfig
    from specpool.target.models import DEFAULT_TARGET, ModelConfig
    from specpool.target.sampling import SamplingParams, validate_draft_length

    validate_draft_length(args.k)
    check(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    questions = load_questions(Path(args.prompts).expanduser(), args.limit_per_category)
    specs = [s.strip() for s in args.drafters.split(",") if s.strip()] if args.drafters else shipped_names() + ["ngram"]
    check(bool(specs), "no drafters to evaluate")
    for spec in specs:
        if not known_spec(spec):
            raise NotFound(f"unknown drafter {spec!r}")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise InvalidArgument(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)

    target = args.target or DEFAULT_TARGET
    engine = EmbeddedEngine(EngineConfig(home=settings.home, target=ModelConfig(target)))
    for spec in specs:
        engine.drafter(spec)  # load everything (and check tokenizers) before measuring
    prompt_ids = [engine.encode_prompt(q.prompt) for q in questions]
    records = []
    jobs = [(t, i, s) for t in TEMPERATURES for i in range(len(questions)) for s in specs]
    for temperature, i, spec in tqdm(jobs, desc="zoo eval", unit="run", file=sys.stderr, dynamic_ncols=True):
        params = SamplingParams(temperature=temperature, seed=args.seed + i, max_new_tokens=args.max_new_tokens,
                                stop_token_ids=engine.stop_token_ids())
        result = engine.generate(prompt_ids[i], params, spec, k=args.k)
        records.append({
            "drafter": spec, "category": questions[i].category, "temperature": temperature,
            "question_id": questions[i].question_id, "new_tokens": len(result.token_ids),
            "rounds": len(result.rounds), "bd": [r.bd for r in result.rounds if r.bd is not None],
        })
    rows = aggregate_cells(records)
    command = shlex.join(["specpool", "zoo", "eval", *sys.argv[3:]]) if sys.argv[1:3] == ["zoo", "eval"] else "specpool zoo eval"
    machine = machine_info("cpu")
    (out / "matrix.json").write_text(json.dumps({
        "machine": machine,
        "config": {"target": target, "drafters": specs, "k": args.k, "max_new_tokens": args.max_new_tokens,
                   "temperatures": list(TEMPERATURES), "seed": args.seed, "prompts": str(args.prompts),
                   "limit_per_category": args.limit_per_category, "n_prompts": len(questions), "command": command},
        "rows": rows,
    }, indent=2) + "\n")
    sections = [f"# Zoo acceptance matrix\n\n- command: `{command}`\n- target: `{target}`, k = {args.k}, "
                f"{args.max_new_tokens} new tokens, {len(questions)} prompts ({args.limit_per_category} per category)\n"
                f"- machine: {machine['cpu']}, {machine['cores']} cores\n\nBold: best drafter of the column.\n"]
    for temperature in TEMPERATURES:
        sections.append(f"## Mean accepted length, temperature {temperature}\n\n{markdown_matrix(rows, temperature, 'mean_accepted_length')}\n")
        sections.append(f"## Mean BD, temperature {temperature}\n\n{markdown_matrix(rows, temperature, 'mean_bd')}\n")
    sections.append("![heatmap](heatmap.png)\n")
    (out / "matrix.md").write_text("\n".join(sections))
    plot_heatmap(rows, out / "heatmap.png", f"{target}, k={args.k}, {len(questions)} prompts")
    print(markdown_matrix(rows, 0.0, "mean_accepted_length"))
    print(f"\nwrote {out}/matrix.json, matrix.md, heatmap.png")
    if args.write_cards:
        print(f"model cards updated: {', '.join(write_cards(rows, command)) or 'none'}")
    return 0
