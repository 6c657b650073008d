"""The public SpecPool API's messages <-> dataclasses, without torch (the client imports this).

``spec_from_proto`` checks a GenerateRequest for everything that needs no model and raises
``InvalidArgument`` with a message for the caller; ``request_to_proto`` builds one from keyword
arguments (the client's side). Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from specpool.core.defaults import MAX_DRAFT_LENGTH, MAX_STOP_CHARS, MAX_STOP_STRINGS
from specpool.core.errors import InvalidArgument, check
from specpool.services.grpc_ingress import UndecodableRequest
from specpool.v1 import common_pb2, specpool_pb2

FINISH_REASONS = {
    "stop": specpool_pb2.FINISH_REASON_STOP,
    "length": specpool_pb2.FINISH_REASON_LENGTH,
    "cancelled": specpool_pb2.FINISH_REASON_CANCELLED,
}
FINISH_NAMES = {value: name for name, value in FINISH_REASONS.items()}


def decimal_float(value: float) -> float:
    """A float32 field as the decimal the caller most likely wrote: 0.7 travels as 0.69999999 and
    comes back as 0.7 (the shortest decimal that rounds to the same float32), so a temperature or
    top-p defines exactly the p it defines in the embedded engine."""
    return float(str(np.float32(value)))


# -- SpecPool.Generate --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerationSpec:
    """A GenerateRequest, checked for what needs no model; 0 / "" mean "server default"."""

    input_kind: str  # "prompt" (chat template applied), "chat" (messages) or "raw" (no template)
    text: str = ""  # the prompt or raw prompt ("" for chat)
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) for chat
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    policy: str = ""
    k: int = 0
    session_id: str = ""
    tenant: str = ""


def spec_from_proto(msg: specpool_pb2.GenerateRequest) -> GenerationSpec:
    if isinstance(msg, UndecodableRequest):  # bytes Serve's proxy could not parse (services/grpc_ingress.py)
        raise InvalidArgument(f"the request is not a valid {msg.message_type} ({msg.error}); "
                              "send a message built from specpool/v1/specpool.proto")
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("the request has no input: set prompt, chat or raw_prompt")
    messages: tuple[tuple[str, str], ...] = ()
    text = ""
    if kind == "chat":
        check(len(msg.chat.messages) > 0, "chat has no messages")
        for i, m in enumerate(msg.chat.messages):
            check(bool(m.role.strip()), f"chat message {i + 1} has no role (system, user, assistant, ...)")
        check(any(m.content.strip() for m in msg.chat.messages), "the prompt is empty: every chat message is blank")
        messages = tuple((m.role, m.content) for m in msg.chat.messages)
    else:
        text = msg.prompt if kind == "prompt" else msg.raw_prompt
        check(bool(text.strip()), "the prompt is empty")
    temperature = decimal_float(msg.sampling.temperature)
    top_p = decimal_float(msg.sampling.top_p) if msg.sampling.HasField("top_p") else 1.0
    check(math.isfinite(temperature) and temperature >= 0.0, f"temperature must be >= 0 (and finite), got {temperature}")
    check(0.0 < top_p <= 1.0, f"top-p must be in (0, 1], got {top_p}")
    check(msg.k <= MAX_DRAFT_LENGTH, f"k (draft length) must be in 1..{MAX_DRAFT_LENGTH} (0 = server default), got {msg.k}")
    check(len(msg.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(msg.stop)}")
    for s in msg.stop:
        check(0 < len(s) <= MAX_STOP_CHARS, f"stop strings must have 1..{MAX_STOP_CHARS} characters, got {s!r:.40}")
    return GenerationSpec(
        input_kind="raw" if kind == "raw_prompt" else kind, text=text, messages=messages,
        temperature=temperature, top_p=top_p, top_k=int(msg.sampling.top_k), seed=int(msg.sampling.seed),
        max_new_tokens=int(msg.max_new_tokens), stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
        policy=msg.policy, k=int(msg.k), session_id=msg.session_id, tenant=msg.tenant,
    )


def request_to_proto(
    prompt: str | None = None, *, chat: list[tuple[str, str]] | None = None, raw_prompt: str | None = None,
    max_new_tokens: int = 0, temperature: float = 0.0, top_p: float | None = None, top_k: int = 0, seed: int = 0,
    stop: list[str] | tuple[str, ...] = (), stop_token_ids: list[int] | tuple[int, ...] = (), policy: str = "",
    k: int = 0, session_id: str = "", tenant: str = "",
) -> specpool_pb2.GenerateRequest:
    """A GenerateRequest from keyword arguments (the client's side). Exactly one input."""
    given = [x is not None for x in (prompt, chat, raw_prompt)]
    check(sum(given) == 1, "give exactly one of prompt, chat or raw_prompt")
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, seed=seed)
    if top_p is not None:
        sampling.top_p = top_p
    msg = specpool_pb2.GenerateRequest(
        sampling=sampling, max_new_tokens=max_new_tokens, stop=list(stop), stop_token_ids=list(stop_token_ids),
        policy=policy, k=k, session_id=session_id, tenant=tenant,
    )
    if prompt is not None:
        msg.prompt = prompt
    elif raw_prompt is not None:
        msg.raw_prompt = raw_prompt
    else:
        msg.chat.CopyFrom(specpool_pb2.Chat(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in chat or []]))
    return msg


@dataclass(frozen=True)
class Stats:
    """Counters and timings of one generation; mirrors GenerationStats."""

    rounds: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    mean_accepted_length: float = 0.0
    rounds_by_drafter: dict[str, int] = field(default_factory=dict)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_forward_s: float = 0.0  # inside the drafters' forwards; draft_s minus this is reaching them
    verify_forward_s: float = 0.0  # inside the target's forwards; verify_s minus this is reaching it

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "new_tokens": self.new_tokens, "prompt_tokens": self.prompt_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4), "rounds_by_drafter": dict(self.rounds_by_drafter),
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "wall_s": round(self.wall_s, 4), "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
            "draft_forward_s": round(self.draft_forward_s, 4), "verify_forward_s": round(self.verify_forward_s, 4),
        }


def stats_to_proto(stats: Stats) -> specpool_pb2.GenerationStats:
    return specpool_pb2.GenerationStats(
        rounds=stats.rounds, new_tokens=stats.new_tokens, prompt_tokens=stats.prompt_tokens,
        mean_accepted_length=stats.mean_accepted_length, rounds_by_drafter=stats.rounds_by_drafter,
        draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
        wall_s=stats.wall_s, draft_s=stats.draft_s, verify_s=stats.verify_s,
        draft_forward_s=stats.draft_forward_s, verify_forward_s=stats.verify_forward_s,
    )


def stats_from_proto(msg: specpool_pb2.GenerationStats) -> Stats:
    return Stats(
        rounds=msg.rounds, new_tokens=msg.new_tokens, prompt_tokens=msg.prompt_tokens,
        mean_accepted_length=msg.mean_accepted_length, rounds_by_drafter=dict(msg.rounds_by_drafter),
        draft_tokens=msg.draft_tokens, accepted_tokens=msg.accepted_tokens,
        wall_s=msg.wall_s, draft_s=msg.draft_s, verify_s=msg.verify_s,
        draft_forward_s=msg.draft_forward_s, verify_forward_s=msg.verify_forward_s,
    )


def finish_reason_to_proto(reason: str) -> int:
    return FINISH_REASONS[reason]


def finish_reason_name(value: int) -> str:
    return FINISH_NAMES.get(value, "unspecified")
