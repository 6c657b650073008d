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


def _documented_functions(source: str) -> list[tuple[str, str]]:
    """(stub, whole function) of each documented function of one file whose stub is 40 ..
    MAX_PROMPT_CHARS long: the stub is the signature with its docstring, the body left out."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            stub = textwrap.dedent("\n".join(lines[node.lineno - 1: node.body[0].end_lineno]))
            if 40 <= len(stub) <= MAX_PROMPT_CHARS:
                found.append((stub, textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno]))))
    return found


def _python_stubs(source: str) -> list[str]:
    """Function signatures with their docstrings, bodies left out, from one Python file."""
    return [CODE_INSTRUCTION.format(stub=stub.rstrip()) for stub, _ in _documented_functions(source)]


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


# --- reference answers ------------------------------------------------------------------------
#
# White-box heads can also learn from text the target did not write: the target reads a
# prompt and the corpus's own answer in one teacher-forced forward, and its features and top-K
# at every answer position are the training signal (EAGLE trained on fixed ShareGPT replies).
# One forward costs what a single decode step costs per token, about 15x cheaper per token than
# answering on a 2-core CPU, so reference answers buy far more data per CPU hour than
# on-policy answers do (specpool/learning/eagle_train.py, ``reference_teacher``).

def _fenced(code: str) -> str:
    return f"```python\n{code.strip()}\n```"


def _python_pairs(source: str) -> list[tuple[str, str]]:
    """(stub prompt, the whole function in a fence) for each documented function of one file."""
    return [(CODE_INSTRUCTION.format(stub=stub.rstrip()), _fenced(whole))
            for stub, whole in _documented_functions(source) if len(whole) > len(stub)]


def _gsm8k_answer(answer: str) -> str:
    """GSM8K's worked answer without its calculator annotations, the final line in words."""
    import re

    text = re.sub(r"<<[^>]*>>", "", answer)
    body, _, final = text.rpartition("####")
    return f"{body.strip()}\nThe answer is {final.strip()}." if body else text.strip()


def _json_pair(record: dict) -> tuple[str, str] | None:
    prompt = _json_prompt(record)
    if prompt is None:
        return None
    if "code" in record and "text" in record:
        reference = _fenced(record["code"].replace("\r", ""))
    elif "question" in record and "answer" in record:
        reference = _gsm8k_answer(record["answer"])
    elif "problem" in record and "solution" in record:
        reference = record["solution"]
    elif "prompt" in record and "completion" in record:
        reference = record["completion"].replace("<|endoftext|>", "")
    elif "instruction" in record:
        instances = record.get("instances") or [{}]
        if isinstance(instances, str):  # some files store the list as its Python repr
            try:
                instances = ast.literal_eval(instances)
            except (SyntaxError, ValueError):
                return None
        reference = (instances[0] or {}).get("output", "") if instances else ""
    else:  # a question without an answer (Spec-Bench turns, SVAMP's bare equation): nothing to read
        return None
    reference = reference.strip()
    return (prompt, reference) if reference else None


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """(prompt, reference answer) pairs of a file or folder, for formats that carry an answer
    (module docstring); prompts are exactly the ones ``read_prompts`` makes of the same record."""
    if not path.exists():
        raise InvalidArgument(f"corpus {path} does not exist")
    if path.is_dir():
        pairs: list[tuple[str, str]] = []
        for child in sorted(path.rglob("*")):
            if child.is_file() and child.suffix in (".py", ".jsonl", ".json", ".txt") and child.name.lower() != "license.txt":
                pairs.extend(read_pairs(child))
        return pairs
    if path.suffix == ".py":
        return _python_pairs(path.read_text(encoding="utf-8", errors="replace"))
    if path.suffix in (".jsonl", ".json"):
        pairs = []
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    pair = _json_pair(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise InvalidArgument(f"{path}:{number}: not a JSON line ({exc.msg})") from None
                if pair is not None:
                    pairs.append(pair)
        return pairs
    if path.suffix == ".txt" and path.name.startswith("src-"):
        target = path.with_name("tgt-" + path.name[len("src-"):])
        if not target.exists():
            return []  # a test split without references
        sources = path.read_text(encoding="utf-8", errors="replace").splitlines()
        targets = target.read_text(encoding="utf-8", errors="replace").splitlines()
        return [(f"Translate English to German: {s.strip()}", t.strip())
                for s, t in zip(sources, targets) if s.strip() and t.strip()]
    if path.suffix == ".txt" and not path.name.startswith("tgt-"):
        # Prose: 4 lines as the passage to continue, the next 8 as the continuation.
        text = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        return [(f"Continue the text: {' '.join(text[i:i + 4])}", " ".join(text[i + 4:i + 12]))
                for i in range(0, max(len(text) - 11, 0), 12)]
    return []


def collect_pairs(paths: list[Path], limit: int, seed: int, exclude: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Up to ``limit`` (prompt, reference) pairs from ``paths``, de-duplicated by prompt, capped
    like prompts, shuffled with ``seed`` and balanced across the paths as ``collect_prompts``
    is. Prompts in ``exclude`` (e.g. held-out ones) are left out."""
    per_path: list[list[tuple[str, str]]] = []
    seen: set[str] = set(exclude)
    for path in paths:
        pairs = []
        for prompt, reference in read_pairs(path):
            prompt = prompt[:MAX_PROMPT_CHARS]
            if prompt.strip() and prompt not in seen:
                seen.add(prompt)
                pairs.append((prompt, reference))
        # Seeded by the file's own name, not the path's spelling: ../shared/data and /work/shared/data
        # must choose the same pairs.
        random.Random(f"{seed}:pairs:{path.parent.name}/{path.name}").shuffle(pairs)
        per_path.append(pairs)
    chosen: list[tuple[str, str]] = []
    index = 0
    while len(chosen) < limit and any(index < len(p) for p in per_path):
        for pairs in per_path:
            if index < len(pairs) and len(chosen) < limit:
                chosen.append(pairs[index])
        index += 1
    return chosen
