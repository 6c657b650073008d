"""Which verify calls go into the target's next batch, and when (``TargetServer.Verify``).

Concurrent sessions' verify calls do not arrive in step: each session sends its next call a little
after its previous answer (5-50 ms of the router's work at 8 sessions on 2 cores,
``batch_trace.BatchTrace``). Ray Serve's ``@serve.batch`` alone seals a batch when it is full or its
wait has passed, and collects the next batch while the current one runs, so sessions that miss one
batch form a batch of their own, and the groups stay apart for good. This gate assembles each
batch itself and hands it to ``@serve.batch`` whole:

1. A call waits at the gate while a batch is released, running, or still answering (until the
   last of its answers has left: the sessions of that batch are then on their way back, and the
   wait of step 2 starts no earlier than they do).
2. The first call through opens an assembly. Later calls join it. It is released when every
   session of the last batch whose request has not ended has joined (``expected``), when it holds
   ``capacity`` calls, or ``wait_s`` after it opened, whichever comes first.
3. On release the gate shuts, and every member enters the batch queue in the same event-loop
   step with the batch size set to the member count, so Serve seals exactly this batch at once.

What it replaced, and why (bench/results/batch-trace/report.md): a gate that shut only while a
batch's handler ran, with Serve's own wait. In about one served run in ten at 8 sessions the
sessions fell into groups that verified apart for the rest of the run (batch sizes 1, 3 and 4 in
turn, 407 of 524 batches short of a session, a third fewer tokens/s), though 97.7 % of the
sessions came back within the wait. Serve's batch loop collects the next batch as soon as it seals
one and fixes a batch's size when it takes its first call, so a call of a session not in the last
batch (a new request's) that came after that stayed queued beyond the size, and a call that came
between a batch's sealing and its handler's start passed the open gate: either began a batch
during the other's forward, whose sessions then answered a forward later than the rest.

Single event loop, no locks; a replica's ``Verify`` and ``Release`` all run on it.
"""

from __future__ import annotations

import asyncio
GATE_FALLBACK_S = 1.0  # a released or answering batch that has not opened the gate after this, opens it


class _Assembly:
    def __init__(self) -> None:
        # (session, its release: the batch size). A list, not a dict by session: a retried call of
        # a session whose first call still waits here must not orphan that first call's release.
        self.members: list[tuple[str, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None


class BatchGate:
    """See the module docstring. ``capacity``: the most calls in one batch; ``wait_s``: the most an
    assembly waits for the sessions of the last batch."""

    def __init__(self, capacity: int, wait_s: float, fallback_s: float = GATE_FALLBACK_S):
        self.capacity = capacity
        self.wait_s = wait_s
        self.fallback_s = fallback_s
        self.expected: set[str] = set()  # sessions of the last batch whose request has not ended
        self._open = asyncio.Event()
        self._open.set()
        self._assembly: _Assembly | None = None
        self._running = False  # a batch's forward is running
        self._answering: set[str] = set()  # sessions of the last batch whose answer has not left
        self._epoch = 0  # counts releases and forwards: a fallback acts only if nothing happened since

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def join(self, session: str) -> int:
        """Wait until ``session``'s call may enter the batch queue; returns the batch's size."""
        while not self._open.is_set():
            await self._open.wait()
        loop = asyncio.get_running_loop()
        assembly = self._assembly
        if assembly is None:
            assembly = self._assembly = _Assembly()
        released = loop.create_future()
        member = (session, released)
        assembly.members.append(member)
        if self._complete(assembly):
            self._release(assembly)
        elif assembly.timer is None:  # the wait starts with the first call that has to wait
            assembly.timer = loop.call_later(self.wait_s, self._release, assembly)
        try:
            return await released
        except asyncio.CancelledError:
            if assembly is self._assembly:  # not released: leave it (an empty one releases nothing)
                assembly.members.remove(member)
            raise

    def fired(self, sessions: list[str]) -> None:
        """A batch of ``sessions`` starts its forward."""
        self._epoch += 1
        self._running = True
        self._answering = set(sessions)
        self.expected = set(sessions)

    def forward_done(self) -> None:
        """The batch's forward has ended (its callers are about to answer)."""
        self._running = False
        self._epoch += 1
        if not self._answering:
            self._open.set()
        else:
            asyncio.get_running_loop().call_later(self.fallback_s, self._reopen_if_stuck, self._epoch)

    def answer_left(self, session: str) -> None:
        """``session``'s answer, or its failure, has left: the gate opens after the batch's last.
        (A call that failed or was cancelled before its batch fired was never answering.)"""
        if session not in self._answering:
            return
        self._answering.discard(session)
        if not self._answering and not self._running:
            self._open.set()

    def request_ended(self, session: str) -> None:
        """``session``'s request has ended: no batch waits for its call any more."""
        self.expected.discard(session)
        if self._assembly is not None and self._complete(self._assembly):
            self._release(self._assembly)

    def _complete(self, assembly: _Assembly) -> bool:
        joined = {session for session, _ in assembly.members}
        return len(assembly.members) >= self.capacity or (bool(joined) and self.expected <= joined)

    def _release(self, assembly: _Assembly) -> None:
        if assembly is not self._assembly:
            return  # released already (the timer of an assembly that completed)
        self._assembly = None
        if assembly.timer is not None:
            assembly.timer.cancel()
        members = [(s, f) for s, f in assembly.members if not f.done()]
        if not members:
            return  # every member was cancelled: nothing to run, the gate stays open
        self._open.clear()
        self._epoch += 1
        for _, released in members:
            released.set_result(len(members))
        # Insurance: a released batch that never fires (every member cancelled on its way into the
        # queue) must not keep the gate shut.
        asyncio.get_running_loop().call_later(self.fallback_s, self._reopen_if_stuck, self._epoch)

    def _reopen_if_stuck(self, epoch: int) -> None:
        """Open the gate when nothing has happened since ``epoch`` (no release, forward start or
        end): a batch whose calls never all answered (a call that never ran its ``finally``), or a
        released batch that never fired."""
        if self._epoch == epoch and not self._running and not self._open.is_set():
            self._answering.clear()
            self._open.set()
