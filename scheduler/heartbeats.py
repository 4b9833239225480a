"""Decode's heartbeats and releases to prefill side channels, sent from a background thread.

Why and how, in docs/architecture.md "Threads": the engine thread only writes to a
``HeartbeatRegistry`` (the prefill leases decode still means to read) with single dict
operations, atomic in CPython, so it takes no lock, and stamps its clock once per step; the
sender thread reads a copy every poll and sends one heartbeat per prefill boot per interval,
on its own timer. A claimed request's params, unread on the engine thread until allocation,
are parsed there once, with the one validator (connector/params.py); params that do not
validate are not heartbeated. An engine thread that ran no step for more than
``stall_limit_s`` (decode's kv_lease_duration) is wedged: heartbeats pause until it steps.

Releases come from the engine thread through a bounded queue (a full one drops with a
warning). Failures are logged, never raised: at worst a lease expires. One thread serves
every prefill engine, so each message waits at most MAX_MESSAGE_TIMEOUT_S and a destination
that failed is skipped for a while (``Backoff``). Every message names the prefill boot the
params carry (``remote_boot_id``), so a restarted prefill refuses it (PeerRestarted); params
without one learn it with a Hello, remembered per destination (``BootIds``) until a
PeerRestarted. A refused message is never retried: its leases died with the old boot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from connector.errors import ConnectorError, InvalidTransferParams, PeerRestarted
from connector.metadata import RemoteSource, SideChannelBoot
from connector.net.side_channel_client import fetch_boot_id, send_heartbeat, send_release
from connector.params import parse_kv_transfer_params
from connector.protocol import ReaderId

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
MAX_MESSAGE_TIMEOUT_S = 2.0  # fire-and-forget: never wait the full handshake timeout
MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 10.0  # well under the default 30 s lease: a flaky prefill still gets heartbeats
MAX_BOOT_IDS = 4096  # remembered destinations; the oldest is forgotten (and asked again)


# Send one message naming ``lease_keys`` to a prefill boot's side channel.
SendFn = Callable[[SideChannelBoot, Sequence[str]], object]


@dataclasses.dataclass
class _Window:
    """A destination that failed: skip it until ``until_s``."""

    backoff_s: float
    until_s: float
    num_skipped: int = 0


class Backoff:
    """Which destinations to skip after a failure. ``now`` is seconds on the caller's clock.

    A first failure skips the destination for ``initial_s``; a failure at the end of a window
    doubles the window, up to ``max_s``; a success forgets the destination, and so does a quiet
    ``max_s`` after its window (so dead engines do not pile up). Not thread-safe: only the
    sender thread uses it.
    """

    def __init__(self, *, initial_s: float, max_s: float) -> None:
        self._initial_s = initial_s
        self._max_s = max(initial_s, max_s)
        self._windows: dict[SideChannelBoot, _Window] = {}  # failing destinations only

    def should_skip(self, destination: SideChannelBoot, now: float) -> bool:
        """True (and counted) while ``destination`` is inside its backoff window."""
        window = self._windows.get(destination)
        if window is None or now >= window.until_s:
            return False
        window.num_skipped += 1
        return True

    def failed(self, destination: SideChannelBoot, now: float) -> tuple[float, int]:
        """Start the next window: (its length in seconds, messages skipped in the last one)."""
        self._forget_stale(now)
        previous = self._windows.get(destination)
        backoff_s = (
            self._initial_s if previous is None else min(2 * previous.backoff_s, self._max_s)
        )
        self._windows[destination] = _Window(backoff_s, now + backoff_s)
        return backoff_s, 0 if previous is None else previous.num_skipped

    def succeeded(self, destination: SideChannelBoot) -> int | None:
        """Forget ``destination``'s failures: the messages skipped in its last window, or None
        if it was not failing."""
        window = self._windows.pop(destination, None)
        return None if window is None else window.num_skipped

    def _forget_stale(self, now: float) -> None:
        stale = [d for d, w in self._windows.items() if now >= w.until_s + self._max_s]
        for destination in stale:
            del self._windows[destination]

    def __len__(self) -> int:
        return len(self._windows)


class BootIds:
    """The boot id last learned per destination. Not thread-safe: the sender thread only."""

    def __init__(self, *, max_destinations: int = MAX_BOOT_IDS) -> None:
        self._max_destinations = max_destinations
        self._boot_ids: dict[SideChannelBoot, str] = {}  # insertion order: oldest first

    def get(self, destination: SideChannelBoot) -> str | None:
        return self._boot_ids.get(destination)

    def learned(self, destination: SideChannelBoot, boot_id: str) -> None:
        self._boot_ids.pop(destination, None)
        self._boot_ids[destination] = boot_id
        if len(self._boot_ids) > self._max_destinations:
            del self._boot_ids[next(iter(self._boot_ids))]

    def forget(self, destination: SideChannelBoot) -> None:
        self._boot_ids.pop(destination, None)

    def __len__(self) -> int:
        return len(self._boot_ids)


@dataclasses.dataclass(frozen=True)
class _Message:
    send: SendFn
    destination: SideChannelBoot
    lease_keys: tuple[str, ...]


class HeartbeatSender:
    """Start lazily on the first message or registry hold; ``stop()`` joins the thread.

    ``timeout_s`` is the configured side-channel timeout; messages use at most
    MAX_MESSAGE_TIMEOUT_S of it. ``clock`` (seconds, monotonic) times the backoff windows.
    ``send`` replaces the heartbeats' network call (tests). ``timer=False``: the
    thread sends no heartbeats; whoever calls ``beat_if_due`` does (tests drive it by hand).
    """

    def __init__(
        self,
        *,
        secret: str | None,
        timeout_s: float,
        max_queued: int = 64,
        send: SendFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        reader: ReaderId | None = None,  # this engine and boot, named in every message
        timer: bool = True,
    ) -> None:
        message_timeout_s = min(timeout_s, MAX_MESSAGE_TIMEOUT_S)
        self._secret = secret
        self._reader = reader
        self._message_timeout_s = message_timeout_s
        self._boot_ids = BootIds()
        self._send: SendFn = send or self._over_network(send_heartbeat)
        self._send_release = self._over_network(send_release)
        self._clock = clock
        self._backoff = Backoff(
            initial_s=max(message_timeout_s, MIN_BACKOFF_S), max_s=MAX_BACKOFF_S
        )
        self._num_skipped = 0  # written by the sender thread only
        self._num_stale = 0  # messages a restarted engine refused; sender thread only
        self._queue: queue.Queue[_Message] = queue.Queue(max_queued)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._timer = timer
        # Swapped whole by keep_alive (engine thread), read by the sender thread.
        self._registries: tuple[HeartbeatRegistry, ...] = ()

    @property
    def num_skipped(self) -> int:
        """Messages not sent because their destination was backing off after a failure."""
        return self._num_skipped

    @property
    def num_stale(self) -> int:
        """Messages refused because their engine restarted since its boot id was learned."""
        return self._num_stale

    def keep_alive(
        self, *, interval_s: float, stall_limit_s: float, clock: Callable[[], float]
    ) -> HeartbeatRegistry:
        """A registry whose leases this sender heartbeats every ``interval_s`` on its own
        thread, while its engine stepped within ``stall_limit_s`` (``clock``'s seconds)."""
        registry = HeartbeatRegistry(
            interval_s=interval_s,
            stall_limit_s=stall_limit_s,
            clock=clock,
            on_first_hold=self._start_timer,
        )
        self._registries = (*self._registries, registry)
        return registry

    def beat_if_due(self) -> int:
        """Send every registry's due heartbeats now, on the calling thread (the sender thread's
        timer, or a test with ``timer=False``); returns how many were due."""
        due = [heartbeat for registry in self._registries for heartbeat in registry.take_due()]
        for boot, lease_keys in due:
            self._handle(_Message(self._send, boot, lease_keys))
        return len(due)

    def submit(self, destination: SideChannelBoot, lease_keys: Sequence[str]) -> bool:
        """Queue one heartbeat; False if full or stopped."""
        return self._enqueue(self._send, destination, lease_keys)

    def submit_release(self, destination: SideChannelBoot, lease_keys: Sequence[str]) -> bool:
        """Queue one release (decode will never read these); False if full or stopped."""
        return self._enqueue(self._send_release, destination, lease_keys)

    def _enqueue(
        self, send: SendFn, destination: SideChannelBoot, lease_keys: Sequence[str]
    ) -> bool:
        if not self._start_thread():
            return False
        try:
            self._queue.put_nowait(_Message(send, destination, tuple(lease_keys)))
        except queue.Full:
            logger.warning("side-channel queue full; dropping a message to %s", destination)
            return False
        return True

    def _start_timer(self) -> None:
        if self._timer:
            self._start_thread()

    def _start_thread(self) -> bool:
        """Start the sender thread unless it runs; False once stopped."""
        if self._stop.is_set():
            return False
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="nixl-pd-heartbeats", daemon=True
            )
            self._thread.start()
        return True

    def _over_network(self, client_send: Callable[..., int]) -> SendFn:
        """A SendFn that sends with ``client_send`` (connector/net/side_channel_client.py),
        naming the destination's boot id: the params' one, else asked for once and forgotten
        on PeerRestarted."""

        def send(destination: SideChannelBoot, lease_keys: Sequence[str]) -> int:
            host, port = destination.host, destination.port
            secret, timeout_s = self._secret, self._message_timeout_s
            known = destination.boot_id or self._boot_ids.get(destination)
            if known is None:
                known = fetch_boot_id(
                    host, port, engine_id=None, secret=secret, timeout_s=timeout_s
                )
                self._boot_ids.learned(destination, known)
            try:
                return client_send(
                    host,
                    port,
                    lease_keys,
                    engine_id=destination.engine_id,
                    boot_id=known,
                    secret=secret,
                    timeout_s=timeout_s,
                    reader=self._reader,
                )
            except PeerRestarted:
                self._boot_ids.forget(destination)
                raise

        return send

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Empty):  # no message this poll: the timer's turn
                self._handle(self._queue.get(timeout=POLL_INTERVAL_S))
            if not self._timer:
                continue
            try:
                self.beat_if_due()
            except Exception:  # the thread must outlive any failure, a bug included
                logger.exception("sending heartbeats failed; trying again at the next interval")

    def _handle(self, message: _Message) -> None:
        destination = message.destination
        if self._backoff.should_skip(destination, self._clock()):
            self._num_skipped += 1
            return
        try:
            message.send(destination, message.lease_keys)
        except PeerRestarted as exc:
            # The engine answers, as a new boot: no backoff, the next message asks its boot id.
            self._num_stale += 1
            logger.info(
                "side-channel message to %s refused: %s; the leases it named are gone",
                destination,
                exc,
            )
            return
        except Exception as exc:  # the thread must outlive any failure, a bug included
            backoff_s, num_skipped = self._backoff.failed(destination, self._clock())
            log = logger.warning if isinstance(exc, ConnectorError) else logger.exception
            log(
                "side-channel message to %s failed: %s; skipping messages to it for %.1f s%s",
                destination,
                exc,
                backoff_s,
                _skipped_note(num_skipped),
            )
            return
        recovered_after_skips = self._backoff.succeeded(destination)
        if recovered_after_skips is not None:
            logger.info(
                "side channel of %s answers again%s",
                destination,
                _skipped_note(recovered_after_skips),
            )


def _skipped_note(num_skipped: int) -> str:
    if not num_skipped:
        return ""
    return f" ({num_skipped} message(s) skipped while it was backing off)"


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
            key = source.lease_key
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
