"""Incremental detokenization: the text a request's new tokens add, and where its stop strings end it.

Both modes stream through this one class (``specpool/services/orchestrator.py``): the served
router's chunks, the embedded engine's ``on_text`` and the CLI's output. Work per token is a
decode of a small window, so a request costs time linear in its output (re-decoding the whole
output every round, as before, was quadratic and held the replica's tokenizer lock throughout).

The window is vLLM's (``detokenize_incrementally``: a prefix offset and a read offset): the text of
the unread tokens is ``decode(ids[prefix:]) - decode(ids[prefix:read])``. Decoding the new tokens
together with the last tokens already read gives them their context, so a tokenizer whose token
text depends on its neighbour (a word-piece's joining space, SentencePiece's leading space) still
streams exactly ``decode(all ids)``. Text whose decode ends in U+FFFD (a multi-byte character cut
between tokens) is held back until a later token completes it. ``tokenizers.decoders.DecodeStream``
does the same window in Rust, but it cannot hand out the held-back rest at the end of the output
(which ``decode`` then shows as U+FFFD) and works only with fast tokenizers.

Stop strings: after each token the new text, plus the last ``len(longest stop) - 1`` characters
already handed out (a stop string may begin there), is searched; the token that completes a stop
string is the request's last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"  # what a lossy UTF-8 decode shows for an incomplete character


@dataclass(frozen=True)
class Chunk:
    """Tokens one round added (up to a stop string), and the complete text they added."""

    text: str
    token_ids: list[int]


class IncrementalDetokenizer:
    """One request's output: ``add`` each round's tokens, ``finish`` once at the end.

    ``decode(ids)`` must decode like ``tokenizer.decode(ids, skip_special_tokens=True)``."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self.stop = tuple(stop)
        self._overlap = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []  # the output so far, cut after a stop string
        self.stopped = False  # a stop string appeared: later tokens are not taken
        self._prefix = 0  # first token of the decoded window (context for the unread tokens)
        self._read = 0  # tokens whose text has been handed out
        self._prefix_text = ""  # decode(token_ids[_prefix:_read])
        self._sent = 0  # characters handed out
        self._recent = ""  # the last _overlap characters handed out: where a stop string may begin

    def add(self, new_ids: Sequence[int]) -> Chunk:
        """Take a round's tokens (only up to the one that completes a stop string)."""
        if self.stopped:
            return Chunk("", [])
        taken: list[int] = []
        pieces: list[str] = []
        for token in new_ids:
            self.token_ids.append(token)
            taken.append(token)
            text, complete = self._unread_text()
            if self.stop and self._has_stop(text):
                # Handed out even when it ends in a cut character: the output ends here.
                self.stopped = True
                pieces.append(self._hand_out(text))
                break
            if complete:
                pieces.append(self._hand_out(text))
        return Chunk("".join(pieces), taken)

    def finish(self) -> tuple[str, str]:
        """(the whole text, the part of it not handed out yet). The whole text is one plain
        decode of the output, so it is ``tokenizer.decode(token_ids)`` by construction."""
        text = self._decode(self.token_ids)
        tail = text[self._sent:]
        self._sent = len(text)
        return text, tail

    def _unread_text(self) -> tuple[str, bool]:
        """(text of the unread tokens, whether it is complete: no character cut at its end)."""
        window = self._decode(self.token_ids[self._prefix:])
        if len(window) <= len(self._prefix_text):  # nothing new yet (a skipped special token, a cut byte)
            return "", False
        return window[len(self._prefix_text):], not window.endswith(REPLACEMENT_CHARACTER)

    def _has_stop(self, text: str) -> bool:
        haystack = self._recent + text
        return any(s in haystack for s in self.stop)

    def _hand_out(self, text: str) -> str:
        self._prefix, self._read = self._read, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix:self._read])
        self._sent += len(text)
        if self._overlap:
            self._recent = (self._recent + text)[-self._overlap:]
        return text
