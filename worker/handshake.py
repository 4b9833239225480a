"""Fetch remote engines' WorkerHandshakes on background threads, off the engine thread.

Threading contract: handshake threads only talk ZMQ (through the injected ``fetch``) and put
``HandshakeResult`` values on a queue; they never touch the NIXL agent or any connector
state. The engine thread submits jobs and drains results with ``poll()``; everything done with
a result (validation, add_remote_agent, planning) happens there.

Each job fetches the handshake of every remote rank this rank needs, naming the boot the
requests' params name: a prefill restarted since is refused by its first answer (PeerRestarted,
never retried). A failed fetch is retried ``retries`` times with exponential backoff
(``backoff_s``, doubled per attempt), except a side channel that did not answer within the
per-attempt timeout (``fetch``'s): that fails the job at once, so the loads waiting on a dead
prefill fail after one timeout instead of every retry's, and the peer table's background
probes (worker/peers.py) find it again when it is back. A job always ends in exactly one
result, success or error: an unexpected exception in a thread is logged and reported, never lost.

Every result carries the job's phase timings (queued for a thread, each rank's fetch with its
attempts): a slow handshake says where its time went, in a failed job's error too.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from connector.errors import ConnectorError, HandshakeError, PeerRestarted, SideChannelTimeout
from connector.protocol import WorkerHandshake

logger = logging.getLogger(__name__)

_NOT_RETRIED = (
    " (a silent side channel is not asked again while requests wait: they fail now, and a "
    "background probe finds the engine when it answers again)"
)

# (host, port, remote tp_rank) -> that rank's handshake; raises HandshakeError.
Fetcher = Callable[[str, int, int], WorkerHandshake]
# The same, for the side channel's boot ``boot_id`` ("": any boot); PeerRestarted if another.
BootFetcher = Callable[[str, int, int, str], WorkerHandshake]


def any_boot(fetch: Fetcher) -> BootFetcher:
    """A BootFetcher that does not check the boot (injected fetchers: tests)."""
    return lambda host, port, tp_rank, boot_id: fetch(host, port, tp_rank)


@dataclass(frozen=True)
class HandshakeJob:
    """Fetch the handshakes of ``remote_ranks`` from the side channel at host:port."""

    engine_id: str  # the engine the requests expect to find there
    host: str
    port: int
    remote_ranks: tuple[int, ...]
    job_id: int = 0  # unique per submitted job: two jobs to one address never collide
    retries: int | None = None  # None: the client's setting; probes of a dead peer use 0
    boot_id: str = ""  # the boot the requests' params name ("": any)


@dataclass(frozen=True)
class Phase:
    """One step of a handshake and how long it took (seconds)."""

    name: str
    seconds: float


def describe_phases(phases: Sequence[Phase]) -> str:
    """``handshake phases: queued 0.00 s, fetch rank 0 30.12 s, ...; 30.14 s in all``."""
    steps = ", ".join(f"{phase.name} {phase.seconds:.2f} s" for phase in phases)
    return f"handshake phases: {steps}; {sum(p.seconds for p in phases):.2f} s in all"


@dataclass(frozen=True)
class HandshakeResult:
    """A finished job: every requested rank's handshake, or the reason it failed."""

    job: HandshakeJob
    handshakes: dict[int, WorkerHandshake] = field(default_factory=dict)
    error: str | None = None
    restarted: bool = False  # the side channel is another boot than the params name
    phases: tuple[Phase, ...] = ()  # queued, then each rank's fetch
    finished_s: float = 0.0  # the client's clock when the result was queued


class HandshakeClient:
    """A small pool of handshake threads and the queue that brings their results back."""

    def __init__(
        self,
        fetch: BootFetcher,
        *,
        retries: int,
        backoff_s: float = 0.05,
        max_threads: int = 4,
        wait: Callable[[float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._clock = clock
        self._retries = retries
        self._backoff_s = backoff_s
        self._stop = threading.Event()  # set by close(): backoff waits end, no new attempts
        self._wait = wait or self._stop.wait  # the backoff pause; tests record it instead
        self._results: queue.SimpleQueue[HandshakeResult] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="handshake")
        self._num_in_flight = 0  # the polling thread only (the transfer thread)

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def submit(self, job: HandshakeJob) -> None:
        """Start a job on a handshake thread; its result comes back from poll()."""
        self._num_in_flight += 1
        future = self._pool.submit(self._run, job, self._clock())
        future.add_done_callback(lambda done: self._surface_crash(job, done))

    def poll(self, wait_s: float = 0.0) -> list[HandshakeResult]:
        """Results finished since the last call; waits up to ``wait_s`` for the first one."""
        results: list[HandshakeResult] = []
        if self._num_in_flight == 0:  # nothing submitted is unanswered: nothing can arrive
            return results
        if wait_s > 0:
            try:
                results.append(self._results.get(timeout=wait_s))
            except queue.Empty:
                return results
        while not self._results.empty():  # one consumer (the caller): empty() is exact
            results.append(self._results.get_nowait())
        self._num_in_flight -= len(results)
        return results

    def close(self) -> None:
        """Stop retrying and wait for running fetches (each bounded by its own timeout)."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, job: HandshakeJob, submitted_s: float) -> None:
        phases = [Phase("queued", self._clock() - submitted_s)]
        try:
            handshakes = {
                rank: self._fetch_with_retries(job, rank, phases) for rank in job.remote_ranks
            }
            result = HandshakeResult(job, handshakes, phases=tuple(phases))
        except ConnectorError as error:
            restarted = isinstance(error.__cause__, PeerRestarted)
            error_text = f"{error} ({describe_phases(phases)})"
            result = HandshakeResult(
                job, error=error_text, restarted=restarted, phases=tuple(phases)
            )
        except Exception as error:  # a bug in a fetcher must not vanish with its thread
            logger.exception("handshake with %s:%d crashed", job.host, job.port)
            result = HandshakeResult(job, error=f"handshake crashed: {error!r}")
        self._results.put(dataclasses.replace(result, finished_s=self._clock()))

    def _fetch_with_retries(
        self, job: HandshakeJob, remote_rank: int, phases: list[Phase]
    ) -> WorkerHandshake:
        """One rank's handshake; its fetch time (every attempt, backoffs included) is appended
        to ``phases``, whether it succeeds or not."""
        started_s = self._clock()
        attempt = 0
        retries = self._retries if job.retries is None else job.retries
        while True:
            try:
                handshake = self._fetch(job.host, job.port, remote_rank, job.boot_id)
                phases.append(_fetch_phase(remote_rank, attempt, self._clock() - started_s))
                return handshake
            except ConnectorError as error:
                final = isinstance(error, (PeerRestarted, SideChannelTimeout))
                if final or attempt >= retries or self._stop.is_set():
                    phases.append(_fetch_phase(remote_rank, attempt, self._clock() - started_s))
                    note = _NOT_RETRIED if isinstance(error, SideChannelTimeout) else ""
                    raise HandshakeError(
                        f"rank {remote_rank} at {job.host}:{job.port} failed after "
                        f"{attempt + 1} attempt(s): {error}{note}"
                    ) from error
                delay_s = self._backoff_s * 2**attempt
                logger.info(
                    "handshake with %s:%d rank %d failed (%s); retrying in %.3f s",
                    job.host, job.port, remote_rank, error, delay_s,
                )  # fmt: skip
                self._wait(delay_s)
                attempt += 1

    def _surface_crash(self, job: HandshakeJob, future: Future[None]) -> None:
        """_run catches everything it can; this reports what escaped it (or a cancelled job)."""
        if future.cancelled():
            self._results.put(HandshakeResult(job, error="handshake cancelled: shutting down"))
            return
        error = future.exception()
        if error is not None:
            logger.error("handshake thread for %s:%d died: %r", job.host, job.port, error)
            self._results.put(HandshakeResult(job, error=f"handshake thread died: {error!r}"))


def _fetch_phase(remote_rank: int, attempt: int, seconds: float) -> Phase:
    tries = f" ({attempt + 1} attempts)" if attempt else ""
    return Phase(f"fetch rank {remote_rank}{tries}", seconds)
