"""The target's *features*: its final hidden states (after the last norm: what its LM head reads),
the input of white-box drafters (EAGLE, Li et al. 2024; docs/ARCHITECTURE.md, "White-box drafters").

Verification computes them anyway; a request whose pool has a white-box arm asks for them
(``VerifyRequest.return_features``) and gets the rows of the positions the target now holds in
its cache (``VerifyResult.features``). A head needs the feature of every context position but
the last, so each holder of features (a white-box drafter in process, a drafter deployment, the
router's side of a remote drafter) keeps a ``FeatureLog`` per session and applies each round's
``Features`` to it: rows from ``start`` on replace what was there (a rollback of rejected drafts
or a re-prefill after a cache miss), rows before ``start`` stay.

On the wire (served mode) features travel as float16 or bfloat16 bytes, row-major
(``encode_features`` / ``decode_features``): 576 x 2 = 1,152 bytes per position for the default
target, so a round that accepts a drafts carries (a + 1) x 1,152 bytes each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpool.core.errors import FailedPrecondition, InvalidArgument

WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Features:
    """Features of the consecutive positions ``start`` .. ``start + len(rows) - 1``."""

    start: int
    rows: torch.Tensor  # (n, d)

    @property
    def end(self) -> int:
        return self.start + int(self.rows.shape[0])

    def since(self, position: int) -> "Features":
        """The rows from ``position`` on (``position`` within start..end)."""
        return Features(position, self.rows[position - self.start:])


class FeatureGap(FailedPrecondition):
    """Features arrived for positions after a gap: the holder lost the rows before them (a
    restarted drafter replica, an evicted session). The sender resends from ``needed``."""

    def __init__(self, needed: int, start: int):
        super().__init__(f"features start at position {start}, but this holder has them only up to {needed}: "
                         f"resend from {needed}")
        self.needed = needed
        self.start = start

    def __reduce__(self):  # pickled across Ray processes: rebuild from both arguments
        return FeatureGap, (self.needed, self.start)


class FeatureLog:
    """One session's features, positions 0 .. len-1, in a buffer that grows by doubling."""

    def __init__(self, width: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.width = width
        self._buffer = torch.empty(0, width, dtype=dtype, device=device)  # (capacity, d)
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def apply(self, features: Features) -> None:
        """Rows from ``features.start`` replace this log's; a start past the end is a ``FeatureGap``."""
        if features.start > self._length:
            raise FeatureGap(self._length, features.start)
        if features.rows.ndim != 2 or features.rows.shape[1] != self.width:
            raise InvalidArgument(f"features of width {tuple(features.rows.shape)[1:]} where {self.width} was expected")
        end = features.end
        if end > self._buffer.shape[0]:
            grown = torch.empty(max(end, 2 * self._buffer.shape[0], 64), self.width,
                                dtype=self._buffer.dtype, device=self._buffer.device)
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[features.start:end] = features.rows.to(self._buffer)
        self._length = end

    def truncate(self, length: int) -> None:
        self._length = min(self._length, max(length, 0))

    def rows(self, start: int, end: int | None = None) -> torch.Tensor:
        """A view of positions start .. end-1 (end: the log's length)."""
        end = self._length if end is None else min(end, self._length)
        return self._buffer[start:end]

    def since(self, start: int) -> Features:
        return Features(start, self.rows(start))


def encode_features(features: Features, dtype: str = "float16") -> bytes:
    """The rows as little-endian ``dtype`` bytes, row-major (the wire format)."""
    if dtype not in WIRE_DTYPES:
        raise InvalidArgument(f"feature dtype must be one of {', '.join(WIRE_DTYPES)}, got {dtype!r}")
    rows = features.rows.detach().to("cpu", WIRE_DTYPES[dtype]).contiguous()
    return rows.view(torch.int16).numpy().tobytes()  # 2-byte words; int16 because numpy has no bfloat16


def decode_features(start: int, width: int, data: bytes, dtype: str = "float16") -> Features:
    """Inverse of ``encode_features``; rows come back as float32."""
    if dtype not in WIRE_DTYPES:
        raise InvalidArgument(f"feature dtype must be one of {', '.join(WIRE_DTYPES)}, got {dtype!r}")
    if width <= 0 or len(data) % (2 * width):
        raise InvalidArgument(f"{len(data)} feature bytes are not whole rows of width {width}")
    if start < 0:
        raise InvalidArgument(f"feature start must be >= 0, got {start}")
    words = torch.frombuffer(bytearray(data), dtype=torch.int16) if data else torch.empty(0, dtype=torch.int16)
    return Features(start, words.view(WIRE_DTYPES[dtype]).reshape(-1, width).float())
