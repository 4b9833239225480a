"""A rate-limited logger: at most one line per reason per interval, then a count of the rest.

Input a peer controls (garbage frames, stray notifications, refused requests) must not turn
into one log line each: a single connection could then fill the disk. Callers name a *reason*
from a small fixed vocabulary chosen by the code (never text a peer sent, which would make
every line a new reason); the first line for a reason is written, the next ones within
``interval_s`` are only counted, and the first line after the interval says how many were
suppressed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_INTERVAL_S = 10.0
MAX_REASONS = 256  # bound on remembered reasons; the least recently logged one is forgotten


@dataclass(slots=True)
class _ReasonState:
    last_logged_s: float
    num_suppressed: int = 0


class RateLimitedLog:
    """Log through ``logger`` at most once per ``reason`` per ``interval_s`` seconds.

    ``clock`` is monotonic seconds (injected in tests). Safe from any thread.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        max_reasons: int = MAX_REASONS,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._max_reasons = max_reasons
        # Guards _reasons (the logging call itself happens after releasing it).
        self._lock = threading.Lock()
        self._reasons: OrderedDict[str, _ReasonState] = OrderedDict()
        self._num_suppressed_total = 0

    @property
    def num_suppressed(self) -> int:
        """Lines not written since this logger was made (all reasons)."""
        with self._lock:
            return self._num_suppressed_total

    def warning(self, reason: str, msg: str, *args: object) -> bool:
        return self._log(logging.WARNING, reason, msg, args, exc_info=False)

    def info(self, reason: str, msg: str, *args: object) -> bool:
        return self._log(logging.INFO, reason, msg, args, exc_info=False)

    def error(self, reason: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        return self._log(logging.ERROR, reason, msg, args, exc_info=exc_info)

    def log(self, level: int, reason: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Write the line unless ``reason`` was logged within the interval; True if written."""
        return self._log(level, reason, msg, args, exc_info=exc_info)

    def _log(
        self, level: int, reason: str, msg: str, args: tuple[object, ...], *, exc_info: bool
    ) -> bool:
        if not self._logger.isEnabledFor(level):
            return False
        num_suppressed = self._admit(reason)
        if num_suppressed is None:
            return False
        if num_suppressed:
            msg = f"{msg} [{num_suppressed} more like this suppressed since the previous one]"
        # stacklevel 3: the record names our caller's line, not this module's.
        self._logger.log(level, msg, *args, exc_info=exc_info, stacklevel=3)
        return True

    def _admit(self, reason: str) -> int | None:
        """None to suppress; else how many lines of this reason were suppressed before it."""
        now_s = self._clock()
        with self._lock:
            state = self._reasons.get(reason)
            if state is not None and now_s - state.last_logged_s < self._interval_s:
                state.num_suppressed += 1
                self._num_suppressed_total += 1
                return None
            num_suppressed = 0 if state is None else state.num_suppressed
            self._reasons[reason] = _ReasonState(now_s)
            self._reasons.move_to_end(reason)
            if len(self._reasons) > self._max_reasons:
                self._reasons.popitem(last=False)
        return num_suppressed
