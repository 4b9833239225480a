"""The prefill lease table: how long finished requests' blocks stay held for decode to read.

A lease starts when prefill finishes a do_remote_decode request. Decode heartbeats extend it;
a release (decode will never read) or expiry ends it early; ``complete`` drops it once every
rank saw its free notifications. Time is passed in (``now``, seconds on the caller's clock) so
tests drive it explicitly. The engine thread and the side-channel thread share one table.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class LeaseTable:
    """Thread-safe map from prefill request id to lease expiry time."""

    def __init__(self, duration_s: float) -> None:
        self._duration_s = duration_s
        # Guards _expiry_s and _released: every method reads or writes both under it.
        self._lock = threading.Lock()
        self._expiry_s: dict[str, float] = {}  # held leases: request id -> expiry time
        self._released: list[str] = []  # released over the side channel, not yet taken

    @property
    def duration_s(self) -> float:
        return self._duration_s

    def lease(self, request_id: str, now: float) -> None:
        """Hold ``request_id``'s blocks until ``now + duration_s`` (or until extended)."""
        with self._lock:
            self._expiry_s[request_id] = now + self._duration_s

    def extend(self, request_ids: Iterable[str], now: float) -> int:
        """Push held leases out to ``now + duration_s``; returns how many were held."""
        with self._lock:
            held = [rid for rid in request_ids if rid in self._expiry_s]
            for request_id in held:
                self._expiry_s[request_id] = max(self._expiry_s[request_id], now + self._duration_s)
        return len(held)

    def release(self, request_ids: Iterable[str]) -> int:
        """End held leases now (decode will never read); returns how many were held.

        The ids come back from ``take_released`` so the engine thread can free their blocks.
        """
        with self._lock:
            held = [rid for rid in request_ids if self._expiry_s.pop(rid, None) is not None]
            self._released.extend(held)
        return len(held)

    def complete(self, request_id: str) -> bool:
        """Drop ``request_id``'s lease (all ranks reported); True if it was still held."""
        with self._lock:
            return self._expiry_s.pop(request_id, None) is not None

    def expired(self, now: float) -> tuple[str, ...]:
        """Remove and return the leases whose expiry time is at or before ``now``."""
        with self._lock:
            ended = tuple(rid for rid, expiry_s in self._expiry_s.items() if expiry_s <= now)
            for request_id in ended:
                del self._expiry_s[request_id]
        return ended

    def take_released(self) -> tuple[str, ...]:
        """Ids released over the side channel since the last call."""
        with self._lock:
            released, self._released = tuple(self._released), []
        return released

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._expiry_s

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry_s)
