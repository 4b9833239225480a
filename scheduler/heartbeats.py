"""Send decode's lease heartbeats to prefill side channels from a small background thread.

The engine thread only enqueues (never blocks); a full queue drops the batch with a warning
(the next interval sends a fresh one). Failures are logged, never raised: a missed heartbeat
at worst lets a lease expire, and that load then fails on its own.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from connector.errors import ConnectorError
from connector.side_channel_client import send_heartbeat

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
    ) -> None:
        self._send: SendFn = send or (
            lambda host, port, ids: send_heartbeat(
                host, port, ids, secret=secret, timeout_s=timeout_s
            )
        )
        self._queue: queue.Queue[tuple[str, int, tuple[str, ...]]] = queue.Queue(max_queued)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def submit(self, host: str, port: int, remote_request_ids: Sequence[str]) -> bool:
        """Queue one heartbeat; False (and a warning) if the queue is full or stopped."""
        if self._stop.is_set():
            return False
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="nixl-pd-heartbeats", daemon=True
            )
            self._thread.start()
        try:
            self._queue.put_nowait((host, port, tuple(remote_request_ids)))
        except queue.Full:
            logger.warning("heartbeat queue full; dropping a heartbeat to %s:%d", host, port)
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
                host, port, remote_request_ids = self._queue.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                continue
            try:
                self._send(host, port, remote_request_ids)
            except ConnectorError as exc:
                logger.warning("heartbeat to %s:%d failed: %s", host, port, exc)
            except Exception:  # the thread must outlive a bug in one send
                logger.exception("heartbeat to %s:%d failed", host, port)
