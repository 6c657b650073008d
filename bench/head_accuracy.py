"""How well white-box heads guess the target, without a clock: per category, how often a head's
first draft is the target's greedy token when the head reads the target's true features (top-1,
and top-k: what runner-up leaves could catch), the share of the target's tokens its reduced
vocabulary cannot propose at all, and the tokens per round of its greedy chain (k drafts, no
confidence stop, ``specpool.learning.eagle_train.heldout_acceptance``: what ``EagleDrafter``
drafts from each answer position).

    python -m bench.head_accuracy --prompts ../shared/data/prompts/dev.jsonl --out DIR
    python -m bench.head_accuracy --prompts bench/prompts/heldout.jsonl --heads general --widen-vocab 16384,32768
    python -m bench.head_accuracy --prompts ../shared/data/prompts/dev.jsonl --out DIR --write-cards

Why: ``specpool bench`` times heads behind prompt lookup with a confidence stop and leaves, and
on a shared 2-core host its per-prompt ratios spread by ±10 %. These figures are deterministic
for a given torch build, take a minute, and say where a head loses: the first draft, the chain,
or a vocabulary without the token. The target answers each prompt greedily (batched
``generate``, as ``bench/feature_fusion.py`` does, prompts uncut), then one teacher-forced forward
records its final hidden states; every head reads those same features, in float32.

``--widen-vocab N``: each head also as a copy whose reduced vocabulary holds N ids, its own and
the lowest ids it lacks (a BPE tokenizer numbers pieces in merge order, so low ids are common
ones), with no training: the target's output rows are shared, and a new id's bias is the 25th
percentile of the head's own. It measures what a wider vocabulary buys before anyone trains one.

``--write-cards``: each shipped head's rows go into its model card, beside its held-out row (which
is measured on prompts of its own corpora and reads higher), one table per prompts file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import default_out, load_questions, machine_info, write_results
from bench.feature_fusion import answer, features_of
from specpool.core.defaults import DEFAULT_TARGET
from specpool.drafters.eagle import SHIPPED_DIR, head_folder, load_eagle_head, shipped_heads
from specpool.drafters.eagle_model import EagleHead
from specpool.learning.durable import atomic_write
from specpool.learning.eagle_train import FeatureSequence, acceptance_counts, head_card
from specpool.services.config import settings_from_env

NEW_ID_BIAS_QUANTILE = 0.25  # a widened head's bias for ids it never trained on (see the module docstring)


def widened(head: EagleHead, size: int) -> EagleHead:
    """A copy of ``head`` proposing ``size`` ids: its own, then the lowest ids it lacks."""
    own = head.vocab_ids.cpu()
    if size <= len(own):
        raise ValueError(f"--widen-vocab {size}: the head already proposes {len(own)} ids")
    if size > head.vocab_size:
        raise ValueError(f"--widen-vocab {size}: the target has only {head.vocab_size} ids")
    lacking = torch.ones(head.vocab_size, dtype=torch.bool)
    lacking[own] = False
    extra = lacking.nonzero().flatten()[: size - len(own)]
    bias = head.head_bias.detach().cpu()
    ids = torch.cat([own, extra])
    biases = torch.cat([bias, torch.full((len(extra),), float(bias.quantile(NEW_ID_BIAS_QUANTILE)))])
    order = ids.argsort()  # ascending ids, as training builds them
    wide = EagleHead(replace(head.config, reduced_vocab=size), head.embedding, ids[order], head.output)
    state = {k: v for k, v in head.state_dict().items() if k not in ("vocab_ids", "head_bias")}
    missing = wide.load_state_dict(state, strict=False).missing_keys
    assert sorted(missing) == ["head_bias", "vocab_ids"], missing
    with torch.no_grad():
        wide.head_bias.copy_(biases[order])
    return wide.eval()


@torch.inference_mode()
def first_drafts(head: EagleHead, s: FeatureSequence, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each answer position j of ``s`` (from max(P, fs + 2), where the head has read at least
    one true feature): the head's ``top_k`` likeliest first drafts (A, top_k), best first, when
    the context is x_0..x_{j-1} (head row j-2 reads x_{j-1} and the target's f_{j-2}, as
    ``EagleDrafter`` does after a verify), and the target's token x_j (A,)."""
    L, P, fs = len(s.tokens), s.answer_start, s.feature_start
    first = max(P, fs + 2)
    if L - 1 < first:
        return torch.zeros((0, top_k), dtype=torch.long), torch.zeros(0, dtype=torch.long)
    ids = s.tokens[fs + 1:L - 1].to(head.device)  # x_{fs+1} .. x_{L-2}: rows fs .. L-3
    feats = s.features[: L - 2 - fs].float().to(head.device)  # f_fs .. f_{L-3}
    guesses = head(ids[None], feats[None])[0]  # (L-2-fs, d): row t guesses f_{t+1}, the source of x_{t+2}
    rows = guesses[first - 2 - fs:]  # rows first-2 .. L-3 -> positions first .. L-1
    top = head.reduced_logits(rows).topk(min(top_k, len(head.vocab_ids)), dim=-1).indices
    return head.vocab_ids[top].cpu(), s.tokens[first:L]


def score(head: EagleHead, s: FeatureSequence, top_ks: Sequence[int], k: int, starts: int) -> dict:
    """One head on one sequence, as counts (so groups of sequences add up): answer tokens scored,
    first drafts among the top-k, tokens outside the head's vocabulary, the chain's accepted
    drafts and rounds."""
    guesses, truth = first_drafts(head, s, max(top_ks))
    accepted, rounds = acceptance_counts(head, [s], k=k, starts=starts)
    return {"tokens": len(truth), "outside": int((head.reduced_index().cpu()[truth] == 0).sum()),
            "hits": {t: int((guesses[:, :t] == truth[:, None]).any(dim=-1).sum()) for t in top_ks},
            "accepted": accepted, "rounds": rounds}


def summarize(scores: Sequence[dict]) -> dict:
    """A report row from sequences' ``score``s: top-k hit rates, the share outside the vocabulary,
    the chain's tokens per round (1 + accepted / rounds, as ``heldout_acceptance``)."""
    tokens = sum(sc["tokens"] for sc in scores)
    top_ks = scores[0]["hits"] if scores else {}
    return {
        "tokens": tokens,
        "top": {str(t): sum(sc["hits"][t] for sc in scores) / max(tokens, 1) for t in top_ks},
        "outside_vocab": sum(sc["outside"] for sc in scores) / max(tokens, 1),
        "chain_tokens_per_round": 1.0 + sum(sc["accepted"] for sc in scores) / max(sum(sc["rounds"] for sc in scores), 1),
    }


def measure(head: EagleHead, sequences: Sequence[FeatureSequence], top_ks: Sequence[int], k: int,
            starts: int) -> dict:
    """One head over one group of sequences: ``summarize`` of their ``score``s."""
    return summarize([score(head, s, top_ks, k, starts) for s in sequences])


def render(results: dict) -> str:
    m, top_ks = results["machine"], results["top_k"]
    lines = [
        "# White-box heads: first-draft accuracy, vocabulary and chain (clock-free)",
        "",
        f"- **machine**: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, transformers {m['transformers']}",
        f"- **target**: `{results['target']}` (float32), greedy answers of at most {results['max_new_tokens']} tokens",
        f"- **prompts**: {results['prompts_count']} from `{results['prompts']}` (first {results['limit_per_category']} per category)",
        f"- **command**: `{results['command']}`",
        "",
        "*top-k*: share of answer tokens that are among the head's k likeliest first drafts when the head "
        "reads the target's true features (top-1 is what a chain's first draft gets right; top-2.. what "
        "runner-up leaves could add). *outside vocab*: share of answer tokens the head's reduced vocabulary "
        f"cannot propose. *chain*: tokens per round of the head's greedy chain, k = {results['k']}, no "
        "confidence stop, drafted from every answer position (true features before it, its own guesses "
        "after). No prompt lookup, no leaves, no timing.",
        "",
        "| category | head | answer tokens | " + " | ".join(f"top-{t}" for t in top_ks) + " | outside vocab | chain tokens / round |",
        "|---|---|---:|" + "---:|" * len(top_ks) + "---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(f"| {row['category']} | `{row['head']}` | {row['tokens']} | {_measures(row, top_ks)} |")
    best = best_heads(results["rows"])
    if best:
        lines += ["", f"Best head by top-{min(top_ks)} per category: "
                  + ", ".join(f"{c} `{h}` ({v:.3f})" for c, (h, v) in best.items()) + "."]
    return "\n".join(lines) + "\n"


def _measures(row: dict, top_ks: Sequence[int]) -> str:
    """A row's top-k rates, vocabulary misses and chain as Markdown cells (the report's and the cards')."""
    return (" | ".join(f"{row['top'][str(t)]:.3f}" for t in top_ks)
            + f" | {row['outside_vocab']:.1%} | {row['chain_tokens_per_round']:.2f}")


def best_heads(rows: Sequence[dict]) -> dict[str, tuple[str, float]]:
    """category -> (head, rate) of the head with the highest top-k rate there, k the smallest reported
    (top-1 by default; categories in row order)."""
    best: dict[str, tuple[str, float]] = {}
    for row in rows:
        top1 = row["top"][min(row["top"], key=int)]
        if row["category"] not in best or top1 > best[row["category"]][1]:
            best[row["category"]] = (row["head"], top1)
    return best


def card_table(results: dict, head: str) -> str:
    """``head``'s rows of a run as the Markdown its model card shows, with the command that made them."""
    top_ks, m = results["top_k"], results["machine"]
    lines = [f"From `{results['command']}` ({m['cpu']}, {m['cores']} cores; {results['prompts_count']} prompts, "
             f"greedy answers of at most {results['max_new_tokens']} tokens, chain k = {results['k']}):", "",
             "| category | answer tokens | " + " | ".join(f"top-{t}" for t in top_ks) + " | outside vocab | chain tokens / round |",
             "|---|---:|" + "---:|" * len(top_ks) + "---:|---:|"]
    for row in results["rows"]:
        if row["head"] == head:
            lines.append(f"| {row['category']} | {row['tokens']} | {_measures(row, top_ks)} |")
    return "\n".join(lines)


def write_cards(results: dict, shipped_dir: Path = SHIPPED_DIR) -> list[str]:
    """Put each shipped head's rows of this run into its model card (``config.json``'s
    ``acceptance_rows``, keyed by the prompts file, and README.md), as ``specpool zoo eval
    --write-cards`` does for the black-box zoo; a later run on other prompts adds its own rows
    beside them. Heads given as paths and widened copies are left alone. Returns the heads written."""
    written = []
    evaluated = {row["head"] for row in results["rows"]}
    for name in sorted(evaluated):
        folder = shipped_dir / name
        if folder.parent != shipped_dir or not (folder / "config.json").is_file():  # a path, or a widened copy
            continue
        metadata = json.loads((folder / "config.json").read_text())
        metadata.setdefault("acceptance_rows", {})[results["prompts"]] = card_table(results, name)
        metadata.pop("acceptance_row", None)  # superseded by the rows
        atomic_write(folder / "config.json", (json.dumps(metadata, indent=2) + "\n").encode())
        atomic_write(folder / "README.md", head_card(metadata).encode())
        written.append(name)
    return written


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise SystemExit(f"{what} must be positive, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.head_accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=Path, required=True, help="Spec-Bench question file (.jsonl)")
    ap.add_argument("--limit-per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--heads", default=",".join(shipped_heads()), help="shipped head names or folders (default: every shipped head)")
    ap.add_argument("--widen-vocab", default="", help="also each head widened to these vocabulary sizes (comma-separated)")
    ap.add_argument("--top-k", default="1,2,4", help="first-draft hit rates to report (default 1,2,4)")
    ap.add_argument("-k", type=int, default=5, help="chain length for the chain's tokens per round (default 5)")
    ap.add_argument("--batch", type=int, default=8, help="prompts the target answers at once (default 8)")
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--out", default=default_out("head-accuracy"))
    ap.add_argument("--write-cards", action="store_true",
                    help="write each shipped head's rows into its model card (then rerun `specpool zoo manifest`)")
    args = ap.parse_args(argv)
    top_ks, sizes = parse_ints(args.top_k, "--top-k"), parse_ints(args.widen_vocab, "--widen-vocab")
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    if not heads or not top_ks or args.k < 1 or args.max_new_tokens < 1 or args.batch < 1:
        raise SystemExit("--heads and --top-k need at least one entry; -k, --max-new-tokens and --batch must be >= 1")
    from specpool.target.models import ModelConfig, load_causal_lm

    torch.set_num_threads(args.threads)
    home = settings_from_env().home
    questions = load_questions(args.prompts, args.limit_per_category)
    loaded = {name: load_eagle_head(head_folder(name), home, args.target)[0] for name in heads}  # bad names fail first
    model, tokenizer = load_causal_lm(ModelConfig(args.target, "cpu", dtype="float32"), home)
    window = int(model.config.max_position_embeddings)
    prompts = [q.prompt for q in questions]
    answers = answer(model, tokenizer, prompts, args.max_new_tokens, args.batch, tokenizer.eos_token_id, window)
    sequences = features_of(model, tokenizer, prompts, answers, (), context=window, top_k=1, max_prompt_tokens=window)
    del model
    systems: dict[str, EagleHead] = {}
    for name, head in loaded.items():
        systems[name] = head
        for size in sizes:
            systems[f"{name} (vocab {size})"] = widened(head, size)
    categories = list(dict.fromkeys(q.category for q in questions))
    rows = []
    for name, head in tqdm(systems.items(), desc="heads", unit="head"):
        scores = [score(head, s, top_ks, args.k, starts=args.max_new_tokens + 1) for s in sequences]  # once a sequence
        for category in [*categories, "all"]:
            chosen = [sc for sc, q in zip(scores, questions) if category in ("all", q.category)]
            rows.append({"category": category, "head": name, **summarize(chosen)})
    results = {
        "command": "python -m bench.head_accuracy " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info("cpu"), "target": args.target, "prompts": str(args.prompts),
        "prompts_count": len(questions), "limit_per_category": args.limit_per_category,
        "max_new_tokens": args.max_new_tokens, "k": args.k, "top_k": top_ks, "rows": rows,
    }
    write_results(args.out, results)
    (Path(args.out) / "report.md").write_text(render(results))
    print(render(results))
    print(f"wrote {args.out}/results.json, {args.out}/report.md")
    if args.write_cards:
        print(f"model cards updated: {', '.join(write_cards(results)) or 'none'} "
              "(run `specpool zoo manifest` to record their new hashes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
