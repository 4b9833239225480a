"""The rank's stall watchdog: says what a load has waited on too long, with the threads' stacks.

A load that waits (for its peer's handshake, its READs, or prefill's word on the lease) is
bounded by its own timeouts, but a wait of tens of seconds ends in a failure that says only
how it ended ("lease expired"), not where the time went. So the transfer thread publishes,
after every pass, what each load waits on (``StallWatch.publish``); a watchdog thread of its
own (``StallWatchdog``) checks once a second, and when a load has waited on the same thing for
``stall_after_s`` (or a transfer pass has not returned for that long: the thread that would
publish is itself stuck), it logs one warning naming every stalled wait and the Python stacks
of the connector's threads and the main thread (``sys._current_frames``). Each stalled wait is
logged once, and at most one warning goes out per ``repeat_after_s``: a stall costs a few
lines, never a flood. The watchdog is a Python thread: when the whole process stops (a GIL
holder, no CPU) it reports late, after the stop; the process's freeze watch
(connector/observability/freeze_watch.py) says why it stopped.

``StallWatch`` is the decision (pure, clock passed in, thread-safe); ``StallWatchdog`` the
thread that asks it and logs.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

logger = logging.getLogger(__name__)

STALL_AFTER_S = 5.0  # a wait without progress for this long is logged
REPEAT_AFTER_S = 30.0  # at most one stall warning per this long
CHECK_INTERVAL_S = 1.0  # how often the watchdog thread looks
# Threads whose stacks a stall warning shows: the connector's own (worker/connector.py,
# worker/handshake.py, worker/lease_proof.py, the scheduler's side channel and heartbeats),
# and the engine's main thread: a stall that stops every Python thread of the process (issue
# 31) is often a call there that holds the GIL, and its frame names it.
CONNECTOR_THREAD_PREFIXES = ("nixl-pd-", "handshake", "lease", "MainThread")
MAX_STALLS_LISTED = 16


# What a load can wait on: WaitKind -> its words in a report ({engine}, {address} filled in).
WAIT_WORDS = {
    "handshake": "the handshake with prefill engine {engine} at {address}",
    "lease check": "prefill engine {engine} ({address}) to answer the lease check before READs",
    "reads": "its READs from prefill engine {engine} at {address}",
    "proof": "prefill engine {engine} ({address}) to prove the lease held after the READs",
}


class Wait(NamedTuple):
    """What one load waits on now (a tuple: the transfer thread builds one per load per pass)."""

    request_id: str
    kind: str  # a key of WAIT_WORDS
    engine_id: str
    address: str

    def words(self) -> str:
        return WAIT_WORDS[self.kind].format(engine=self.engine_id, address=self.address)


@dataclass(frozen=True)
class Stall:
    """A wait that has not changed for ``waited_s`` seconds."""

    wait: Wait
    waited_s: float


@dataclass(frozen=True)
class StallReport:
    """What to log: the stalled waits, and how long a transfer pass has run if it is stuck."""

    stalls: tuple[Stall, ...]
    pass_running_s: float | None  # None: the transfer thread is not stuck in a pass

    def describe(self) -> str:
        lines = []
        if self.pass_running_s is not None:
            lines.append(
                f"the transfer thread has been in one pass for {self.pass_running_s:.1f} s"
            )
        for stall in self.stalls[:MAX_STALLS_LISTED]:
            lines.append(
                f"request {stall.wait.request_id} has waited {stall.waited_s:.1f} s for "
                f"{stall.wait.words()}"
            )
        if len(self.stalls) > MAX_STALLS_LISTED:
            lines.append(f"... and {len(self.stalls) - MAX_STALLS_LISTED} more stalled loads")
        return "; ".join(lines)


class StallWatch:
    """Since when each load has waited on what it waits on now, and which waits to report."""

    def __init__(
        self, *, stall_after_s: float = STALL_AFTER_S, repeat_after_s: float = REPEAT_AFTER_S
    ) -> None:
        self._stall_after_s = stall_after_s
        self._repeat_after_s = repeat_after_s
        # Guards everything below: the transfer thread publishes, the watchdog thread reports.
        self._lock = threading.Lock()
        self._since: dict[str, tuple[Wait, float]] = {}  # request id -> (its wait, since when)
        self._reported: set[Wait] = set()  # waits already logged
        self._pass_started_s: float | None = None  # a pass running since then
        self._pass_reported = False  # the running pass was logged as stuck
        self._last_report_s: float | None = None

    def pass_started(self, now_s: float) -> None:
        with self._lock:
            self._pass_started_s = now_s
            self._pass_reported = False

    def publish(self, waits: Sequence[Wait], now_s: float) -> None:
        """The end of a pass: what every load waits on now (a load not listed has ended)."""
        with self._lock:
            since: dict[str, tuple[Wait, float]] = {}
            for wait in waits:
                previous = self._since.get(wait.request_id)
                if previous is None or previous[0] != wait:
                    previous = (wait, now_s)  # a new wait starts now
                since[wait.request_id] = previous
            self._since = since
            if self._reported:
                self._reported = {wait for wait in self._reported if wait.request_id in since}
            self._pass_started_s = None

    def due(self, now_s: float) -> StallReport | None:
        """The stalls not logged yet, if any and the rate limit allows; they count as logged."""
        with self._lock:
            last_s = self._last_report_s
            if last_s is not None and now_s - last_s < self._repeat_after_s:
                return None
            stalls = tuple(
                Stall(wait, now_s - since_s)
                for wait, since_s in self._since.values()
                if now_s - since_s >= self._stall_after_s and wait not in self._reported
            )
            running_s = self._pass_started_s
            stuck_s = None if running_s is None or self._pass_reported else now_s - running_s
            if stuck_s is not None and stuck_s < self._stall_after_s:
                stuck_s = None
            if not stalls and stuck_s is None:
                return None
            self._reported.update(stall.wait for stall in stalls)
            self._pass_reported = self._pass_reported or stuck_s is not None
            self._last_report_s = now_s
            return StallReport(stalls, stuck_s)


def connector_thread_stacks() -> str:
    """The current Python stack of every CONNECTOR_THREAD_PREFIXES thread, innermost call last."""
    frames = sys._current_frames()
    sections = []
    for thread in sorted(threading.enumerate(), key=lambda t: t.name):
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if frame is None or not thread.name.startswith(CONNECTOR_THREAD_PREFIXES):
            continue
        stack = "".join(traceback.format_stack(frame))
        sections.append(f"--- thread {thread.name}:\n{stack.rstrip()}")
    return "\n".join(sections) or "(no connector thread found)"


class StallWatchdog:
    """A daemon thread that logs ``watch``'s stall reports with the connector threads' stacks."""

    def __init__(
        self,
        name: str,
        watch: StallWatch,
        *,
        clock: Callable[[], float],
        context: str = "",  # names the rank in the warning
    ) -> None:
        self._watch = watch
        self._clock = clock
        self._context = context
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)

    def check(self) -> bool:
        """Log a report if one is due; True if it logged (the thread's body, callable in tests)."""
        report = self._watch.due(self._clock())
        if report is None:
            return False
        logger.warning(
            "%sstalled: %s. Connector and main threads:\n%s",
            self._context,
            report.describe(),
            connector_thread_stacks(),
        )
        return True

    def _run(self) -> None:
        while not self._stopping.wait(CHECK_INTERVAL_S):
            try:
                self.check()
            except Exception:  # a diagnostic must never take the rank down
                logger.exception("stall watchdog: unexpected error")
