"""Integration: incremental detokenization (specpool/services/detokenize.py) with the real default
target's tokenizer (SmolLM2's byte-level BPE, with its special tokens): the streamed chunks add up
to ``tokenizer.decode(all tokens, skip_special_tokens=True)`` for any token sequence, any rounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from specpool.core.defaults import DEFAULT_TARGET
from specpool.services.config import settings_from_env
from specpool.services.detokenize import IncrementalDetokenizer
from specpool.target.models import resolve_model

pytestmark = pytest.mark.integration

TOKENIZER = None


def tokenizer():
    global TOKENIZER  # one load per process: hypothesis calls the tests many times
    if TOKENIZER is None:
        TOKENIZER = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_TARGET, settings_from_env().home))
    return TOKENIZER


def check_stream(ids: list[int], sizes: list[int], stop=()) -> IncrementalDetokenizer:
    tok = tokenizer()
    detok = IncrementalDetokenizer(lambda x: tok.decode(list(x), skip_special_tokens=True), stop)
    chunks, i, n = [], 0, 0
    while i < len(ids):
        size = sizes[n % len(sizes)] if sizes else 1
        chunks.append(detok.add(ids[i:i + size]))
        i, n = i + size, n + 1
    text, tail = detok.finish()
    assert text == tok.decode(detok.token_ids, skip_special_tokens=True)
    assert "".join(c.text for c in chunks) + tail == text
    return detok


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, 49151), max_size=64), sizes=st.lists(st.integers(1, 6), max_size=8))
def test_random_token_sequences_stream_exactly_their_decode(ids, sizes):
    assert check_stream(ids, sizes).token_ids == ids


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(max_size=40), sizes=st.lists(st.integers(1, 6), max_size=8))
def test_any_text_streams_back_exactly(text, sizes):
    ids = tokenizer().encode(text, add_special_tokens=False)
    check_stream(ids, sizes)


def test_a_chat_answer_with_emoji_and_accents_and_a_stop_string():
    tok = tokenizer()
    text = "Voilà: 3 € — naïve 🙂 done.<|im_end|> trailing"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters spread over byte tokens
    whole = check_stream(ids, [1, 2, 3])
    assert tok.decode(whole.token_ids, skip_special_tokens=True) == "Voilà: 3 € — naïve 🙂 done. trailing"
    cut = check_stream(ids, [2, 5], stop=("🙂",))
    assert cut.stopped and tok.decode(cut.token_ids, skip_special_tokens=True).endswith("🙂")
