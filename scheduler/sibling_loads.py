"""Decode side: one load per prefill lease on this engine; a request naming a lease another
request's load reads waits for it, then computes locally what its prefix cache does not hold.

vLLM fans an ``n > 1`` request out into children that carry the parent's
``kv_transfer_params``, and adds them to the engine together. Prefill frees a lease once this
engine's ranks notify after the first load's proof, so a second load of it would fail its
lease check (never wrong, but a good request failed; it did so in CI with ``n=2``). Instead,
while one request's load uses the lease, another naming it gets ``None`` from the engine's
ask (vLLM asks again next step; the loading request goes first, and once loaded its blocks
are in the prefix cache); once that load is done, ``(0, False)``: the engine computes locally
whatever its prefix cache does not hold (at most a partial block after a successful load).
A wait lasts at most ``max_wait_s``; after it the request computes locally too.

A request naming a lease no load on this engine uses now (params resent after their load, a
replay of an old boot's params) loads as any other: its proof fails if the lease is gone, and
vLLM's ``kv_load_failure_policy`` decides.

Keys are lease keys (``connector.protocol.lease_key``), or an overlapped dispatch's transfer
key while the lease is not drawn yet. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from connector.protocol import lease_key


def params_key(raw: Mapping[str, Any]) -> str | None:
    """The lease (or transfer) key raw params name, read without validating them (the
    params are validated when they bind); None if they name none."""
    remote_request_id = raw.get("remote_request_id")
    if isinstance(remote_request_id, str):
        lease_id = raw.get("remote_lease_id")
        return lease_key(remote_request_id, lease_id if isinstance(lease_id, str) else "")
    transfer_key = raw.get("transfer_key")
    return f"transfer:{transfer_key}" if isinstance(transfer_key, str) else None


class SiblingLoads:
    def __init__(self, *, max_wait_s: float, clock: Callable[[], float]) -> None:
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._reader_of: dict[str, str] = {}  # key -> the request whose load uses it
        self._key_of: dict[str, str] = {}  # that request -> its key
        self._waiting: dict[str, tuple[str, float]] = {}  # request -> (key, when it first waited)

    def answer(self, request_id: str, raw: Mapping[str, Any]) -> tuple[int | None, bool] | None:
        """For a request with no load record yet: ``(None, False)`` (ask again later) while
        another request's load uses its key, ``(0, False)`` (compute locally) once that load
        is done or the wait ran out; None when its params may load."""
        key = params_key(raw)
        if key is None:
            return None
        reader = self._reader_of.get(key)
        waited = self._waiting.get(request_id)
        if reader is not None and reader != request_id:
            if waited is None:
                self._waiting[request_id] = (key, self._clock())
                return None, False
            if self._clock() - waited[1] < self._max_wait_s:
                return None, False
        elif waited is None or waited[0] != key:
            return None
        del self._waiting[request_id]
        return 0, False

    def reading(self, request_id: str, key: str | None) -> None:
        """``request_id``'s load now uses ``key`` (its record started)."""
        self._waiting.pop(request_id, None)
        if key is not None and key not in self._reader_of:
            self._reader_of[key] = request_id
            self._key_of[request_id] = key

    def done(self, request_id: str) -> None:
        """``request_id``'s load no longer uses its key (read, failed, released or ended)."""
        key = self._key_of.pop(request_id, None)
        if key is not None:
            del self._reader_of[key]

    def used_by_another(self, request_id: str, key: str) -> bool:
        """At the finish of a request that never loaded (it may have waited): True if another
        request's load uses ``key``: not this one's to release."""
        self._waiting.pop(request_id, None)
        reader = self._reader_of.get(key)
        return reader is not None and reader != request_id
