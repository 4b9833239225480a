"""The worker rank's transfer thread: after registration, the one thread that calls NIXL.

NIXL's ``post()`` of a READ with few descriptors over same-host CMA copies inline: 0.1-0.6 s
for an 8k-token request on the 2-core machine (benchmarks/engine_thread_bench.py), and the
binding releases the GIL while it copies. So posting and polling live on this thread, and
the engine thread only hands work over (``submit``) and collects what the step function
published. Each pass runs ``step`` with every item submitted since the last pass; a pass
follows a submit or a ``wake`` (a lease check answered) at once, and otherwise comes every
``busy_poll_s`` while ``busy()`` says work is live, or every ``idle_poll_s``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

Item = TypeVar("Item")

BUSY_POLL_S = 0.001  # while READs are live: a finished READ is seen within about 1 ms
IDLE_POLL_S = 0.05  # nothing live: free notifications (prefill) are collected within 50 ms
STOP_TIMEOUT_S = 10.0  # a post() in progress finishes its copy first (well under a second)

# glibc mallopt parameters (malloc.h) and the values keep_plan_memory_mapped sets.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # numpy arrays below this come from the heap, not mmap
TRIM_THRESHOLD_BYTES = 64 << 20  # at most this much freed heap stays mapped for reuse


def keep_plan_memory_mapped() -> bool:
    """Stop glibc from returning a plan's freed arrays to the kernel after every request.

    A 32k-token request with fragmented ids plans 131k descriptors: a few MB of numpy arrays
    per request. With glibc's defaults the freed heap top is trimmed (or the arrays are
    mmap'd) each time, so every request page-faults its arrays in again: 1,760 minor faults
    and 3-20 ms per request instead of 1.7 ms on the 2-core machine (measured with ru_minflt).
    Process-wide and bounded: at most 64 MiB of freed heap stays mapped. Returns False where
    there is no glibc (nothing changes).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


class TransferThread(Generic[Item]):
    """Runs ``step(items)`` on its own thread until ``stop``; ``step`` must not raise."""

    def __init__(
        self,
        name: str,
        step: Callable[[list[Item]], None],
        *,
        busy: Callable[[], bool],
        busy_poll_s: float = BUSY_POLL_S,
        idle_poll_s: float = IDLE_POLL_S,
    ) -> None:
        self._step = step
        self._busy = busy
        self._busy_poll_s = busy_poll_s
        self._idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue[Item] = queue.SimpleQueue()  # thread-safe by itself
        self._barriers: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()  # flush()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: Item) -> None:
        """Hand one item to the next pass (never blocks)."""
        self._inbox.put(item)
        self._wake.set()

    def wake(self) -> None:
        """Run a pass now rather than at the next poll: something the step waits on arrived
        (a lease check's answer), so a load need not wait out a poll interval for it."""
        self._wake.set()

    def flush(self, timeout_s: float) -> bool:
        """Wait until a whole pass ran after this call (tests and shutdown paths; never the
        engine's hot path). False if it did not within ``timeout_s``."""
        if not self.alive:
            return False
        done = threading.Event()
        self._barriers.put(done)
        self._wake.set()
        return done.wait(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Stop after the pass in progress; True once the thread has ended."""
        self._stopping.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # before draining: a submit after this wakes the next wait
            barriers = _drain(self._barriers)
            items = _drain(self._inbox)
            try:
                self._step(items)
            except Exception:  # the step guards each request; this keeps the thread alive
                logger.exception("transfer thread: unexpected error in a pass")
            for barrier in barriers:
                barrier.set()
            self._wake.wait(self._busy_poll_s if self._busy() else self._idle_poll_s)


Queued = TypeVar("Queued")


def _drain(inbox: queue.SimpleQueue[Queued]) -> list[Queued]:
    """Everything queued so far (this thread is the only consumer, so empty() is exact)."""
    items = []
    while not inbox.empty():
        items.append(inbox.get_nowait())
    return items
