"""OpenAI request bodies -> GenerationSpec, responses and chunks, errors -> HTTP (specpool/services/openai_api.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpool.core.defaults import MAX_DRAFT_LENGTH, MAX_STOP_STRINGS
from specpool.core.errors import (Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, ModelUnavailable,
                                  NotFound, PermissionDenied, ResourceExhausted, SessionBusy, Unauthenticated)
from specpool.services.api import GenerationSpec, Stats
from specpool.services.openai_api import (OPENAI_DEFAULT_TEMPERATURE, ChunkWriter, OpenAIError, ResponseOptions,
                                          http_error, model_list, parse_chat, parse_completion, response)
from specpool.services.status import grpc_status

MODEL = "tiny-target"
USER = [{"role": "user", "content": "the cat sat"}]


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": USER, **kw}


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "the cat sat", **kw}


def refused(parse, body, param=..., code=None, status=400) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body, MODEL)
    err = info.value
    assert err.status == status
    shape = err.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}
    assert shape["type"] == "invalid_request_error" and shape["message"]
    if param is not ...:
        assert shape["param"] == param, shape
    if code is not None:
        assert shape["code"] == code, shape
    return err


# -- what is accepted -----------------------------------------------------------------------------------
def test_chat_body_becomes_a_spec():
    spec, options = parse_chat(chat(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "developer", "content": "x"}],
        max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["\n", "end"], n=1, stream=True,
        stream_options={"include_usage": True}, user="u-1", policy="metasd-ucb", k=4, session_id="s1", tenant="acme",
        top_k=20), MODEL)
    assert spec == GenerationSpec(input_kind="chat", messages=(("system", "be brief"), ("user", "a\nb"), ("system", "x")),
                                  temperature=0.5, top_p=0.9, top_k=20, seed=3, max_new_tokens=7, stop=("\n", "end"),
                                  policy="metasd-ucb", k=4, session_id="s1", tenant="acme")
    assert options == ResponseOptions("chat", MODEL, stream=True, include_usage=True)


def test_completion_body_becomes_a_raw_spec():
    spec, options = parse_completion(completion(prompt=["one two"], drafter="ngram", temperature=0, stop="x",
                                                max_tokens=5), MODEL)
    assert spec.input_kind == "raw" and spec.text == "one two" and spec.messages == ()
    assert spec.policy == "fixed:ngram" and spec.stop == ("x",) and spec.max_new_tokens == 5 and spec.seed == 0
    assert options == ResponseOptions("completion", MODEL)


def test_defaults_follow_openai():
    spec, options = parse_chat(chat(), MODEL)
    assert spec.temperature == OPENAI_DEFAULT_TEMPERATURE == 1.0
    assert spec.max_new_tokens == 0 and spec.policy == "" and spec.k == 0 and spec.top_p == 1.0
    assert not options.stream and not options.include_usage
    # Sampled without a seed: a fresh one each call, so two calls differ as OpenAI's do.
    seeds = {parse_chat(chat(), MODEL)[0].seed for _ in range(8)}
    assert len(seeds) > 1
    assert parse_chat(chat(temperature=0), MODEL)[0].seed == 0  # greedy needs none
    assert parse_chat(chat(seed=42), MODEL)[0].seed == 42


def test_fields_that_ask_for_nothing_are_accepted():
    for parse, body in [(parse_chat, chat(logprobs=False, top_logprobs=None, tools=None, tool_choice="none",
                                          parallel_tool_calls=False, response_format={"type": "text"},
                                          presence_penalty=0, frequency_penalty=0.0, logit_bias={}, audio=None,
                                          modalities=["text"], store=False, stop=None, seed=None, n=None)),
                        (parse_completion, completion(logprobs=None, echo=False, suffix=None, best_of=1,
                                                      presence_penalty=0, logit_bias=None))]:
        parse(body, MODEL)


def test_max_completion_tokens():
    assert parse_chat(chat(max_completion_tokens=9), MODEL)[0].max_new_tokens == 9
    assert parse_chat(chat(max_completion_tokens=9, max_tokens=9), MODEL)[0].max_new_tokens == 9
    refused(parse_chat, chat(max_completion_tokens=9, max_tokens=8), "max_completion_tokens")
    refused(parse_completion, completion(max_completion_tokens=9), "max_completion_tokens", "unknown_parameter")


# -- what is refused ------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, param, code", [
    (dict(n=2), "n", "unsupported_parameter"),
    (dict(logprobs=True), "logprobs", "unsupported_parameter"),
    (dict(top_logprobs=3), "top_logprobs", "unsupported_parameter"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "unsupported_parameter"),
    (dict(tool_choice="auto"), "tool_choice", "unsupported_parameter"),
    (dict(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    (dict(function_call="auto"), "function_call", "unsupported_parameter"),
    (dict(parallel_tool_calls=True), "parallel_tool_calls", "unsupported_parameter"),
    (dict(response_format={"type": "json_object"}), "response_format", "unsupported_parameter"),
    (dict(presence_penalty=0.5), "presence_penalty", "unsupported_parameter"),
    (dict(frequency_penalty=-1), "frequency_penalty", "unsupported_parameter"),
    (dict(logit_bias={"5": 10}), "logit_bias", "unsupported_parameter"),
    (dict(audio={"voice": "alloy", "format": "wav"}), "audio", "unsupported_parameter"),
    (dict(modalities=["text", "audio"]), "modalities", "unsupported_parameter"),
    (dict(frobnicate=1), "frobnicate", "unknown_parameter"),
    (dict(model="gpt-4o"), "model", "model_not_found"),
    (dict(model=None), "model", "missing_required_parameter"),
    (dict(model=3), "model", "invalid_type"),
    (dict(max_tokens="5"), "max_tokens", "invalid_type"),
    (dict(max_tokens=True), "max_tokens", "invalid_type"),
    (dict(max_tokens=2.0), "max_tokens", "invalid_type"),
    (dict(max_tokens=0), "max_tokens", "invalid_value"),
    (dict(max_completion_tokens=-1), "max_completion_tokens", "invalid_value"),
    (dict(temperature=True), "temperature", "invalid_type"),
    (dict(temperature="0"), "temperature", "invalid_type"),
    (dict(temperature=2.5), "temperature", "invalid_value"),
    (dict(temperature=-0.1), "temperature", "invalid_value"),
    (dict(top_p=0), "top_p", "invalid_value"),
    (dict(top_p=1.5), "top_p", "invalid_value"),
    (dict(seed=1.5), "seed", "invalid_type"),
    (dict(seed=2**64), "seed", "invalid_value"),
    (dict(stop=5), "stop", "invalid_type"),
    (dict(stop=["a", 1]), "stop", "invalid_type"),
    (dict(stop=[""]), "stop", "invalid_value"),
    (dict(stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop", "invalid_value"),
    (dict(stream="yes"), "stream", "invalid_type"),
    (dict(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    (dict(stream=True, stream_options={"include_usage": 1}), "include_usage", "invalid_type"),
    (dict(stream=True, stream_options={"other": True}), "stream_options.other", "unknown_parameter"),
    (dict(stream=True, stream_options=[]), "stream_options", "invalid_type"),
    (dict(user=5), "user", "invalid_type"),
    (dict(k=0), "k", "invalid_value"),
    (dict(k=MAX_DRAFT_LENGTH + 1), "k", "invalid_value"),
    (dict(top_k=-1), "top_k", "invalid_value"),
    (dict(policy="metasd-ucb", drafter="ngram"), "drafter", "invalid_value"),
    (dict(policy=""), "policy", "invalid_value"),
    (dict(drafter=["ngram"]), "drafter", "invalid_type"),
    (dict(session_id=7), "session_id", "invalid_type"),
    (dict(tenant={}), "tenant", "invalid_type"),
])
def test_chat_refuses(extra, param, code):
    refused(parse_chat, chat(**extra), param, code)


@pytest.mark.parametrize("messages, param", [
    (None, "messages"),
    ([], "messages"),
    ("hello", "messages"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "tool", "content": "x", "tool_call_id": "1"}], "messages[0].tool_call_id"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x", "name": "bob"}], "messages[0].name"),
    ([{"role": "assistant", "content": None, "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "file", "file": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": ["text"]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "  "}], "messages"),
    (["hello"], "messages[0]"),
])
def test_chat_refuses_messages(messages, param):
    body = chat()
    if messages is None:
        del body["messages"]
    else:
        body["messages"] = messages
    refused(parse_chat, body, param)


@pytest.mark.parametrize("extra, param", [
    (dict(prompt=[1, 2, 3]), "prompt"),
    (dict(prompt=[[1, 2]]), "prompt"),
    (dict(prompt=["a", "b"]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=None), "prompt"),
    (dict(prompt=5), "prompt"),
    (dict(echo=True), "echo"),
    (dict(suffix="end"), "suffix"),
    (dict(best_of=2), "best_of"),
    (dict(logprobs=0), "logprobs"),
    (dict(logprobs=5), "logprobs"),
    (dict(n=3), "n"),
    (dict(messages=USER), "messages"),  # a chat field on completions
    (dict(tools=[]), "tools"),
    (dict(presence_penalty=1), "presence_penalty"),
])
def test_completion_refuses(extra, param):
    refused(parse_completion, completion(**extra), param)


@pytest.mark.parametrize("body", [[], "text", 3, None, True, [{"model": MODEL}]])
def test_body_must_be_an_object(body):
    refused(parse_chat, body, None, "invalid_type")
    refused(parse_completion, body, None, "invalid_type")


# Junk: any JSON value, and objects made of known field names with values of any JSON type.
_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=8)
_names = st.sampled_from(["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                          "seed", "stop", "n", "stream", "stream_options", "user", "policy", "drafter", "k",
                          "session_id", "tenant", "top_k", "logprobs", "tools", "echo", "suffix", "best_of",
                          "response_format", "presence_penalty", "modalities", "bogus"])
_bodies = st.one_of(_json, st.dictionaries(_names, _json, max_size=6).map(lambda d: {"model": MODEL, **d}),
                    st.fixed_dictionaries({"model": st.just(MODEL), "messages": st.lists(
                        st.dictionaries(st.sampled_from(["role", "content", "name"]), _json | st.sampled_from(
                            ["user", "system", "assistant"]), max_size=3), max_size=3)}),
                    st.fixed_dictionaries({"model": st.just(MODEL), "prompt": _json}))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies)
def test_junk_is_a_400_or_a_valid_spec(body):
    for parse in (parse_chat, parse_completion):
        try:
            spec, options = parse(body, MODEL)
        except OpenAIError as err:
            assert err.status == 400 and err.body()["error"]["message"]
            json.dumps(err.body())  # the answer can be sent
            continue
        assert isinstance(spec, GenerationSpec) and options.model == MODEL
        assert 0 <= spec.temperature <= 2 and 0 < spec.top_p <= 1 and spec.max_new_tokens >= 0
        assert spec.input_kind == ("chat" if parse is parse_chat else "raw")
        assert (spec.text if spec.input_kind == "raw" else "".join(c for _, c in spec.messages)).strip()


# -- responses and chunks -------------------------------------------------------------------------------
STATS = Stats(rounds=4, new_tokens=10, prompt_tokens=7, mean_accepted_length=2.5, rounds_by_drafter={"ngram": 3, "none": 1},
              draft_tokens=12, accepted_tokens=6, wall_s=0.123456)


def test_chat_response_shape():
    body = response(ResponseOptions("chat", MODEL), "hello", "length", STATS, "sess", "metasd-ucb")
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17}
    assert body["specpool"] == {"session_id": "sess", "policy": "metasd-ucb", "rounds": 4, "tokens_per_round": 2.5,
                                "mean_accepted_length": 2.5, "rounds_by_drafter": {"ngram": 3, "none": 1},
                                "draft_tokens": 12, "accepted_tokens": 6, "wall_s": 0.1235}


def test_completion_response_shape():
    body = response(ResponseOptions("completion", MODEL), "hi", "stop", STATS, "s", "fixed:ngram")
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}]
    assert response(ResponseOptions("completion", MODEL), "", "stop", Stats(), "s", "p")["specpool"]["tokens_per_round"] == 0


def test_chat_chunks():
    writer = ChunkWriter(ResponseOptions("chat", MODEL, stream=True, include_usage=True))
    chunks = [writer.first(), writer.text("a"), writer.text("b"), writer.finish("stop", "s", "p", STATS),
              writer.usage("s", "p", STATS)]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:3]] == [{"content": "a"}, {"content": "b"}]
    assert chunks[3]["choices"][0]["delta"] == {} and chunks[3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[3]["specpool"]["rounds"] == 4 and chunks[4]["specpool"]["rounds"] == 4
    assert all(c["usage"] is None for c in chunks[:4])
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["total_tokens"] == 17


def test_completion_chunks_without_usage():
    writer = ChunkWriter(ResponseOptions("completion", MODEL, stream=True))
    assert writer.first() is None
    chunk = writer.text("a")
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "a" and "usage" not in chunk
    last = writer.finish("length", "s", "p", STATS)
    assert last["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}


def test_model_list():
    listing = model_list(MODEL, 5, ["ngram", "noisy"], "metasd-ucb")
    assert listing == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 5, "owned_by": "specpool",
                                                   "specpool": {"drafters": ["ngram", "noisy"],
                                                                "default_policy": "metasd-ucb"}}]}


# -- errors -> HTTP ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc, status, code, kind", [
    (InvalidArgument("bad"), 400, "invalid_value", "invalid_request_error"),
    (NotFound("no drafter 'x'"), 400, "not_found", "invalid_request_error"),
    (FailedPrecondition("no features"), 400, "failed_precondition", "invalid_request_error"),
    (Unauthenticated("no key"), 401, "invalid_api_key", "invalid_request_error"),
    (PermissionDenied("other tenant"), 403, "permission_denied", "invalid_request_error"),
    (SessionBusy("busy"), 409, "session_busy", "invalid_request_error"),
    (ResourceExhausted("later"), 429, "rate_limit_exceeded", "invalid_request_error"),
    (Cancelled("gone"), 499, "cancelled", "invalid_request_error"),
    (RuntimeError("boom"), 500, "internal_error", "server_error"),
    (ModelUnavailable("down"), 503, "unavailable", "server_error"),
    (DeadlineExceeded("late"), 504, "timeout", "server_error"),
])
def test_errors_map_to_http(exc, status, code, kind):
    err = http_error(exc)
    assert (err.status, err.error_code, err.type) == (status, code, kind)
    assert err.body()["error"]["message"] == grpc_status(exc)[1]
    assert "Traceback" not in err.message


def test_openai_errors_keep_their_status_and_count_as_their_grpc_status():
    err = OpenAIError(400, "x", param="n", code="unsupported_parameter")
    assert http_error(err) is err
    assert grpc_status(err)[0].name == "INVALID_ARGUMENT"
    assert grpc_status(OpenAIError(401, "x"))[0].name == "UNAUTHENTICATED"
    assert grpc_status(OpenAIError(413, "x"))[0].name == "INVALID_ARGUMENT"
