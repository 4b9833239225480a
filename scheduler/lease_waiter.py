"""Decode's waits for leases prefill will announce under a transfer key (overlapped dispatch).

One daemon thread per awaited transfer long-polls prefill's side channel (AwaitLease, parked
there until prefill's ``request_finished`` settles the key or the hold runs out) until it
learns the lease's params, prefill's failure, or its own deadline passes; the outcome goes to
an inbox the engine thread takes at its next step (``take``), as it takes the ranks' reports.
The engine thread never waits here. With chunked pulls (``chunked``) each partial
announcement prefill makes while it computes goes to the inbox too (``Settled.partial``), and
the wait goes on for the next one, until the final one.

Bounds: at most ``max_waits`` waits at once (another fails at once), each ends by
``timeout_s`` after it started, plus at most one ``call_timeout_s`` when a side channel stops
answering mid-call (a prefill that is dead, unreachable or never got the request fails the
load with PREFILL_TIMEOUT then), and a cancelled wait's thread ends within one hold. Cancels
go to prefill from one sender thread through a bounded queue; one that does not fit is
dropped with a warning (prefill's lease then ends by expiry, as an unread one does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import msgspec

from connector.errors import HandshakeError, PeerRestarted
from connector.metadata import FailureKind, LoadFailure
from connector.net import side_channel_client
from connector.params import AwaitedLease
from connector.protocol import ANNOUNCED_FAILED, ANNOUNCED_LEASED, ANNOUNCED_PARTIAL, ReaderId

logger = logging.getLogger(__name__)

MAX_WAITS = 256  # awaited transfers at once (a thread each)
MAX_QUEUED_CANCELS = 4096
HOLD_S = 1.0  # one AwaitLease's hold on prefill's side: a cancelled wait ends within it
RETRY_S = 0.05  # after a side channel that did not answer or refused, ask again this late


class Settled(msgspec.Struct, frozen=True, gc=False):
    """What an awaited transfer came to: prefill's params for decode, or why none."""

    request_id: str
    awaited: AwaitedLease
    params: dict[str, object] | None = None
    failure: LoadFailure | None = None
    engine_id: str = ""  # the engine that announced (its Hello's; the params must name it)
    partial: bool = False  # chunked pulls: the blocks written so far; the wait goes on


class LeaseWaiter:
    """``timeout_s``: one wait's bound; ``call_timeout_s``: one side-channel exchange's."""

    def __init__(
        self,
        *,
        timeout_s: float,
        call_timeout_s: float,
        secret: str | None,
        reader: ReaderId | None = None,
        max_waits: int = MAX_WAITS,
        clock: Callable[[], float] = time.monotonic,
        chunked: bool = False,  # ask for partial announcements too (chunked pulls)
    ) -> None:
        self._chunked = chunked
        self._timeout_s = timeout_s
        self._call_timeout_s = call_timeout_s
        self._secret = secret
        self._reader = reader
        self._max_waits = max_waits
        self._clock = clock
        self._lock = threading.Lock()  # guards _waits and _inbox
        self._waits: dict[str, threading.Event] = {}  # request id -> its stop flag
        self._inbox: list[Settled] = []
        self._cancels: queue.Queue[AwaitedLease] = queue.Queue(MAX_QUEUED_CANCELS)
        self._canceller: threading.Thread | None = None

    def wait(self, request_id: str, awaited: AwaitedLease) -> None:
        """Start waiting for ``awaited``'s lease (a request already waiting keeps its wait)."""
        stop = threading.Event()
        with self._lock:
            if request_id in self._waits:
                return
            full = len(self._waits) >= self._max_waits
            if not full:
                self._waits[request_id] = stop
        if full:
            why = (
                f"{self._max_waits} loads already wait for prefill announcements on this engine; "
                "this one was not started (send fewer overlapped requests at once, or send "
                "this one sequentially)"
            )
            failure = LoadFailure(FailureKind.PREFILL_TIMEOUT, why)
            self._settle(Settled(request_id, awaited, failure=failure), None)
            return
        thread = threading.Thread(
            target=self._run,
            args=(request_id, awaited, stop),
            name=f"nixl-pd-await-{awaited.transfer_key[:16]}",
            daemon=True,
        )
        thread.start()

    def take(self) -> list[Settled]:
        """The waits that settled since the last call (engine thread)."""
        with self._lock:
            settled, self._inbox = self._inbox, []
        return settled

    def cancel(self, request_id: str, awaited: AwaitedLease) -> None:
        """Stop waiting for ``request_id`` and tell prefill to end (or never draw) the lease."""
        with self._lock:
            stop = self._waits.pop(request_id, None)
        if stop is not None:
            stop.set()
        if self._canceller is None:  # the cancel sender, started at the first cancel
            self._canceller = threading.Thread(
                target=self._send_cancels, name="nixl-pd-cancel", daemon=True
            )
            self._canceller.start()
        try:
            self._cancels.put_nowait(awaited)
        except queue.Full:
            logger.warning(
                "transfer %s: too many cancels queued; prefill's lease for it ends by expiry",
                awaited.transfer_key,
            )

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waits) + len(self._inbox)

    def stop(self) -> None:
        with self._lock:
            stops, self._waits = list(self._waits.values()), {}
        for stop in stops:
            stop.set()

    def _run(self, request_id: str, awaited: AwaitedLease, stop: threading.Event) -> None:
        try:
            settled = self._await(request_id, awaited, stop)
        except Exception as exc:  # a bug fails this load, never the thread silently
            logger.exception("transfer %s: waiting for its lease failed", awaited.transfer_key)
            failure = LoadFailure(FailureKind.INTERNAL, f"waiting for prefill's lease: {exc!r}")
            settled = Settled(request_id, awaited, failure=failure)
        if settled is not None:
            self._settle(settled, stop)

    def _settle(self, settled: Settled, stop: threading.Event | None) -> None:
        with self._lock:
            if stop is not None and self._waits.get(settled.request_id) is not stop:
                return  # cancelled meanwhile: nobody wants it
            if not settled.partial:
                self._waits.pop(settled.request_id, None)
            self._inbox.append(settled)

    def _await(
        self, request_id: str, awaited: AwaitedLease, stop: threading.Event
    ) -> Settled | None:
        """Ask until the key settles, the deadline passes or the wait is cancelled (None)."""
        deadline = self._clock() + self._timeout_s
        engine_id, boot_id = "", ""
        after_generation = 0 if self._chunked else None
        last_error = "its side channel never answered"
        while not stop.is_set():
            remaining_s = deadline - self._clock()
            if remaining_s <= 0:
                break
            call_timeout_s = min(self._call_timeout_s, remaining_s)
            try:
                if not boot_id:
                    hello = side_channel_client.fetch_identity(
                        awaited.host, awaited.port, engine_id=awaited.engine_id,
                        secret=self._secret, timeout_s=call_timeout_s,
                    )  # fmt: skip
                    engine_id, boot_id = hello.engine_id, hello.boot_id
                hold_s, asked_at = min(HOLD_S, remaining_s), self._clock()
                reply = side_channel_client.await_lease(
                    awaited.host, awaited.port, awaited.transfer_key,
                    engine_id=engine_id, boot_id=boot_id, hold_s=hold_s,
                    secret=self._secret, timeout_s=call_timeout_s, reader=self._reader,
                    after_generation=after_generation,
                )  # fmt: skip
            except PeerRestarted as exc:
                why = f"prefill restarted while decode waited (the request it got is gone): {exc}"
                failure = LoadFailure(FailureKind.PREFILL_RESTARTED, why)
                return Settled(request_id, awaited, failure=failure)
            except HandshakeError as exc:
                last_error = str(exc)
                stop.wait(min(RETRY_S, max(0.0, deadline - self._clock())))
                continue
            if reply.status == ANNOUNCED_PARTIAL and after_generation is not None:
                after_generation = max(after_generation, reply.generation)
                partial = Settled(request_id, awaited, reply.params, None, engine_id, True)
                self._settle(partial, stop)
                continue
            if reply.status == ANNOUNCED_LEASED:
                return Settled(request_id, awaited, params=reply.params, engine_id=engine_id)
            if reply.status == ANNOUNCED_FAILED:
                why = f"prefill {engine_id!r} drew no lease: {reply.reason}"
                return Settled(
                    request_id, awaited, failure=LoadFailure(FailureKind.PREFILL_FAILED, why)
                )
            if self._clock() - asked_at < hold_s / 2:  # "pending" at once: the server parks
                stop.wait(RETRY_S)  # no more (MAX_PARKED); do not spin
        if stop.is_set():
            return None
        why = (
            f"prefill {engine_id or awaited.engine_id or ''!r} at {awaited.host}:{awaited.port} "
            "announced no lease "
            f"for transfer_key {awaited.transfer_key!r} within {self._timeout_s} s (last: "
            f"{last_error}); is it up, and did the router send it the request with that key?"
        )
        return Settled(request_id, awaited, failure=LoadFailure(FailureKind.PREFILL_TIMEOUT, why))

    def _send_cancels(self) -> None:
        while True:
            awaited = self._cancels.get()
            try:
                hello = side_channel_client.fetch_identity(
                    awaited.host, awaited.port, engine_id=awaited.engine_id,
                    secret=self._secret, timeout_s=self._call_timeout_s,
                )  # fmt: skip
                side_channel_client.cancel_transfer(
                    awaited.host, awaited.port, awaited.transfer_key,
                    engine_id=hello.engine_id, boot_id=hello.boot_id, secret=self._secret,
                    timeout_s=self._call_timeout_s, reader=self._reader,
                )  # fmt: skip
            except HandshakeError as exc:
                logger.info(
                    "transfer %s: cancel not delivered (prefill's lease, if any, ends by "
                    "expiry): %s",
                    awaited.transfer_key,
                    exc,
                )
