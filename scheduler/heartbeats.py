"""Send decode's heartbeats and releases to prefill side channels from a background thread.

Heartbeats run on this thread's own timer: every poll it asks each HeartbeatRegistry
(scheduler/heartbeat_registry.py) for the heartbeats due, one per prefill boot per interval,
so they do not wait for the engine thread's hooks. Releases are enqueued by the engine thread
(never blocking); a full queue drops one with a warning. Failures are logged, never raised: a
missed heartbeat at worst lets a lease expire, and a missed release leaves the prefill blocks
to their lease.

One thread serves every prefill engine, so a dead side channel must not hold up the live ones:
each message waits at most MAX_MESSAGE_TIMEOUT_S for its reply, and after a failure further
messages to that engine are skipped for a while (``Backoff``) instead of each waiting out its
own timeout. A skipped message is lost like a failed one: at worst a lease runs out.

Every message names the prefill side channel's boot id (connector/protocol.py): the one the
request's params carry (``remote_boot_id``, the boot that leased), so a prefill that restarted
since refuses it (PeerRestarted) and no lease of the new boot is touched. Params without one
(an older prefill) fall back to learning it with a Hello on the first message to a destination
(``BootIds``); after a PeerRestarted that remembered id is dropped and the next message asks
again. A refused message is never retried: the leases it named died with the old boot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from connector.errors import ConnectorError, PeerRestarted
from connector.metadata import SideChannelBoot
from connector.net.side_channel_client import fetch_boot_id, send_heartbeat, send_release
from connector.protocol import ReaderId
from scheduler.heartbeat_registry import HeartbeatRegistry

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
MAX_MESSAGE_TIMEOUT_S = 2.0  # fire-and-forget: never wait the full handshake timeout
MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 10.0  # well under the default 30 s lease: a flaky prefill still gets heartbeats
MAX_BOOT_IDS = 4096  # remembered destinations; the oldest is forgotten (and asked again)


class SendFn(Protocol):
    """Send one message to the side channel at host:port of prefill engine ``engine_id``."""

    def __call__(
        self,
        host: str,
        port: int,
        lease_keys: Sequence[str],
        *,
        engine_id: str,
        boot_id: str = "",
    ) -> object: ...


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
    ``send``/``send_release_fn`` replace the network calls (tests). ``timer=False``: the
    thread sends no heartbeats; whoever calls ``beat_if_due`` does (tests drive it by hand).
    """

    def __init__(
        self,
        *,
        secret: str | None,
        timeout_s: float,
        max_queued: int = 64,
        send: SendFn | None = None,
        send_release_fn: SendFn | None = None,
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
        self._send_release: SendFn = send_release_fn or self._over_network(send_release)
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

    def submit(
        self,
        host: str,
        port: int,
        lease_keys: Sequence[str],
        *,
        engine_id: str,
        boot_id: str = "",
    ) -> bool:
        """Queue one heartbeat to boot ``boot_id`` of prefill ``engine_id``; False if full or
        stopped."""
        destination = SideChannelBoot(engine_id, host, port, boot_id)
        return self._enqueue(self._send, destination, lease_keys)

    def submit_release(
        self,
        host: str,
        port: int,
        lease_keys: Sequence[str],
        *,
        engine_id: str,
        boot_id: str = "",
    ) -> bool:
        """Queue one release (decode will never read these); False if full or stopped."""
        destination = SideChannelBoot(engine_id, host, port, boot_id)
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
        """A SendFn that sends with ``client_send`` (connector/net/side_channel_client.py)."""

        def send(
            host: str,
            port: int,
            lease_keys: Sequence[str],
            *,
            engine_id: str,
            boot_id: str = "",
        ) -> int:
            destination = SideChannelBoot(engine_id, host, port, boot_id)
            return self._with_boot_id(client_send, destination, lease_keys)

        return send

    def _with_boot_id(
        self,
        send: Callable[..., int],
        destination: SideChannelBoot,
        lease_keys: Sequence[str],
    ) -> int:
        """Send naming the destination's boot id: the params' one, else asked for once and
        forgotten on PeerRestarted."""
        host, port, engine_id = destination.host, destination.port, destination.engine_id
        secret, timeout_s = self._secret, self._message_timeout_s
        boot_id = destination.boot_id or self._boot_ids.get(destination)
        if boot_id is None:
            boot_id = fetch_boot_id(host, port, engine_id=None, secret=secret, timeout_s=timeout_s)
            self._boot_ids.learned(destination, boot_id)
        try:
            return send(
                host,
                port,
                lease_keys,
                engine_id=engine_id,
                boot_id=boot_id,
                secret=secret,
                timeout_s=timeout_s,
                reader=self._reader,
            )
        except PeerRestarted:
            self._boot_ids.forget(destination)
            raise

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Empty):  # no message this poll: the timer's turn
                self._handle(self._queue.get(timeout=POLL_INTERVAL_S))
            if self._timer:
                self._beat_safely()

    def _beat_safely(self) -> None:
        try:
            self.beat_if_due()
        except Exception:  # the thread must outlive any failure, a bug included
            logger.exception("sending heartbeats failed; trying again at the next interval")

    def _handle(self, message: _Message) -> None:
        if self._backoff.should_skip(message.destination, self._clock()):
            self._num_skipped += 1
            return
        self._deliver(message)

    def _deliver(self, message: _Message) -> None:
        destination = message.destination
        try:
            message.send(
                destination.host,
                destination.port,
                message.lease_keys,
                engine_id=destination.engine_id,
                boot_id=destination.boot_id,
            )
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
