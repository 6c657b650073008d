"""Helpers the served-mode integration tests share: a free loopback port, polling until a
condition holds, a call to a Serve deployment's method through its handle, and the feedback records
a router wrote for one session."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    """``predicate()``'s first truthy value; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def call(handle, method: str, *args, timeout_s: float = 60):
    return handle.options(method_name=method).remote(*args).result(timeout_s=timeout_s)


def embedded_greedy(prompt: str, max_new_tokens: int, k: int, pool: list[str]) -> list[int]:
    """The embedded engine's greedy token ids for ``prompt``: the target's own tokens, whatever
    drafts, so what every served answer must equal."""
    import uuid

    from specpool.services.config import settings_from_env
    from specpool.services.engine import EmbeddedEngine
    from specpool.target.sampling import SamplingParams

    engine = EmbeddedEngine.default(settings_from_env().home)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=engine.stop_token_ids())
    return engine.generate(engine.encode_prompt(prompt), params, k=k, session_id=uuid.uuid4().hex,
                           policy="metasd-ucb", pool=pool).token_ids


def feedback_records(raw, stream: str, tenant: str, session: str | None = None) -> list:
    """The decoded feedback records of ``tenant`` (of its ``session`` only, when given) in the
    router's stream (one Redis stream per tenant: ``STREAM:TENANT``); ``raw`` is a Redis client
    with decoded responses."""
    from specpool.learning.feedback import FeedbackRecord
    from specpool.learning.feedback_redis import FIELD

    decoded = (FeedbackRecord.decode(fields[FIELD.decode()].encode()) for _, fields in raw.xrange(f"{stream}:{tenant}"))
    return [r for r in decoded if r.tenant == tenant and (session is None or r.session == session)]


def generate_concurrently(client, prompts, **fields) -> dict:
    """Each prompt's greedy token ids, all requests at once (one thread each, a fresh session each);
    raises the first error any of them met."""
    import threading
    import uuid

    results, errors = {}, []

    def run(prompt: str) -> None:
        try:
            results[prompt] = client.generate(prompt, session_id=uuid.uuid4().hex, **fields).token_ids
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
