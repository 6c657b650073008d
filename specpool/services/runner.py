"""The router's one asynchronous request path, shared by its gRPC and HTTP APIs.

``RequestRunner.run`` takes a checked request (``GenerationSpec``) and yields, in order, the
``Prepared`` request (its session id and prompt tokens are known), every ``Chunk`` of text as the
target accepts tokens, and the ``Outcome``. The decoding itself is ``Orchestrator.run`` in a worker
thread (the loop blocks on model calls between rounds); this module only moves its chunks onto the
event loop and keeps the request's clock:

- **stopping**: when the consumer stops early (a gRPC cancel or deadline, an HTTP client that
  disconnects: Serve cancels the handler, which closes this generator), the loop stops before its
  next round, the session's caches are released everywhere (``Orchestrator.run``), and only then
  does the generator finish, so the work has really stopped;
- **metrics** (``specpool/services/metrics.py``): requests in flight, and per finished request the
  queue time (arrival -> a worker thread takes it), time to first token, end-to-end latency and
  inter-token latency, labelled by endpoint; a request refused before it runs (bad input, a bad
  key) is counted by its status here, one that runs by ``Orchestrator.run``.

The gRPC servicer and the HTTP app translate messages and errors; neither decodes anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import Executor
from dataclasses import replace
from typing import AsyncIterator, Union

from specpool.services.admission import Admission, Ticket, prompt_bytes
from specpool.services.api import GenerationSpec
from specpool.services.detokenize import Chunk
from specpool.services.metrics import RequestTiming
from specpool.services.orchestrator import Orchestrator, Outcome, Prepared
from specpool.services.status import grpc_status

Event = Union[Prepared, Chunk, Outcome]
_DONE = object()


class RequestRunner:
    """Runs requests over one ``Orchestrator`` on a thread pool (one thread per request in flight)."""

    def __init__(self, core: Orchestrator, executor: Executor, admission: Admission | None = None):
        self.core = core
        self.executor = executor
        self.admission = admission or Admission()  # none: no quotas, no bound

    @property
    def metrics(self):
        return self.core.metrics

    async def run(self, spec: GenerationSpec, endpoint: str, tenant: str) -> AsyncIterator[Event]:
        """Prepare and run one request as ``tenant`` (already authenticated; it replaces whatever
        the spec named). Raises what the request failed with (``SpecpoolError`` and friends)."""
        arrived = time.perf_counter()
        loop = asyncio.get_running_loop()
        self.metrics.in_flight(endpoint, 1)
        clock = _Clock()
        ticket: Ticket | None = None
        used: int | None = None  # tokens the request consumed (its Outcome says)
        streamed = 0  # tokens handed out so far (what a request stopped early consumed, besides its prompt)
        try:
            job = self.executor.submit(self._prepare, spec, tenant, endpoint, clock)
            try:
                prepared, ticket = await asyncio.wrap_future(job)
            except asyncio.CancelledError:  # the thread may still admit it: release what it admits
                job.add_done_callback(_release_abandoned)
                raise
            except Exception as exc:  # noqa: BLE001 - refused before it ran: counted here
                self.metrics.request(tenant, grpc_status(exc)[0].name, endpoint)
                raise
            yield prepared
            async for event in self._stream(prepared, clock):
                if isinstance(event, Chunk):
                    streamed += len(event.token_ids)
                yield event
            if isinstance(event, Outcome):
                used = event.stats.prompt_tokens + event.stats.new_tokens
            timing = clock.timing(arrived, prepared_tokens=event.stats.new_tokens if isinstance(event, Outcome) else 0)
            self.metrics.latency(endpoint, timing)
        finally:
            if ticket is not None:  # the slot freed; unused tokens given back (a stopped request: what it streamed)
                ticket.release(used if used is not None else len(prepared.prompt_ids) + streamed)
            self.metrics.in_flight(endpoint, -1)

    def _prepare(self, spec: GenerationSpec, tenant: str, endpoint: str, clock: "_Clock") -> tuple[Prepared, Ticket]:
        """Admission (quotas: sizes and slot before tokenizing; tokens after), then the request."""
        clock.started = time.perf_counter()
        ticket = self.admission.precheck(tenant, prompt_bytes(spec.text, spec.messages), spec.max_new_tokens,
                                         self.core.settings.max_new_tokens)
        try:
            prepared = self.core.prepare(replace(spec, tenant=tenant, max_new_tokens=ticket.max_new_tokens))
            ticket.charge(len(prepared.prompt_ids))
        except BaseException:
            ticket.release(0)
            raise
        prepared.endpoint = endpoint
        return prepared, ticket

    async def _stream(self, prepared: Prepared, clock: "_Clock") -> AsyncIterator[Chunk | Outcome]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def on_chunk(chunk: Chunk) -> None:  # in the worker thread
            clock.token()
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        future = loop.run_in_executor(self.executor, self.core.run, prepared, on_chunk, stop.is_set)
        future.add_done_callback(lambda _: queue.put_nowait(_DONE))  # after every chunk (FIFO)
        try:
            while (item := await queue.get()) is not _DONE:
                yield item
            clock.finished = time.perf_counter()
            yield future.result()  # raises what the request failed with
        finally:
            if not future.done():  # cancelled, deadline passed, or the consumer went away
                stop.set()
                await asyncio.wait([future])

    async def generate(self, spec: GenerationSpec, endpoint: str, tenant: str) -> Outcome:
        """A whole answer (the unary APIs)."""
        outcome = None
        async with contextlib.aclosing(self.run(spec, endpoint, tenant)) as events:
            async for event in events:
                if isinstance(event, Outcome):
                    outcome = event
        assert outcome is not None  # run() ends with the Outcome or raises
        return outcome

    def refused(self, endpoint: str, exc: BaseException, tenant: str = "-") -> None:
        """Count a request refused before it reached ``run`` (a malformed message, a bad key):
        under tenant "-", since who sent it is not established (and its label must stay bounded)."""
        self.metrics.request(tenant, grpc_status(exc)[0].name, endpoint)


def _release_abandoned(job) -> None:
    """A request whose caller left while it was being admitted: free what it was admitted with."""
    if not job.cancelled() and job.exception() is None:
        job.result()[1].release(0)


class _Clock:
    """A request's moments (perf_counter seconds); written by the worker thread, read after it."""

    def __init__(self):
        self.started: float | None = None  # a worker thread took the request
        self.first_token: float | None = None
        self.finished: float | None = None

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def timing(self, arrived: float, prepared_tokens: int) -> RequestTiming:
        end = self.finished if self.finished is not None else time.perf_counter()
        first = self.first_token
        inter = (end - first) / (prepared_tokens - 1) if first is not None and prepared_tokens > 1 else None
        return RequestTiming(queue_s=(self.started or arrived) - arrived, total_s=end - arrived,
                             first_token_s=first - arrived if first is not None else None, inter_token_s=inter)


__all__ = ["Event", "RequestRunner"]
