"""Which prefill leases decode still means to read: kept by the engine thread, read by a timer.

The engine thread only writes here: one dict set when a request enters the heartbeating
states (CLAIMED, MATCHED, ALLOCATED, LOADING, DRAINING), one pop when it leaves them by any
way (scheduler/lifecycles.py's Book calls ``drop``), and a clock stamp per engine step.

No lock: each of those is one dict operation or one attribute store, atomic in CPython
(under the GIL, and under the dict's own lock in free-threaded builds), and the sender thread
reads a copy of the dict, taken the same way. A lock around them cost the engine thread
0.6-1.7 µs more per request on the 2-core dev box (hold and drop: 0.9-1.9 µs, 0.2 without).

The heartbeat sender's own thread (scheduler/heartbeats.py) calls ``take_due`` on every poll and
sends one heartbeat per prefill boot every ``interval_s``, so a long step, a GC pause or a
loaded host no longer lets a live decode's leases expire at prefill.

A claimed request's params are unread on the engine thread by design (they bind at
allocation): ``take_due`` parses them here, on the sender thread, once per params object, with
the one validator (connector/params.py). Params that do not validate are not heartbeated; the
allocation's parse fails the request with the reason, as it always did.

A wedged engine: when the engine thread has run no step for more than ``stall_limit_s`` (the
SchedulerConnector passes decode's kv_lease_duration), heartbeats pause until it steps again.
A decode that is slow keeps its leases through a stall of about two leases (the limit, then
the last heartbeat's lease); a decode that hangs pins prefill's blocks no longer than that,
instead of forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from connector.errors import InvalidTransferParams
from connector.metadata import RemoteSource, SideChannelBoot
from connector.params import parse_kv_transfer_params
from connector.protocol import lease_key

logger = logging.getLogger(__name__)

# What to heartbeat for one request: its read params' source, or (claimed) its raw params.
Held = RemoteSource | Mapping[str, Any]


Heartbeat = tuple[SideChannelBoot, tuple[str, ...]]  # where, and the lease keys it extends


class HeartbeatRegistry:
    """The heartbeating requests of one decode engine (``clock``: seconds, monotonic, callable
    from any thread). ``on_first_hold`` runs once, on the engine thread, at the first ``hold``
    (the sender starts its thread there: an engine that never loads runs none)."""

    def __init__(
        self,
        *,
        interval_s: float,
        stall_limit_s: float,
        clock: Callable[[], float],
        on_first_hold: Callable[[], None] | None = None,
    ) -> None:
        self._interval_s = interval_s
        self._stall_limit_s = stall_limit_s
        self._clock = clock
        self._on_first_hold = on_first_hold
        # Written by the engine thread only, in single atomic operations (see the top).
        self._entries: dict[str, Held] = {}  # request id -> what to heartbeat; arrival order
        self._last_step_s = clock()
        # The sender thread's own: when heartbeats are next due, the claimed params parsed
        # (id -> (params object, source)), and whether it pauses for a wedged engine.
        self._next_s = clock() + interval_s
        self._parsed: dict[str, tuple[object, RemoteSource | None]] = {}
        self._stalled = False

    # ---- engine thread ----

    def hold(self, request_id: str, held: Held) -> None:
        """Heartbeat ``request_id``'s lease from now on: ``held`` is its read params' source,
        or its raw params while they are unread (claimed)."""
        if self._on_first_hold is not None:
            start, self._on_first_hold = self._on_first_hold, None
            start()
        entries = self._entries
        if not entries:  # after an idle spell the last step says nothing of now
            self._last_step_s = self._clock()
        entries[request_id] = held

    def drop(self, request_id: str) -> None:
        """Stop heartbeating ``request_id`` (no-op if it is not held)."""
        self._entries.pop(request_id, None)

    def engine_stepped(self) -> None:
        """The engine thread ran a step: it is alive (called once per build_connector_meta)."""
        self._last_step_s = self._clock()

    def held_ids(self) -> frozenset[str]:
        """The request ids heartbeated now (any thread)."""
        return frozenset(self._entries.copy())

    # ---- sender thread ----

    def take_due(self) -> list[Heartbeat]:
        """The heartbeats due now, one per prefill boot (sorted by address), or [] when not
        due, nothing is held, or the engine is wedged. Sender thread only."""
        now = self._clock()
        if now < self._next_s:
            return []
        self._next_s = now + self._interval_s
        entries = list(self._entries.copy().items())  # copy(): one atomic read of the dict
        idle_s = now - self._last_step_s
        if not entries or self._is_wedged(idle_s, len(entries)):
            return []
        return self._group(entries)

    def _is_wedged(self, idle_s: float, num_held: int) -> bool:
        """Log once when heartbeats pause for a wedged engine, and once when they resume."""
        wedged = idle_s > self._stall_limit_s
        if wedged and not self._stalled:
            logger.warning(
                "decode's engine thread has run no step for %.1f s (limit %.1f s): not "
                "heartbeating its %d lease(s) until it steps again; prefill ends them when they "
                "expire",
                idle_s,
                self._stall_limit_s,
                num_held,
            )
        elif self._stalled and not wedged:
            logger.info("decode's engine thread steps again; heartbeats resume")
        self._stalled = wedged
        return wedged

    def _group(self, entries: list[tuple[str, Held]]) -> list[Heartbeat]:
        by_boot: dict[SideChannelBoot, list[str]] = {}
        parsed: dict[str, tuple[object, RemoteSource | None]] = {}
        for request_id, held in entries:
            if isinstance(held, RemoteSource):
                source: RemoteSource | None = held
            else:
                source = self._claimed_source(request_id, held, parsed)
            if source is None:
                continue
            boot = source.side_channel
            key = lease_key(source.remote_request_id, source.lease_id)
            by_boot.setdefault(boot, []).append(key)
        self._parsed = parsed  # only the claims still held: bounded by the registry
        order = sorted(
            by_boot, key=lambda boot: (boot.host, boot.port, boot.engine_id, boot.boot_id)
        )
        return [(boot, tuple(by_boot[boot])) for boot in order]

    def _claimed_source(
        self,
        request_id: str,
        raw: Mapping[str, Any],
        parsed: dict[str, tuple[object, RemoteSource | None]],
    ) -> RemoteSource | None:
        """The claimed request's source, parsed once per params object; None if its params
        do not validate or ask for no load."""
        cached = self._parsed.get(request_id)
        if cached is not None and cached[0] is raw:
            parsed[request_id] = cached
            return cached[1]
        try:
            params = parse_kv_transfer_params(raw)
            source = params.remote_source() if params and params.do_remote_prefill else None
        except InvalidTransferParams as exc:
            logger.debug("request %s: claimed params not heartbeated: %s", request_id, exc)
            source = None
        except Exception as exc:  # e.g. the engine edited the dict while it was read: next time
            logger.debug("request %s: claimed params not read this time: %r", request_id, exc)
            return None
        parsed[request_id] = (raw, source)
        return source

    def __len__(self) -> int:
        return len(self._entries)
