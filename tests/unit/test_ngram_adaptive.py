"""The n-gram drafter's adaptive draft length: it learns, per session, from the contexts that
follow its proposals how often they are accepted, and proposes less when they fail."""

from __future__ import annotations

from specpool.drafters.ngram import NGramDrafter
from specpool.target.sampling import SamplingParams

GREEDY = SamplingParams()
# A context whose suffix (7, 8) occurred before, followed by 9 10 11 12 13 14.
BASE = [1, 7, 8, 9, 10, 11, 12, 13, 14, 2, 3, 7, 8]


def run_session(drafter: NGramDrafter, session: str, accept: bool, rounds: int) -> list[int]:
    """Propose repeatedly; the 'target' either accepts the whole proposal or rejects its first
    token. Each round ends with fresh filler and the suffix (7, 8) again, so the continuation
    found is always at least 6 tokens long. Returns the proposal lengths."""
    context = list(BASE)
    lengths = []
    for i in range(rounds):
        proposal = drafter.propose(session, context, 6, GREEDY).tokens
        lengths.append(len(proposal))
        outcome = proposal + [99] if accept else [200 + i]  # all accepted + bonus, or a recovered token
        filler = [300 + 10 * i + j for j in range(6)]
        context = context + outcome + filler + [7, 8]
    return lengths


def test_rejections_shrink_the_draft_and_acceptances_grow_it() -> None:
    drafter = NGramDrafter()
    rejected = run_session(drafter, "bad", accept=False, rounds=12)
    accepted = run_session(drafter, "good", accept=True, rounds=12)
    assert rejected[-1] == 1 and rejected[-1] < rejected[0]
    assert accepted[-1] >= 5
    # Sessions do not share statistics.
    assert run_session(drafter, "fresh", accept=False, rounds=1)[0] == rejected[0]


def test_non_adaptive_always_proposes_the_whole_continuation() -> None:
    drafter = NGramDrafter(adaptive=False)
    assert run_session(drafter, "s", accept=False, rounds=6) == [6] * 6


def test_release_forgets_the_session() -> None:
    drafter = NGramDrafter()
    first = run_session(drafter, "s", accept=False, rounds=1)[0]
    run_session(drafter, "s", accept=False, rounds=10)
    drafter.release("s")
    assert run_session(drafter, "s", accept=False, rounds=1)[0] == first
