"""Feedback records as training batches for a zoo drafter network.

A feedback record (specpool/learning/feedback.py) is one small distillation example: the sequence
context-tail + draft, and the target's sparse top-K p at its last k+1 positions (OnlineSpec: Liu et
al., "Online Speculative Decoding", 2023). ``make_batch`` pads records into one ``FeedbackBatch``
on the drafter's reduced vocabulary (``vocab_map_for``); ``batch_sequences`` decides which tokens
a batch runs, merging a session's records that line up into one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from specpool.drafters.zoo_model import vocabulary_index
from specpool.learning.feedback import FeedbackRecord


@dataclass(frozen=True)
class FeedbackBatch:
    inputs: torch.Tensor  # (B, L) context tail + draft, right-padded
    ids: torch.Tensor  # (B, L, K) target top-K mapped into the reduced vocabulary, -1 outside
    probs: torch.Tensor  # (B, L, K)
    mask: torch.Tensor  # (B, L) positions with at least one target token inside the vocabulary

    @property
    def positions(self) -> int:
        return int(self.mask.sum())


def vocab_map_for(model: nn.Module) -> torch.Tensor:
    """(V,) full token id -> reduced-vocabulary index, -1 where the drafter (a ZooLM or a
    ZooEnsembleLM) cannot propose it."""
    return vocabulary_index(model.vocab_ids.cpu(), model.vocab_size) - 1


def batch_sequences(records: Sequence[FeedbackRecord], bonus: bool = True,
                    merge: bool = False) -> list[tuple[list[int], list[tuple[int, int, int]]]]:
    """The token sequences a batch fits: [(tokens, [(t, record index, row j)])], row j of the
    record's target p sitting at position t (its logits predict the token after t).

    Unmerged, each record is one sequence, context + draft. ``merge`` joins the records of one
    session whose positions (``FeedbackRecord.position``) line up - each one's context continuing
    the previous ones' tokens - into one sequence: the first one's context, the later contexts'
    new tokens, and the last one's draft. A record's rows whose draft prefix is the sequence (its
    accepted tokens and the target's next) keep their place in it; the rows after a rejected
    draft token (off the session's path) are dropped, except the last record's. Successive
    records of a session share most of their context, so four of them fit in about a quarter of
    the tokens: that is the learner's cost. Records without a position stay on their own."""

    def first_draft_token(r) -> int:  # its index in the session (in its own record without a position)
        position = getattr(r, "position", None)
        return position if position is not None else len(r.context)

    # Each chain: (record indices, tokens, the session index of tokens[0]).
    chains: list[tuple[list[int], list[int], int]] = []
    sessions: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(records):
        if merge and getattr(r, "position", None) is not None:
            sessions.setdefault((r.tenant, r.session), []).append(i)
        else:
            chains.append(([i], list(r.context), first_draft_token(r) - len(r.context)))
    merged: list[tuple[list[int], list[int], int]] = []
    for members in sessions.values():
        session_first = len(merged)  # chains from here on are this session's
        for i in sorted(members, key=lambda i: records[i].position):
            r = records[i]
            r_start = r.position - len(r.context)
            if len(merged) > session_first:
                chain, tokens, start = merged[-1]
                end = start + len(tokens)
                if start <= r_start <= end <= r.position and tokens[r_start - start:] == list(r.context[: end - r_start]):
                    tokens.extend(r.context[end - r_start:])
                    chain.append(i)
                    continue
            merged.append(([i], list(r.context), r_start))
    out = []
    for chain, tokens, start in merged + chains:
        tokens = tokens + list(records[chain[-1]].draft)
        rows, taken = [], set()
        for i in chain:
            r = records[i]
            at = first_draft_token(r) - start  # the index of its first draft token in ``tokens``
            for j in range(len(r.target_ids) if bonus else len(r.draft)):
                if i != chain[-1] and tokens[at: at + j] != list(r.draft[:j]):
                    break  # off the path from here on
                t = at - 1 + j
                if t not in taken:
                    taken.add(t)
                    rows.append((t, i, j))
        out.append((tokens, rows))
    return out


def make_batch(records: Sequence[FeedbackRecord], vocab_map: torch.Tensor, bonus: bool = True,
               argmax: bool = False, merge: bool = False) -> FeedbackBatch:
    """Records as one padded batch. Logits at position t predict token t+1, so the target's row j
    (the token after context + draft[:j]) sits at t = len(context) - 1 + j. ``bonus`` False
    leaves out the last row (BD is defined over the k draft positions only). ``argmax`` keeps
    only each row's most likely token, with p = 1 (hard labels; K = 1). ``merge``: a session's
    records that line up share one sequence (``batch_sequences``)."""
    sequences = batch_sequences(records, bonus, merge)
    length = max(len(tokens) for tokens, _ in sequences)
    width = 1 if argmax else max(len(row) for r in records for row in r.target_ids)
    inputs = torch.zeros(len(sequences), length, dtype=torch.long)
    ids = torch.full((len(sequences), length, width), -1, dtype=torch.long)
    probs = torch.zeros(len(sequences), length, width)
    for b, (tokens, rows) in enumerate(sequences):
        inputs[b, : len(tokens)] = torch.tensor(tokens)
        for t, i, j in rows:
            r = records[i]
            row, p = torch.tensor(r.target_ids[j]), torch.tensor(r.target_probs[j])
            if argmax and len(row):
                top = int(p.argmax())
                row, p = row[top: top + 1], torch.ones(1)
            ids[b, t, : len(row)] = vocab_map[row]
            probs[b, t, : len(row)] = p
    mask = (ids >= 0).any(-1)  # (B, L)
    return FeedbackBatch(inputs, ids, probs, mask)
