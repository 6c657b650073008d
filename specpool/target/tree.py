"""Draft trees (EAGLE-2, Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees"): a drafter proposes several continuations at once, as a tree rooted at the
last context token, and the target verifies every node in one forward.

A tree is given by its nodes' tokens and ``parents``: ``parents[i]`` is the index of node i's
parent, or ``ROOT`` (-1) for a child of the last context token; a parent comes before its children
(``check_tree``). Node i sits at context position ``len(context) - 1 + depth(i)``.

The target feeds the nodes after the context with an attention mask that lets each node see the
whole context, its ancestors and itself (``tree_attention_mask``), so one forward gives the target's
distribution after every node. Acceptance walks down from the root: the target's greedy token after
the current node is accepted when a child of that node proposed it (``greedy_tree_walk``); the
first miss gives the bonus token. The tokens are therefore the target's own greedy tokens, whatever
the tree. A sampled round needs the rules of specpool/target/rejection.py: the chain rule for one
draft per position, and recursive rejection sampling (``speculative_verify_tree``) for a tree whose
nodes' children were drawn from one q without replacement, as runner-up leaves are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpool.core.errors import InvalidArgument

ROOT = -1  # the parent index of a child of the last context token


def check_tree(parents: Sequence[int], n_tokens: int) -> None:
    """One line when ``parents`` is not a tree over ``n_tokens`` nodes in parent-first order."""
    if len(parents) != n_tokens:
        raise InvalidArgument(f"a draft tree needs one parent per node: {n_tokens} nodes, {len(parents)} parents")
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise InvalidArgument(f"draft tree node {i} has parent {parent}: a parent must be {ROOT} (the last "
                                  "context token) or an earlier node")


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (1 for a child of the root)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    return depths


def primary_chain(parents: Sequence[int]) -> list[int]:
    """The nodes of the tree's first branch: from the root, each node's first child. A drafter
    lists a node's children best first, so this is the chain it would have drafted alone."""
    chain: list[int] = []
    current = ROOT
    for i, parent in enumerate(parents):
        if parent == current:
            chain.append(i)
            current = i
    return chain


def tree_attention_mask(parents: Sequence[int], past: int, fed_context: int, dtype: torch.dtype,
                        device: torch.device | str) -> torch.Tensor:
    """Additive mask (1, 1, T, past + T), T = ``fed_context`` + nodes, for a forward that feeds
    the last ``fed_context`` context tokens (after ``past`` cached ones) and then the nodes: context
    rows are causal; node i sees the whole context, its ancestors and itself."""
    n = len(parents)
    total = past + fed_context + n
    visible = torch.zeros(fed_context + n, total, dtype=torch.bool)
    visible[:fed_context, : past + fed_context] = torch.ones(fed_context, past + fed_context, dtype=torch.bool).tril(past)
    visible[fed_context:, : past + fed_context] = True
    first = past + fed_context  # column of node 0
    for i, parent in enumerate(parents):
        row = fed_context + i
        if parent != ROOT:
            visible[row, first: first + parent + 1] = visible[fed_context + parent, first: first + parent + 1]
        visible[row, first + i] = True
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, fed_context + n, total).to(device)


def greedy_tree_walk(target_tokens: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The accepted path (node indices, root's child first). ``target_tokens[0]`` is the target's
    greedy token after the root (the last context token), ``target_tokens[1 + i]`` after node i."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    path: list[int] = []
    current = ROOT
    while True:
        wanted = target_tokens[current + 1]
        match = next((c for c in children.get(current, ()) if tree_tokens[c] == wanted), None)
        if match is None:
            return path
        path.append(match)
        current = match
