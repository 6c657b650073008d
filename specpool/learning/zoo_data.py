"""Training prompts for the zoo drafters, read from corpus files whose format is detected.

A zoo drafter learns to predict the *target's own answers* (on-policy distillation), so what a
corpus contributes is prompts shaped like the requests the drafter will serve: the target then
answers them and its distributions become the training signal (specpool/learning/zoo_train.py).

Formats recognised (by file name or the keys of the first JSON line):
  *.py or a folder of them              -> "Complete the following Python function." stubs
  {"text", "code"} (MBPP)               -> the same stubs, docstring = the task text
  {"question", "answer"} (GSM8K)        -> the question
  {"problem", "solution"} (MATH)        -> the problem
  {"Body", "Question"} (SVAMP)          -> body + question
  {"prompt", "completion"} (T0 / P3)    -> the prompt, trailing whitespace stripped
  {"instruction", "instances"}          -> instruction (+ input)
  {"question_id", "turns"} (Spec-Bench) -> the first turn
  src-*.txt (a folder with one)         -> "Translate English to German: <line>"
  any other *.txt                       -> "Continue the text: <a passage>"
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import textwrap
from pathlib import Path

from specpool.core.errors import InvalidArgument, NotFound

DOMAINS = ("code", "math", "translation", "summarization_qa", "chat", "general")

# Which shared/data files each shipped drafter was trained from. The dev prompts' sources
# (HumanEval, SVAMP, the OpenNMT validation set, XSum, NQ-Open, Vicuna-bench) are left out so
# the evaluation measures text the drafters have not seen (shared/data/README.md).
DEFAULT_RECIPES: dict[str, tuple[str, ...]] = {
    "code": ("code/thealgorithms_python/files", "code/mbpp/mbpp.jsonl"),
    "math": ("math/gsm8k/train.jsonl", "math/math_pal/math/test.json"),
    "translation": ("translation/opennmt_toy_ende/src-train.txt",),
    "summarization_qa": ("summarization_qa/t0_prompted",),
    "chat": ("instructions/self_instruct/seed_tasks.jsonl", "instructions/self_instruct/user_oriented_instructions.jsonl"),
}
DEFAULT_RECIPES["general"] = tuple(p for name in DOMAINS[:-1] for p in DEFAULT_RECIPES[name])

CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{stub}\n```"
MAX_PROMPT_CHARS = 2000  # longer prompts cost prefill time and teach little more


def check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise NotFound(f"unknown domain {domain!r}; known domains: {', '.join(DOMAINS)}")


def _python_stubs(source: str) -> list[str]:
    """Function signatures with their docstrings, bodies left out, from one Python file."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    stubs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            doc = node.body[0]
            stub = textwrap.dedent("\n".join(lines[node.lineno - 1: doc.end_lineno]))
            if 40 <= len(stub) <= MAX_PROMPT_CHARS:
                stubs.append(CODE_INSTRUCTION.format(stub=stub.rstrip()))
    return stubs


def _mbpp_stub(record: dict) -> str | None:
    for line in record["code"].replace("\r", "").splitlines():
        if line.startswith("def "):
            text = record["text"].strip()
            return CODE_INSTRUCTION.format(stub=f'{line.rstrip()}\n    """ {text}\n    """')
    return None


def _json_prompt(record: dict) -> str | None:
    if "code" in record and "text" in record:
        return _mbpp_stub(record)
    if "question" in record and "answer" in record:
        return record["question"]
    if "problem" in record:
        return record["problem"]
    if "Body" in record and "Question" in record:
        return f"{record['Body'].strip()} {record['Question'].strip()}"
    if "prompt" in record and "completion" in record:
        return record["prompt"].rstrip()
    if "instruction" in record:
        extra = (record.get("instances") or [{}])[0].get("input", "")
        return record["instruction"] + (f"\n\n{extra}" if extra else "")
    if "turns" in record:
        return record["turns"][0]
    return None


def _read_json_lines(path: Path) -> list[str]:
    prompts = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{path}:{number}: not a JSON line ({exc.msg})") from None
            prompt = _json_prompt(record)
            if prompt is None:
                raise InvalidArgument(f"{path}:{number}: unrecognised record keys {sorted(record)[:6]}")
            prompts.append(prompt)
    return prompts


def _read_text(path: Path, seed: int) -> list[str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
    if path.name.startswith("src-"):
        return [f"Translate English to German: {line}" for line in lines if line]
    # Prose: passages of a few consecutive non-empty lines.
    text = [line for line in lines if line]
    return [f"Continue the text: {' '.join(text[i:i + 4])}" for i in range(0, max(len(text) - 3, 1), 8)] if text else []


def read_prompts(path: Path, seed: int = 0) -> list[str]:
    """All prompts a file or folder holds (see the module docstring for formats)."""
    if not path.exists():
        raise InvalidArgument(f"corpus {path} does not exist")
    if path.is_dir():
        prompts: list[str] = []
        for child in sorted(path.rglob("*")):
            if child.is_file() and child.suffix in (".py", ".jsonl", ".json", ".txt") and child.name.lower() not in ("license.txt",):
                prompts.extend(read_prompts(child, seed))
        return prompts
    if path.suffix == ".py":
        return _python_stubs(path.read_text(encoding="utf-8", errors="replace"))
    if path.suffix in (".jsonl", ".json"):
        return _read_json_lines(path)
    if path.suffix == ".txt":
        return _read_text(path, seed)
    raise InvalidArgument(f"{path}: unsupported corpus file type (use .py, .jsonl, .json or .txt)")


def collect_prompts(paths: list[Path], limit: int, seed: int) -> list[str]:
    """Prompts from all ``paths``: de-duplicated, length-capped, shuffled with ``seed`` and
    balanced across the paths (each contributes up to an equal share of ``limit``)."""
    per_path: list[list[str]] = []
    seen: set[str] = set()
    for path in paths:
        prompts = []
        for prompt in read_prompts(path, seed):
            prompt = prompt[:MAX_PROMPT_CHARS]
            key = hashlib.sha1(prompt.encode()).hexdigest()
            if prompt.strip() and key not in seen:
                seen.add(key)
                prompts.append(prompt)
        random.Random(f"{seed}:{path}").shuffle(prompts)
        per_path.append(prompts)
    if not any(per_path):
        raise InvalidArgument(f"no prompts found in {', '.join(str(p) for p in paths)} (empty corpus?)")
    # Round-robin over the paths so a big corpus does not drown a small one.
    chosen: list[str] = []
    index = 0
    while len(chosen) < limit and any(index < len(p) for p in per_path):
        for prompts in per_path:
            if index < len(prompts) and len(chosen) < limit:
                chosen.append(prompts[index])
        index += 1
    return chosen
