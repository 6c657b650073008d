"""OpenAI's HTTP API <-> specpool's requests and outcomes (issue 28): parsing, checking, responses.

Pure (no Starlette, no torch): ``specpool/services/openai_http.py`` serves it. A request body is
checked completely before anything runs: ``parse_chat`` / ``parse_completion`` return a
``GenerationSpec`` and the ``ResponseOptions`` the answer needs, or raise ``OpenAIError`` (an HTTP
status and OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``).

Where specpool differs from OpenAI, it says so with a 400 instead of ignoring a field:
- supported: ``model`` (must be the served target), ``messages`` (text only) / ``prompt`` (one
  string, no chat template), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
  ``seed``, ``stop``, ``n`` = 1, ``stream``, ``stream_options.include_usage``, ``user`` (an end-user
  label OpenAI uses for abuse monitoring; accepted and not used);
- specpool's extra fields: ``policy``, ``drafter`` (a fixed drafter: policy ``fixed:NAME``), ``k``,
  ``session_id``, ``tenant``, ``top_k``;
- refused: ``n`` > 1, log-probabilities, tools and functions, structured output, penalties,
  ``logit_bias``, audio, images and files, ``echo`` / ``suffix`` / ``best_of`` > 1, and any field
  this module does not know. A field that asks for nothing (``null``, ``false``, ``n: 1``,
  ``presence_penalty: 0``, ``response_format: {"type": "text"}``) is accepted: clients send those.

Defaults follow OpenAI, not gRPC: an omitted ``temperature`` is 1.0 (sampling; gRPC's is 0,
greedy), and a sampled request without ``seed`` gets a fresh random seed, so two identical calls
differ as they do on OpenAI (give ``seed`` to repeat one; greedy needs ``temperature: 0``). An
omitted ``max_tokens`` is the server's default (``--max-new-tokens``), not "up to the context".
Chat content given as a list of text parts is joined with newlines (as vLLM does); the
``developer`` role is the ``system`` role (OpenAI's newer name for it).
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from specpool.core.defaults import MAX_DRAFT_LENGTH, MAX_STOP_CHARS, MAX_STOP_STRINGS
from specpool.core.errors import SpecpoolError
from specpool.services.api import GenerationSpec, Stats
from specpool.services.status import grpc_status

OPENAI_DEFAULT_TEMPERATURE = 1.0
MAX_SEED = 2**63 - 1  # OpenAI's seed is an int64
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# -- errors -----------------------------------------------------------------------------------------
# gRPC status name -> (HTTP status, OpenAI error code). The one table: domain errors reach it
# through ``grpc_status`` (the one mapping of errors to statuses), so HTTP and gRPC agree.
#
# NOT_FOUND is 400, not 404: every NOT_FOUND a request can meet names something in its *body* (a
# drafter or policy the server does not have), while the URL it was sent to exists. HTTP's 404 is
# about the URL, and OpenAI's clients raise NotFoundError for it, which reads as "wrong endpoint";
# a 400 naming the unknown drafter tells the caller to fix the body, as the unknown ``model`` does.
HTTP_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_value"),
    "OUT_OF_RANGE": (400, "invalid_value"),
    "NOT_FOUND": (400, "not_found"),
    "FAILED_PRECONDITION": (400, "failed_precondition"),
    "UNAUTHENTICATED": (401, "invalid_api_key"),
    "PERMISSION_DENIED": (403, "permission_denied"),
    "ABORTED": (409, "session_busy"),  # the session already has a request running
    "ALREADY_EXISTS": (409, "already_exists"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_exceeded"),
    "CANCELLED": (499, "cancelled"),  # nginx's "client closed request": rarely seen by anyone
    "INTERNAL": (500, "internal_error"),
    "UNKNOWN": (500, "internal_error"),
    "DATA_LOSS": (500, "internal_error"),
    "UNIMPLEMENTED": (501, "unimplemented"),
    "UNAVAILABLE": (503, "unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}
_STATUS_NAME = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                405: "UNIMPLEMENTED", 409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
                499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


class OpenAIError(SpecpoolError):
    """An HTTP error in OpenAI's shape. A ``SpecpoolError`` whose ``code`` is the matching gRPC
    status name, so refusals are counted by status like every other request; OpenAI's own error
    code (``"model_not_found"``, ...) is ``error_code``."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        # OpenAI: "invalid_request_error" for what the caller must fix, "server_error" for ours.
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.error_code = code
        self.code = _STATUS_NAME.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.error_code}}


def http_error(exc: BaseException) -> OpenAIError:
    """Any exception a request may end with, as the HTTP error to answer."""
    if isinstance(exc, OpenAIError):
        return exc
    status, message = grpc_status(exc)
    http, code = HTTP_STATUS.get(status.name, (500, "internal_error"))
    return OpenAIError(http, message, code=code)


def _bad(message: str, param: str | None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# -- parsing ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseOptions:
    """How to answer a request (what the ``GenerationSpec`` does not say)."""

    kind: str  # "chat" (chat.completion) or "completion" (text_completion)
    model: str
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage


# Fields OpenAI defines that specpool cannot honour: accepted only when they ask for nothing.
_INERT = {
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or v == 0,
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None or v is False,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "presence_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "frequency_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "logit_bias": lambda v: v is None or v == {},
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "store": lambda v: v is None or v is False,  # OpenAI keeps stored completions; specpool keeps nothing
    "service_tier": lambda v: v is None or (isinstance(v, str) and v in ("auto", "default")),
}
_COMPLETION_INERT = {
    "logprobs": lambda v: v is None,  # an int here: the top log-probabilities per token
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None or v == "",
    "best_of": lambda v: v is None or (_is_int(v) and v == 1),
    "presence_penalty": _INERT["presence_penalty"],
    "frequency_penalty": _INERT["frequency_penalty"],
    "logit_bias": _INERT["logit_bias"],
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user",
           "policy", "drafter", "k", "session_id", "tenant", "top_k"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"} | set(_INERT)
_COMPLETION_FIELDS = _COMMON | {"prompt"} | set(_COMPLETION_INERT)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: Mapping, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _bad(f"{name} must be an integer, got {_show(value)}", name, "invalid_type")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise _bad(f"{name} must be {bounds}, got {value}", name)
    return value


def _number(body: Mapping, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value):
        raise _bad(f"{name} must be a number, got {_show(value)}", name, "invalid_type")
    return float(value)


def _string(body: Mapping, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(f"{name} must be a string, got {_show(value)}", name, "invalid_type")
    return value


def _bool(body: Mapping, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false, got {_show(value)}", name, "invalid_type")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_body(body: Any, known: set[str], inert: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_type")
    for name in body:
        if name not in known:
            raise _bad(f"unrecognized request argument: {name}", str(name), "unknown_parameter")
    for name, asks_nothing in inert.items():
        if name in body and not asks_nothing(body[name]):
            raise _bad(f"{name} is not supported by specpool (got {_show(body[name])})", name, "unsupported_parameter")
    return body


def _common(body: Mapping[str, Any], served_model: str, kind: str) -> tuple[dict, ResponseOptions]:
    """What chat and completions share: (GenerationSpec fields, response options)."""
    model = body.get("model")
    if model is None:
        raise _bad("model is required: the served target's name (GET /v1/models lists it)", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise _bad(f"model must be a string, got {_show(model)}", "model", "invalid_type")
    if model != served_model:
        raise _bad(f"the model {model!r} is not served here; this server serves {served_model!r}", "model", "model_not_found")
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise _bad(f"n must be 1 (specpool returns one choice per request), got {n}", "n", "unsupported_parameter")

    stream = _bool(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, Mapping):
            raise _bad(f"stream_options must be an object, got {_show(options)}", "stream_options", "invalid_type")
        for name in options:
            if name != "include_usage":
                raise _bad(f"unrecognized argument stream_options.{name}", f"stream_options.{name}", "unknown_parameter")
        include_usage = _bool(options, "include_usage")

    temperature = _number(body, "temperature")
    temperature = OPENAI_DEFAULT_TEMPERATURE if temperature is None else temperature
    if not 0.0 <= temperature <= 2.0:
        raise _bad(f"temperature must be in 0..2, got {temperature}", "temperature")
    top_p = _number(body, "top_p")
    top_p = 1.0 if top_p is None else top_p
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    seed = _int(body, "seed", -MAX_SEED - 1, MAX_SEED)
    if seed is None:
        # OpenAI samples afresh on every call; a fixed default would repeat one answer forever.
        seed = secrets.randbits(63) if temperature > 0 else 0

    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list):
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad(f"stop has at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
        if not all(isinstance(s, str) for s in stop):
            raise _bad("stop must be a string or a list of strings", "stop", "invalid_type")
        stops = tuple(stop)
    elif stop is not None:
        raise _bad(f"stop must be a string or a list of strings, got {_show(stop)}", "stop", "invalid_type")
    for s in stops:
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise _bad(f"stop strings must have 1..{MAX_STOP_CHARS} characters, got {_show(s)}", "stop")

    max_tokens = _int(body, "max_tokens", 1)
    if kind == "chat":
        max_completion = _int(body, "max_completion_tokens", 1)
        if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
            raise _bad(f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion}) differ; "
                       "give one (max_tokens is the older name)", "max_completion_tokens")
        max_tokens = max_completion if max_completion is not None else max_tokens

    _string(body, "user")  # an end-user label for OpenAI's abuse monitoring; nothing here uses it
    policy = _string(body, "policy")
    drafter = _string(body, "drafter")
    for name, value in (("policy", policy), ("drafter", drafter)):
        if value is not None and not value.strip():
            raise _bad(f"{name} is empty; omit it for the server's default", name)
    if policy is not None and drafter is not None:
        raise _bad("give either drafter (a fixed drafter) or policy, not both", "drafter")
    k = _int(body, "k", 1, MAX_DRAFT_LENGTH)
    top_k = _int(body, "top_k", 0)
    fields = dict(
        temperature=temperature, top_p=top_p, top_k=top_k or 0, seed=seed, max_new_tokens=max_tokens or 0,
        stop=stops, policy=f"fixed:{drafter}" if drafter is not None else (policy or ""), k=k or 0,
        session_id=_string(body, "session_id") or "", tenant=_string(body, "tenant") or "",
    )
    return fields, ResponseOptions(kind, model, stream, include_usage)


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            here = f"{where}[{j}]"
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise _bad(f"{here} must be an object with a type", here, "invalid_type")
            if part["type"] != "text":
                raise _bad(f"{here} has type {part['type']!r}: specpool takes text only (no images, audio or files)",
                           here, "unsupported_parameter")
            if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
                raise _bad(f"{here} must be {{\"type\": \"text\", \"text\": STRING}}", here, "invalid_type")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(f"{where} must be a string or a list of text parts, got {_show(content)}", where, "invalid_type")


def parse_chat(body: Any, served_model: str) -> tuple[GenerationSpec, ResponseOptions]:
    """A ``POST /v1/chat/completions`` body (decoded JSON), checked: the chat template applies."""
    body = _check_body(body, _CHAT_FIELDS, _INERT)
    fields, options = _common(body, served_model, "chat")  # the model first: a wrong one explains the rest
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content}", "messages", "invalid_type")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise _bad(f"{where} must be an object {{role, content}}", where, "invalid_type")
        for name in m:
            if name not in ("role", "content"):
                raise _bad(f"{where}.{name} is not supported by specpool (messages carry role and content only)",
                           f"{where}.{name}", "unsupported_parameter")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {_show(role)} (tool messages are not supported)",
                       f"{where}.role")
        if "content" not in m:
            raise _bad(f"{where}.content is required", f"{where}.content", "missing_required_parameter")
        turns.append((ROLES[role], _content(m["content"], f"{where}.content")))
    if not any(content.strip() for _, content in turns):
        raise _bad("the prompt is empty: every message is blank", "messages")
    return GenerationSpec(input_kind="chat", messages=tuple(turns), **fields), options


def parse_completion(body: Any, served_model: str) -> tuple[GenerationSpec, ResponseOptions]:
    """A ``POST /v1/completions`` body (decoded JSON), checked: the prompt as is, no chat template."""
    body = _check_body(body, _COMPLETION_FIELDS, _COMPLETION_INERT)
    fields, options = _common(body, served_model, "completion")
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise _bad("prompt must be a string or a list of exactly one string (no batches, no token ids)",
                       "prompt", "unsupported_parameter")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad(f"prompt must be a string, got {_show(prompt)}", "prompt", "invalid_type")
    if not prompt.strip():
        raise _bad("the prompt is empty", "prompt")
    return GenerationSpec(input_kind="raw", text=prompt, **fields), options


PARSERS = {"chat": parse_chat, "completion": parse_completion}


# -- responses --------------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def specpool_figures(session_id: str, policy: str, stats: Stats) -> dict:
    """What speculation did for this request (the ``specpool`` object of every response)."""
    return {
        "session_id": session_id, "policy": policy, "rounds": stats.rounds,
        "tokens_per_round": round(stats.new_tokens / stats.rounds, 4) if stats.rounds else 0.0,
        "mean_accepted_length": round(stats.mean_accepted_length, 4), "rounds_by_drafter": dict(stats.rounds_by_drafter),
        "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens, "wall_s": round(stats.wall_s, 4),
    }


def response(options: ResponseOptions, text: str, finish_reason: str, stats: Stats, session_id: str, policy: str,
             response_id: str | None = None, created: int | None = None) -> dict:
    """A whole answer: a ``chat.completion`` or a ``text_completion`` object."""
    if options.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": response_id or new_id(options.kind), "object": obj, "created": created or now(), "model": options.model,
            "system_fingerprint": None, "choices": [choice], "usage": usage(stats),
            "specpool": specpool_figures(session_id, policy, stats)}


class ChunkWriter:
    """One streamed answer's chunks, all with one id and ``created``, in OpenAI's order: a first
    chunk (chat: the assistant role), one per piece of text, one with the finish reason, and with
    ``include_usage`` one with ``choices: []`` and the usage (``usage: null`` on the others)."""

    def __init__(self, options: ResponseOptions):
        self.options = options
        self.id = new_id(options.kind)
        self.created = now()

    def _chunk(self, choices: list, **extra) -> dict:
        obj = "chat.completion.chunk" if self.options.kind == "chat" else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.options.model,
               "system_fingerprint": None, "choices": choices}
        if self.options.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.options.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def first(self) -> dict | None:
        """Chat's opening chunk (the role); completions have none."""
        return self._chunk([self._choice("", None, role=True)]) if self.options.kind == "chat" else None

    def text(self, text: str) -> dict:
        return self._chunk([self._choice(text, None)])

    def finish(self, finish_reason: str, session_id: str, policy: str, stats: Stats) -> dict:
        return self._chunk([self._choice(None, finish_reason)], specpool=specpool_figures(session_id, policy, stats))

    def usage(self, session_id: str, policy: str, stats: Stats) -> dict:
        chunk = self._chunk([], specpool=specpool_figures(session_id, policy, stats))
        chunk["usage"] = usage(stats)
        return chunk


def model_list(model: str, created: int, drafters: list[str], default_policy: str) -> dict:
    """``GET /v1/models``: the one target, with the drafter pool and default policy as metadata."""
    return {"object": "list", "data": [model_card(model, created, drafters, default_policy)]}


def model_card(model: str, created: int, drafters: list[str], default_policy: str) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "specpool",
            "specpool": {"drafters": list(drafters), "default_policy": default_policy}}


__all__ = ["ChunkWriter", "HTTP_STATUS", "OPENAI_DEFAULT_TEMPERATURE", "OpenAIError", "PARSERS", "ResponseOptions",
           "http_error", "model_card", "model_list", "parse_chat", "parse_completion", "response", "specpool_figures",
           "usage"]
