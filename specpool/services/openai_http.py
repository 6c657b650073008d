"""The OpenAI-compatible HTTP API (issue 28): a Starlette app over the router's one request path.

``build_openai_app(runner, keys, health)`` is mounted on the Ray Serve router through Serve's HTTP
ingress (``RouterServer.__serve_build_asgi_app__``); tests run it in process. Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions``: parsed and checked by
  ``specpool/services/openai_api.py``, run by ``RequestRunner.run(spec, "http", tenant)`` (the
  same path as gRPC: nothing is decoded here);
- ``GET /v1/models`` (and ``/v1/models/{id}``): the target, ``owned_by: "specpool"``, with the
  drafter pool and default policy as metadata;
- ``GET /health``: 200 ``{"status": "ok"}`` while the router can serve, else 503.

Order per request: the API key (``Authorization: Bearer KEY``, 401 in OpenAI's shape), the body
(400), the tenant the key may act for (403), and only then the runner: a bad request never reaches
a model. Refusals are counted by status under endpoint "http" (``RequestRunner.refused``).

Streaming is server-sent events through sse-starlette's ``EventSourceResponse`` rather than
Starlette's ``StreamingResponse``: it sends a comment ``ping`` every 15 s (proxies and load
balancers close a connection that stays silent while a long prompt is prefilled or a queue waits),
sets the headers that keep proxies from buffering (``X-Accel-Buffering: no``, ``Cache-Control``),
and watches for the client's disconnect. Events are ``data: {json}`` separated by a blank line
(``sep="\\n"``, as OpenAI sends them) and end with ``data: [DONE]``. A failure after the first byte
cannot change the status any more: it is one ``data: {"error": {...}}`` event and the stream ends
(what vLLM does; the openai client raises it as an APIError).

The request's ``Prepared`` event is awaited before the response starts, so errors found while
preparing (a drafter the server lacks, a prompt too long for the context) still get their own
status, and the session id can travel in the ``x-specpool-session-id`` header of every answer.

A client that disconnects mid-stream: sse-starlette cancels the body's task group. anyio cancels
*every* await inside a cancelled scope, again and again, which would also cancel the runner's wait
for its worker thread; so the runner's events are consumed in a task of their own (``_pumped``),
cancelled once, and awaited shielded: its generator is closed (``contextlib.aclosing``), the loop
stops before its next round and the session's caches are freed before the response finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specpool.services.admission import retry_headers
from specpool.services.api import GenerationSpec
from specpool.services.auth import ApiKeys, bearer_token
from specpool.services.openai_api import (PARSERS, ChunkWriter, OpenAIError, ResponseOptions, http_error, model_card,
                                          model_list, response)
from specpool.services.orchestrator import Outcome, Prepared
from specpool.services.runner import Event, RequestRunner

logger = logging.getLogger(__name__)

ENDPOINT = "http"  # the metrics label of this API
SESSION_HEADER = "x-specpool-session-id"
PING_SECONDS = 15
SSE_SEPARATOR = "\n"  # OpenAI's: "data: ...\n\n" (sse-starlette's default is "\r\n")
MAX_BODY_BYTES = 4 * 1024 * 1024  # a chat far past any context window; refused before parsing


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _error_response(error: OpenAIError) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def build_openai_app(runner: RequestRunner, keys: ApiKeys, health: Callable[[], Awaitable[bool]]) -> Starlette:
    """The ASGI app of the OpenAI-compatible API over ``runner`` (its orchestrator names the model)."""
    core = runner.core
    started = int(time.time())  # the model card's "created": when this server started serving it

    def authenticate(request: Request) -> str | None:
        """The request's key after checking it (401 when keys are on and it is missing or unknown)."""
        key = bearer_token(request.headers.get("authorization"))
        keys.principal(key)
        return key

    async def admit(request: Request, kind: str) -> tuple[GenerationSpec, ResponseOptions, str]:
        """(spec, options, tenant), or the refusal raised (and counted)."""
        try:
            key = authenticate(request)
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_BODY_BYTES:  # refused before reading it
                raise OpenAIError(413, f"the request body has {declared} bytes; at most {MAX_BODY_BYTES}")
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise OpenAIError(413, f"the request body has {len(raw)} bytes; at most {MAX_BODY_BYTES}")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise OpenAIError(400, "the request body is not valid JSON", code="invalid_json") from None
            spec, options = PARSERS[kind](body, core.info.model)
            return spec, options, keys.tenant_for(key, spec.tenant)
        except Exception as exc:  # noqa: BLE001 - counted, then answered by the caller
            runner.refused(ENDPOINT, exc)
            raise

    async def generate(request: Request, kind: str) -> Response:
        try:
            spec, options, tenant = await admit(request, kind)
        except Exception as exc:  # noqa: BLE001 - every refusal leaves in OpenAI's shape
            return _error_response(http_error(exc))
        events = runner.run(spec, ENDPOINT, tenant)
        try:
            prepared = await anext(events)  # before the response starts: a failure here keeps its own status
        except Exception as exc:  # noqa: BLE001
            await events.aclose()
            return _failed(exc)
        assert isinstance(prepared, Prepared)
        headers = {SESSION_HEADER: prepared.session_id}
        if options.stream:
            return EventSourceResponse(_sse(events, prepared, options), headers=headers, ping=PING_SECONDS, sep=SSE_SEPARATOR)
        outcome = None
        try:
            async for event in _pumped(events):  # closed however this handler ends (see _pumped)
                if isinstance(event, Outcome):
                    outcome = event
        except Exception as exc:  # noqa: BLE001
            return _failed(exc, headers)
        assert outcome is not None  # run() ends with the Outcome or raises
        return JSONResponse(response(options, outcome.text, outcome.finish_reason, outcome.stats, outcome.session_id,
                                     prepared.policy), headers=headers)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    def pool() -> list[str]:
        try:
            return list(core.drafters.default_pool())
        except Exception:  # noqa: BLE001 - metadata only: never fail the listing for it
            return []

    async def models(request: Request) -> Response:
        try:
            authenticate(request)
        except Exception as exc:  # noqa: BLE001
            return _error_response(http_error(exc))
        return JSONResponse(model_list(core.info.model, started, pool(), core.settings.policy))

    async def model(request: Request) -> Response:
        try:
            authenticate(request)
        except Exception as exc:  # noqa: BLE001
            return _error_response(http_error(exc))
        name = request.path_params["model"]
        if name != core.info.model:
            # The URL names the model here, so this one is a real 404 (as OpenAI answers it).
            return _error_response(OpenAIError(404, f"the model {name!r} is not served here; this server serves "
                                                    f"{core.info.model!r}", param="model", code="model_not_found"))
        return JSONResponse(model_card(core.info.model, started, pool(), core.settings.policy))

    async def healthz(request: Request) -> Response:
        try:
            ok = await health()
        except Exception:  # noqa: BLE001 - a health check that fails is an unhealthy server
            logger.warning("health check failed", exc_info=True)
            ok = False
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def http_exception(request: Request, exc: HTTPException) -> Response:
        """Starlette's own refusals (an unknown path, a wrong method) in OpenAI's shape too."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        error = OpenAIError(exc.status_code, message.get(exc.status_code, str(exc.detail)), code=code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", healthz, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_exception})


def _failed(exc: BaseException, headers: dict | None = None) -> JSONResponse:
    error = http_error(exc)
    if error.status >= 500:
        logger.error("HTTP request failed: %r", exc, exc_info=exc)
    response = _error_response(error)
    response.headers.update({**(headers or {}), **retry_headers(exc)})  # a quota refusal: when to retry
    return response


async def _sse(events: AsyncIterator[Event], prepared: Prepared, options: ResponseOptions) -> AsyncIterator[ServerSentEvent]:
    """The stream's events in OpenAI's chunk format, ``[DONE]`` last; an error ends it early."""
    writer = ChunkWriter(options)
    try:
        first = writer.first()
        if first is not None:
            yield _event(_dumps(first))
        async for event in _pumped(events):
            if isinstance(event, Outcome):
                if event.tail_text:
                    yield _event(_dumps(writer.text(event.tail_text)))
                yield _event(_dumps(writer.finish(event.finish_reason, event.session_id, prepared.policy,
                                                           event.stats)))
                if options.include_usage:
                    yield _event(_dumps(writer.usage(event.session_id, prepared.policy, event.stats)))
            elif event.text:  # a Chunk (a round whose tokens end in a cut character adds no text yet)
                yield _event(_dumps(writer.text(event.text)))
        yield _event("[DONE]")
    except Exception as exc:  # noqa: BLE001 - the status is sent already: the error is the last event
        error = http_error(exc)
        if error.status >= 500:
            logger.error("HTTP stream failed: %r", exc, exc_info=exc)
        yield _event(_dumps(error.body()))


def _event(data: str) -> ServerSentEvent:
    return ServerSentEvent(data, sep=SSE_SEPARATOR)  # an event's own separator wins over the response's


_END = object()


async def _pumped(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """``events``, consumed in a task of its own (see the module doc: a disconnect must close the
    runner's generator without cancelling its wait for the worker thread)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    queue.put_nowait((event, None))
            queue.put_nowait((_END, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((_END, exc))

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            event, exc = await queue.get()
            if exc is not None:
                raise exc
            if event is _END:
                return
            yield event
    finally:
        with anyio.CancelScope(shield=True):
            if not task.done():
                task.cancel()  # once: the runner stops the loop and waits for it
                await asyncio.wait([task])
            await events.aclose()  # a no-op unless the task was cancelled before it started


__all__ = ["SESSION_HEADER", "build_openai_app"]
