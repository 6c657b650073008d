"""Incremental detokenization (specpool/services/detokenize.py) with real tokenizers: the tiny
word-level test tokenizer and a tiny byte-level BPE one (multi-byte characters split over tokens).

The streamed chunks must add up to the final text, which must be ``decode(all tokens)``; no chunk
may end in half a character; stop strings end the output at the token that completes them, even
across rounds; and the work is linear in the output.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specpool.services.detokenize import IncrementalDetokenizer

SPECIALS = ["<s>", "</s>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©")]  # " the", and "é" as one token


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (as GPT-2 and SmolLM2 use): every byte is a token, plus a few merges, so a
    character of 2-4 bytes usually spans tokens."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


BYTE_LEVEL = byte_level_tokenizer()


def decoder(tokenizer, counter: list[int] | None = None):
    def decode(ids):
        if counter is not None:
            counter.append(len(ids))
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return decode


def stream(tokenizer, rounds: list[list[int]], stop=()):
    """Feed ``rounds`` as a request would; (chunks, final text, tail, detokenizer)."""
    detok = IncrementalDetokenizer(decoder(tokenizer), stop)
    chunks = [detok.add(r) for r in rounds]
    text, tail = detok.finish()
    return chunks, text, tail, detok


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """``ids`` cut into rounds of the given sizes (cycled)."""
    rounds, i, n = [], 0, 0
    while i < len(ids):
        size = sizes[n % len(sizes)] if sizes else 1
        rounds.append(ids[i:i + size])
        i, n = i + size, n + 1
    return rounds


def check_stream(tokenizer, ids: list[int], sizes: list[int]) -> None:
    chunks, text, tail, detok = stream(tokenizer, split(ids, sizes))
    assert detok.token_ids == ids
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(c.text for c in chunks) + tail == text
    sent = ""
    for chunk in chunks:  # everything handed out so far is final text: no half characters
        sent += chunk.text
        assert text.startswith(sent)


# -- every token sequence -------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, len(BYTE_LEVEL) - 1), max_size=48), sizes=st.lists(st.integers(1, 6), max_size=8))
def test_random_byte_level_sequences_stream_exactly_their_decode(ids, sizes):
    check_stream(BYTE_LEVEL, ids, sizes)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(max_size=24), sizes=st.lists(st.integers(1, 6), max_size=8))
def test_random_text_round_trips_through_the_stream(text, sizes):
    """Valid UTF-8 of any script (most characters cut over several byte tokens)."""
    ids = BYTE_LEVEL.encode(text, add_special_tokens=False)
    check_stream(BYTE_LEVEL, ids, sizes)
    assert stream(BYTE_LEVEL, split(ids, sizes))[1] == text


def test_random_word_level_sequences_stream_exactly_their_decode(target_lm):
    tokenizer = target_lm[1]  # the tiny test tokenizer: words joined by spaces, specials skipped

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(ids=st.lists(st.integers(0, len(tokenizer) - 1), max_size=40), sizes=st.lists(st.integers(1, 6), max_size=8))
    def check(ids, sizes):
        check_stream(tokenizer, ids, sizes)

    check()


# -- characters cut between rounds --------------------------------------------------------------------
def test_a_character_split_across_rounds_is_held_back_until_complete():
    euro = BYTE_LEVEL.encode("€", add_special_tokens=False)
    assert len(euro) == 3  # three byte tokens
    a, b = BYTE_LEVEL.encode("a", add_special_tokens=False), BYTE_LEVEL.encode("b", add_special_tokens=False)
    chunks, text, tail, _ = stream(BYTE_LEVEL, [a + euro[:1], euro[1:2], euro[2:] + b])
    assert [c.text for c in chunks] == ["a", "", "€b"]
    assert (text, tail) == ("a€b", "")


def test_an_output_that_ends_in_a_cut_character_hands_it_out_at_the_end():
    euro = BYTE_LEVEL.encode("€", add_special_tokens=False)
    chunks, text, tail, _ = stream(BYTE_LEVEL, [BYTE_LEVEL.encode("x", add_special_tokens=False) + euro[:2]])
    assert [c.text for c in chunks] == ["x"]
    assert text == BYTE_LEVEL.decode(BYTE_LEVEL.encode("x", add_special_tokens=False) + euro[:2]) == "x" + tail
    assert tail.endswith("\ufffd")  # what decode shows for it, too


# -- stop strings ------------------------------------------------------------------------------------
def words(tokenizer, text: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(text.split())


def test_a_stop_string_spanning_rounds_ends_the_output_at_its_last_token(target_lm):
    tokenizer = target_lm[1]
    ids = words(tokenizer, "the cat sat on the mat and the dog ran")
    rounds = [ids[:2], ids[2:4], ids[4:7], ids[7:]]  # "sat on the" spans rounds 1-3
    chunks, text, tail, detok = stream(tokenizer, rounds, stop=("sat on the",))
    assert detok.stopped and detok.token_ids == ids[:5]
    assert [c.token_ids for c in chunks] == [ids[:2], ids[2:4], ids[4:5], []]
    assert text == "the cat sat on the" == "".join(c.text for c in chunks) + tail


def test_a_stop_string_inside_one_token_and_the_earliest_of_several(target_lm):
    tokenizer = target_lm[1]
    ids = words(tokenizer, "the house is big and red")
    _, text, _, detok = stream(tokenizer, [ids], stop=("red", "ous"))
    assert detok.token_ids == ids[:2] and text == "the house"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(alphabet="ab é€", max_size=20), stop=st.text(alphabet="ab é€", min_size=1, max_size=4),
       sizes=st.lists(st.integers(1, 5), max_size=6))
def test_random_stop_strings_cut_at_the_first_token_that_completes_one(text, stop, sizes):
    ids = BYTE_LEVEL.encode(text, add_special_tokens=False)
    chunks, out, tail, detok = stream(BYTE_LEVEL, split(ids, sizes), stop=(stop,))
    # The reference: the shortest prefix of the tokens whose decode contains the stop string.
    cut = next((n for n in range(1, len(ids) + 1) if stop in BYTE_LEVEL.decode(ids[:n])), len(ids))
    assert detok.token_ids == ids[:cut] and detok.stopped == (stop in BYTE_LEVEL.decode(ids[:cut]))
    assert out == BYTE_LEVEL.decode(ids[:cut]) == "".join(c.text for c in chunks) + tail


# -- cost ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop", [(), ("never there",)])
def test_work_is_linear_in_the_output(target_lm, stop):
    """Tokens decoded, summed over every decode call, stay within a constant per output token."""
    tokenizer = target_lm[1]
    ids = words(tokenizer, "the cat sat on the mat and the dog ran to the house " * 150)
    decoded: list[int] = []
    detok = IncrementalDetokenizer(decoder(tokenizer, decoded), stop)
    for r in split(ids, [5, 3, 6]):
        detok.add(r)
    detok.finish()
    assert sum(decoded) <= 6 * len(ids)  # re-decoding the whole output each round: ~ len(ids)^2 / 9
