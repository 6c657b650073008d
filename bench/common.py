"""What the benchmarks share: prompt files, the machine description, warm-up, output folders, small
statistics. Imports no other benchmark module but the pure ``bench.report``, so every benchmark
can import it and bench/ has no cycle (bench/cli.py is the one entry that imports the others).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench import report
from specpool.core.errors import InvalidArgument, NotFound, check

WARMUP_PROMPT = "Say hello."
WARMUP_TOKENS = 8
# Spec-Bench categories -> the shipped zoo drafter trained for them (specpool/learning/zoo_data.py).
IN_DOMAIN_DRAFTERS = {"chat": "chat", "code": "code", "translation": "translation",
                      "summarization": "summarization_qa", "qa": "summarization_qa", "math": "math"}
# The same categories -> the shipped white-box head of that domain (specpool/drafters/heads/, eagle:NAME):
# the heads are trained on the zoo's domains, so the zoo's mapping holds; a category without one gets the general head.
IN_DOMAIN_FAMILIES = {"zoo": "", "eagle": "eagle:"}  # --in-domain FAMILY -> drafter spec prefix
GENERAL_DRAFTER = "general"  # fallback of a category outside the mapping, in both families
# --pool shorthands (expand_pool): the shipped white-box heads, and those with prompt lookup and a black-box drafter.
POOL_WHITE_BOX = "white-box"
POOL_MIXED = "mixed"
MIXED_EXTRA = ["lookup:code", "ngram"]
# Results go under the working directory, never into the package or the checkout's bench/results/
# (which holds only the reports the README cites).
RESULTS_ROOT = "bench-results"


def default_out(name: str) -> str:
    """The default --out of benchmark ``name``: ./bench-results/NAME, relative to the working directory."""
    return f"{RESULTS_ROOT}/{name}"


# -- prompt files (no models) -------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    question_id: object  # as in the file (int or str)
    category: str
    prompt: str  # the first turn


def load_questions(path: Path, limit_per_category: int) -> list[Question]:
    """The first ``limit_per_category`` questions of each category, in file order; one clear
    error for a missing file or a malformed line."""
    check(limit_per_category >= 1, f"--limit-per-category must be >= 1, got {limit_per_category}")
    check(path.exists(), f"prompts file {path} does not exist", NotFound)
    check(path.is_file(), f"prompts file {path} is not a file")
    questions: list[Question] = []
    per_category: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            check(isinstance(item, dict), f"{where}: expected a JSON object with category and turns")
            category, turns = item.get("category"), item.get("turns")
            check(isinstance(category, str) and bool(category), f"{where}: missing or empty \"category\"")
            check(isinstance(turns, list) and bool(turns) and isinstance(turns[0], str) and bool(turns[0].strip()),
                  f"{where}: \"turns\" must be a non-empty list whose first turn is a non-empty string")
            if per_category.get(category, 0) < limit_per_category:
                per_category[category] = per_category.get(category, 0) + 1
                questions.append(Question(item.get("question_id", line_no), category, turns[0]))
    check(bool(questions), f"prompts file {path} holds no questions")
    return questions


def load_prompts(path: Path) -> list[tuple[str, str]]:
    """(category, first turn) of every question of a well-formed file, in file order."""
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                item = json.loads(line)
                out.append((item["category"], item["turns"][0]))
    return out


def parse_drafters(text: str) -> list[str]:
    """Drafter specs of --drafters / --pool, checked against the registry before any model loads."""
    from specpool.drafters.registry import drafter_kinds, known_spec

    specs = [s.strip() for s in text.split(",") if s.strip()]
    check(bool(specs), "--drafters is empty; give drafter specs such as ngram or ngram,hf:PATH")
    check(len(set(specs)) == len(specs), f"--drafters names a drafter twice: {text}")
    for spec in specs:
        check(spec not in ("none", report.TARGET), "target-only decoding always runs; leave it out of --drafters")
        if not known_spec(spec):
            raise NotFound(f"unknown drafter {spec!r}; known kinds: {', '.join(drafter_kinds())} or a shipped zoo name")
    return specs


def shipped_head_specs() -> list[str]:
    """``eagle:NAME`` of every shipped white-box head; one clear error when none is shipped."""
    from specpool.drafters.eagle import SHIPPED_DIR, shipped_heads

    heads = shipped_heads()
    check(bool(heads), f"no white-box heads are shipped in {SHIPPED_DIR} (train them: specpool zoo train --arch eagle)", NotFound)
    return [f"eagle:{h}" for h in heads]


def expand_pool(text: str) -> str:
    """--pool with its shorthands spelled out: ``white-box`` = every shipped head (``eagle:NAME``),
    ``mixed`` = those plus ``lookup:code`` and ``ngram``; other items stay as given, duplicates dropped."""
    items: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if item == POOL_WHITE_BOX:
            items += shipped_head_specs()
        elif item == POOL_MIXED:
            items += shipped_head_specs() + MIXED_EXTRA
        elif item:
            items.append(item)
    return ",".join(dict.fromkeys(items))


def in_domain_spec(family: str, category: str) -> str:
    """The drafter spec system ``in-domain`` (zoo) or ``in-domain-eagle`` runs on a prompt of ``category``."""
    return IN_DOMAIN_FAMILIES[family] + IN_DOMAIN_DRAFTERS.get(category, GENERAL_DRAFTER)


# -- the machine --------------------------------------------------------------------------------
def machine_info(device: str) -> dict:
    """CPU, cores, threads, library versions (and the GPU): every report states its machine."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


# -- statistics ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile ``q`` in [0, 1] of non-empty ``values``."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values: list[float]) -> dict:
    """Median with the interquartile range, as the timing reports give them."""
    return {"median": statistics.median(values), "p25": percentile(values, 0.25), "p75": percentile(values, 0.75)}


def head_bench_parser(prog: str, doc: str, name: str, head_help: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark that times one white-box head: ``--head``, ``--threads`` and
    ``--out`` (default ./bench-results/NAME); the caller adds its own."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--head", default="general", help=head_help)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--out", default=default_out(name), help=f"output folder (default ./{default_out(name)})")
    return parser


def load_bench_head(args: argparse.Namespace) -> tuple:
    """Sets torch's threads to ``args.threads`` and loads ``args.head`` for the default target:
    (EagleHead, metadata)."""
    import torch

    from specpool.core.defaults import DEFAULT_TARGET
    from specpool.drafters.eagle import head_folder, load_eagle_head
    from specpool.services.config import settings_from_env

    torch.set_num_threads(args.threads)
    return load_eagle_head(head_folder(args.head), settings_from_env().home, DEFAULT_TARGET)


def write_results(out: str | Path, results: dict) -> Path:
    """``results`` as ``OUT/results.json`` (the folder made if need be); returns the file."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "results.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path
