"""Prefill side: count free notifications per lease key and report the keys whose count is reached.

A decode rank that finished reading (or gave up on) a prefill rank's blocks sends it
``b"<lease key>:<consumers>"`` (connector/protocol.py ``lease_key``: the prefill request id
and its lease id), where ``consumers`` is how many decode ranks will notify this prefill rank
for the lease. The blocks may be freed once that many distinct
senders have notified. Bad input from peers never raises out of here: garbage, duplicate and
stray notifications are counted and logged, and the request is unaffected.

A notification may overtake the scheduler's ``sends`` entry for its key (the decode engine can
read before this engine's next step), so unknown keys are held for ``early_ttl_s`` seconds
before they are written off as stray.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from connector.errors import InvalidNotification
from connector.observability.metrics import NOTIFICATIONS, MetricsRecorder, default_recorder
from connector.observability.ratelimit import RateLimitedLog
from connector.observability.trace import send_ended
from connector.protocol import decode_free_notif

logger = logging.getLogger(__name__)

MAX_EARLY_KEYS = 4096  # bound on keys held before their `sends` entry; more are dropped as stray
MAX_RECENT_KEYS = 4096  # finished keys remembered to tell a late duplicate from a stray


@dataclass
class NotificationStats:
    """Counters of what arrived, for logs and tests."""

    counted: int = 0  # accepted towards an expected lease key
    duplicate: int = 0
    stray: int = 0
    garbage: int = 0


@dataclass
class _Tally:
    """Notifications received for one lease key."""

    senders: set[str] = field(default_factory=set)
    consumers: int = 0  # the largest count any message carried
    first_seen_s: float = 0.0


class NotificationCounter:
    """Counts free notifications per lease key. Not thread-safe: the rank's transfer
    thread only (worker/connector.py publishes its stats under a lock)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        early_ttl_s: float,
        metrics: MetricsRecorder | None = None,  # None: the process's default_recorder()
    ) -> None:
        self._clock = clock
        self._metrics = metrics or default_recorder()
        self._early_ttl_s = early_ttl_s
        self._expected: dict[str, _Tally] = {}
        self._early: dict[str, _Tally] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._finished: list[str] = []
        self.stats = NotificationStats()
        self.num_stat_changes = 0  # bumped with every change to ``stats``: copy it only then
        self._log = RateLimitedLog(logger, clock=clock)  # peers' input: bounded log lines

    def expect(self, keys: Iterable[str]) -> None:
        """Start counting for these lease keys (the scheduler put their blocks under a lease)."""
        for key in keys:
            if key in self._expected:
                logger.warning("lease %s is already expecting free notifications", key)
                continue
            tally = self._early.pop(key, None) or _Tally(first_seen_s=self._clock())
            self._count("counted", len(tally.senders))
            self._expected[key] = tally
            self._finish_if_complete(key, tally)

    def forget(self, keys: Iterable[str]) -> None:
        """Stop counting for these lease keys (lease expired or released): nothing is reported."""
        for key in keys:
            self._expected.pop(key, None)
            self._early.pop(key, None)

    def receive(self, notifs: Mapping[str, Sequence[bytes]]) -> None:
        """Count notifications, as returned by the agent's get_new_notifs()."""
        for sender, messages in notifs.items():
            for message in messages:
                self._receive_one(sender, message)
        self._expire_early()

    def take_finished(self) -> tuple[str, ...]:
        """Lease keys whose count was reached since the last call; each is returned once."""
        finished, self._finished = tuple(self._finished), []
        return finished

    def _receive_one(self, sender: str, message: bytes) -> None:
        try:
            key, consumers = decode_free_notif(message)
        except InvalidNotification as error:
            self._count("garbage")
            self._log.warning("garbage", "ignoring garbage notification from %s: %s", sender, error)
            return
        tally = self._expected.get(key)
        if tally is None:
            self._hold_early(sender, key, consumers)
            return
        if self._add(tally, sender, key, consumers):
            self._count("counted")
            self._finish_if_complete(key, tally)

    def _add(self, tally: _Tally, sender: str, key: str, consumers: int) -> bool:
        if sender in tally.senders:
            self._count("duplicate")
            self._log.warning(
                "duplicate", "duplicate free notification for %s from %s", key, sender
            )
            return False
        if tally.consumers and consumers != tally.consumers:
            # Freeing too late only costs memory; freeing under a live read corrupts it.
            logger.warning(
                "free notifications for %s disagree on the reader count (%d vs %d); "
                "waiting for the larger",
                key,
                tally.consumers,
                consumers,
            )
        tally.senders.add(sender)
        tally.consumers = max(tally.consumers, consumers)
        return True

    def _hold_early(self, sender: str, key: str, consumers: int) -> None:
        if key in self._recent:
            self._count("duplicate")
            self._log.warning(
                "duplicate", "free notification for finished lease %s from %s", key, sender
            )
            return
        tally = self._early.get(key)
        if tally is None:
            if len(self._early) >= MAX_EARLY_KEYS:
                self._count("stray")
                self._log.warning("stray", "dropping notification for unknown lease %s", key)
                return
            tally = self._early[key] = _Tally(first_seen_s=self._clock())
        self._add(tally, sender, key, consumers)

    def _finish_if_complete(self, key: str, tally: _Tally) -> None:
        if tally.consumers == 0 or len(tally.senders) < tally.consumers:
            return
        del self._expected[key]
        self._finished.append(key)
        send_ended(key, tally.senders, first_seen_s=tally.first_seen_s, now_s=self._clock())
        self._recent[key] = None
        if len(self._recent) > MAX_RECENT_KEYS:
            self._recent.popitem(last=False)

    def _count(self, kind: str, amount: int = 1) -> None:
        """Count ``amount`` notifications of ``kind`` in ``stats`` and in the metrics."""
        setattr(self.stats, kind, getattr(self.stats, kind) + amount)
        self.num_stat_changes += 1
        if amount:
            self._metrics.inc(NOTIFICATIONS, kind, amount)

    def _expire_early(self) -> None:
        if not self._early:
            return
        now_s = self._clock()
        expired = [
            key
            for key, tally in self._early.items()
            if now_s - tally.first_seen_s > self._early_ttl_s
        ]
        for key in expired:
            tally = self._early.pop(key)
            self._count("stray", len(tally.senders))
            self._log.warning(
                "stray",
                "free notification for unknown lease %s from %s: not held; ignored",
                key,
                sorted(tally.senders),
            )
