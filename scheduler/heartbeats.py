"""Send decode's heartbeats and releases to prefill side channels from a background thread.

The engine thread only enqueues (never blocks); a full queue drops the message with a warning
(the next interval sends a fresh heartbeat). Failures are logged, never raised: a missed
heartbeat at worst lets a lease expire, and a missed release leaves the prefill blocks to
their lease.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from connector.errors import ConnectorError
from connector.side_channel_client import send_heartbeat, send_release

logger = logging.getLogger(__name__)

SendFn = Callable[[str, int, Sequence[str]], object]  # (host, port, remote_request_ids)
POLL_INTERVAL_S = 0.1


class HeartbeatSender:
    """Start lazily on the first ``submit``; ``stop()`` joins the thread."""

    def __init__(
        self,
        *,
        secret: str | None,
        timeout_s: float,
        max_queued: int = 64,
        send: SendFn | None = None,
        send_release_fn: SendFn | None = None,
    ) -> None:
        self._send: SendFn = send or (
            lambda host, port, ids: send_heartbeat(
                host, port, ids, secret=secret, timeout_s=timeout_s
            )
        )
        self._send_release: SendFn = send_release_fn or (
            lambda host, port, ids: send_release(
                host, port, ids, secret=secret, timeout_s=timeout_s
            )
        )
        self._queue: queue.Queue[tuple[SendFn, str, int, tuple[str, ...]]] = queue.Queue(max_queued)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def submit(self, host: str, port: int, remote_request_ids: Sequence[str]) -> bool:
        """Queue one heartbeat; False (and a warning) if the queue is full or stopped."""
        return self._enqueue(self._send, host, port, remote_request_ids)

    def submit_release(self, host: str, port: int, remote_request_ids: Sequence[str]) -> bool:
        """Queue one release (decode will never read these); False if full or stopped."""
        return self._enqueue(self._send_release, host, port, remote_request_ids)

    def _enqueue(
        self, send: SendFn, host: str, port: int, remote_request_ids: Sequence[str]
    ) -> bool:
        if self._stop.is_set():
            return False
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="nixl-pd-heartbeats", daemon=True
            )
            self._thread.start()
        try:
            self._queue.put_nowait((send, host, port, tuple(remote_request_ids)))
        except queue.Full:
            logger.warning("side-channel queue full; dropping a message to %s:%d", host, port)
            return False
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                send, host, port, remote_request_ids = self._queue.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                continue
            try:
                send(host, port, remote_request_ids)
            except ConnectorError as exc:
                logger.warning("side-channel message to %s:%d failed: %s", host, port, exc)
            except Exception:  # the thread must outlive a bug in one send
                logger.exception("side-channel message to %s:%d failed", host, port)
