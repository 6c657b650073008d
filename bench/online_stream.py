"""The online benchmark's prompt stream: passages of a plain-text corpus (no models).

Prompts are passages of the corpus (plain-text files; Project Gutenberg headers skipped), taken
in order, round-robin over the files; each asks the target to continue the passage.
"""

from __future__ import annotations

import re
from pathlib import Path

from specpool.core.errors import check


def _body(text: str) -> str:
    """A Project Gutenberg file without its licence header and footer (other text unchanged)."""
    start = re.search(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG[^\n]*\n", text)
    end = re.search(r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG", text)
    return text[start.end() if start else 0: end.start() if end else len(text)]


def passages(path: Path, min_words: int = 40, max_words: int = 90) -> list[str]:
    """Paragraphs of ``min_words``+ words (cut to ``max_words``) of a text file, in order."""
    text = _body(path.read_text(encoding="utf-8", errors="replace"))
    out = []
    for block in re.split(r"\n\s*\n", text):
        words = block.split()
        if len(words) >= min_words and not block.strip().isupper():
            out.append(" ".join(words[:max_words]))
    return out


def stream_prompts(corpus: Path, limit: int) -> list[str]:
    """``limit`` prompts from the corpus files (a file or folder), round-robin over the files."""
    check(corpus.exists(), f"corpus {corpus} does not exist")
    files = sorted(p for p in corpus.rglob("*") if p.is_file() and p.suffix in (".txt", "")) if corpus.is_dir() else [corpus]
    files = [f for f in files if not f.name.upper().startswith(("LICENSE", "README"))]
    per_file = [passages(f) for f in files]
    check(any(per_file), f"no passages of 40+ words in {corpus}")
    prompts: list[str] = []
    index = 0
    while len(prompts) < limit and any(index < len(p) for p in per_file):
        for p in per_file:
            if index < len(p) and len(prompts) < limit:
                prompts.append(f"Continue this passage from a novel, in the same style:\n\n{p[index]}")
        index += 1
    return prompts
