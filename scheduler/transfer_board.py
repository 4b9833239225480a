"""Prefill's board for overlapped dispatch: what each router transfer key came to.

A router that dispatches overlapped (docs/overlap.md) sends the same transfer key to prefill
(``do_remote_decode``) and to decode (``do_remote_prefill``) at once. Prefill's engine thread
writes here what the key came to at its ``request_finished``: the params of the lease it drew
(exactly those it returns for decode) or why it drew none. The side-channel thread reads it to
answer decode's AwaitLease, and writes a decode's CancelTransfer:

    key unknown --announce--> LEASED  --cancel--> CANCELLED (the lease is released at once)
                --fail------> FAILED
                --cancel----> CANCELLED --announce--> CANCELLED (that late lease released
                                                      at once; the connector draws none when
                                                      it sees the cancel first)
                --announce_partial--> PARTIAL --announce_partial, announce, fail, cancel-->

Chunked pulls (``announce_partial``): while prefill still computes, the key holds the latest
partial announcement (the whole blocks written so far, under the lease the final one keeps),
each with the next ``generation``; only an AwaitLease that asks for partials sees them
(``status(key, after_generation)``), and a cancel releases that lease as it does a final one.

Bounded in size and time: an entry lives ``ttl_s`` after its last write (a lease nobody
heartbeats ends after one lease duration anyway), and past ``max_keys`` the oldest is dropped
(a decode still waiting for it then times out; a dropped lease still ends by expiry).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from connector.protocol import (
    ANNOUNCED_FAILED,
    ANNOUNCED_LEASED,
    ANNOUNCED_PARTIAL,
    AnnouncementStatus,
    LeaseAnnouncement,
    lease_key,
)

MAX_KEYS = 65_536  # transfer keys remembered at once (~0.5 KB each)
CANCELLED = LeaseAnnouncement(
    ANNOUNCED_FAILED, reason="decode cancelled the transfer (the request ended there first)"
)


@dataclasses.dataclass(slots=True)
class _Entry:
    announcement: LeaseAnnouncement
    lease: str  # the lease key to release on a cancel ("": none drawn)
    expires_at: float


class TransferBoard:
    """Thread-safe: the engine thread announces, the side-channel thread reads and cancels.

    ``release`` ends leases by lease key (the LeaseTable's, as a Release does); it is called
    outside the lock. ``clock``: monotonic seconds.
    """

    def __init__(
        self,
        ttl_s: float,
        release: Callable[[tuple[str, ...]], int],
        clock: Callable[[], float],
        max_keys: int = MAX_KEYS,
    ) -> None:
        self._ttl_s = ttl_s
        self._release = release
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()  # guards _entries and _watchers
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest write first
        self._watchers: list[Callable[[], None]] = []

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (any thread, must not block) after every announce or failure."""
        with self._lock:
            self._watchers.append(callback)

    def is_cancelled(self, key: str) -> bool:
        """Did a decode cancel ``key`` (and is that still remembered)?"""
        with self._lock:
            entry = self._live(key)
            return entry is not None and entry.announcement is CANCELLED

    def announce(self, key: str, params: Mapping[str, Any], lease: str) -> bool:
        """Prefill drew ``lease`` (a lease key) for ``key`` and returns ``params`` for decode.

        False when decode cancelled ``key`` first: the lease was released here at once.
        """
        return self._announce(key, ANNOUNCED_LEASED, params, lease)

    def announce_partial(self, key: str, params: Mapping[str, Any], lease: str) -> bool:
        """Chunked pulls: prefill wrote the blocks ``params`` name, under ``lease`` (a lease
        key), and computes on. False (the lease released here) when decode cancelled ``key``."""
        return self._announce(key, ANNOUNCED_PARTIAL, params, lease)

    def _announce(
        self, key: str, status: AnnouncementStatus, params: Mapping[str, Any], lease: str
    ) -> bool:
        with self._lock:
            entry = self._live(key)
            cancelled = entry is not None and entry.announcement is CANCELLED
            if not cancelled:
                # Only partials count (a final one needs none; 0 is not sent: older decodes)
                generation = 0
                if status == ANNOUNCED_PARTIAL:
                    generation = 1 + (0 if entry is None else entry.announcement.generation)
                announcement = LeaseAnnouncement(status, dict(params), generation=generation)
                self._write(key, announcement, lease)
            watchers = tuple(self._watchers)
        if cancelled:
            self._release((lease,))
            return False
        _notify(watchers)
        return True

    def fail(self, key: str, reason: str) -> None:
        """Prefill ended the request for ``key`` without a lease (aborted, failed, refused)."""
        with self._lock:
            entry = self._live(key)
            if entry is None or entry.announcement is not CANCELLED:
                failed = LeaseAnnouncement(ANNOUNCED_FAILED, reason=reason[:4096])
                self._write(key, failed, "")
            watchers = tuple(self._watchers)
        _notify(watchers)

    def cancel(self, key: str) -> int:
        """Decode will never read ``key``'s lease: release it if drawn (returns 1), else
        remember the cancel so a late lease is released at once (returns 0)."""
        with self._lock:
            entry = self._live(key)
            lease = "" if entry is None else entry.lease
            self._write(key, CANCELLED, "")
        return self._release((lease,)) if lease else 0

    def status(self, key: str, after_generation: int | None = None) -> LeaseAnnouncement | None:
        """What ``key`` came to, or None while prefill has not finished it (or forgot it).
        With ``after_generation``, also a partial announcement newer than that generation."""
        with self._lock:
            entry = self._live(key)
        if entry is None:
            return None
        announcement = entry.announcement
        if announcement.status == ANNOUNCED_PARTIAL and (
            after_generation is None or announcement.generation <= after_generation
        ):
            return None
        return announcement

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _live(self, key: str) -> _Entry | None:
        """``key``'s entry unless expired (expired ones are dropped, oldest first)."""
        now = self._clock()
        while self._entries:
            oldest_key, oldest = next(iter(self._entries.items()))
            if oldest.expires_at > now:
                break
            del self._entries[oldest_key]
        return self._entries.get(key)

    def _write(self, key: str, announcement: LeaseAnnouncement, lease: str) -> None:
        self._entries.pop(key, None)
        self._entries[key] = _Entry(announcement, lease, self._clock() + self._ttl_s)
        while len(self._entries) > self._max_keys:
            self._entries.popitem(last=False)


LeaseResult = tuple[bool, dict[str, Any] | None]  # request_finished's (delay the free, params)


def lease_under_key(
    board: TransferBoard, key: str, aborted: bool, lease: Callable[[], LeaseResult]
) -> LeaseResult:
    """Prefill's request_finished for a request with a transfer key: ``lease`` as usual and
    announce the params under ``key`` (or why there is no lease); none when decode already
    cancelled it (the blocks are freed at once)."""
    if board.is_cancelled(key):
        return False, None
    if aborted:
        board.fail(key, "prefill aborted the request before its KV was complete")
        return False, None
    delay, params = lease()
    if params is None:
        board.fail(key, "prefill kept no lease for the request (see its log)")
        return delay, None
    board.announce(
        key,
        params,
        lease_key(str(params["remote_request_id"]), str(params.get("remote_lease_id", ""))),
    )
    return delay, params


def _notify(watchers: tuple[Callable[[], None], ...]) -> None:
    for watcher in watchers:
        watcher()
