"""`EngineClient`: the router's handle to one `nixl-pd serve` request socket, with liveness.

A ZMQ DEALER keeps many requests in flight; every wait is bounded. ZMQ hides a dead peer (it
queues and reconnects quietly), so the client watches two signals to report a dead server as
such instead of letting its requests time out: the connection dropping (a killed process: the
kernel closes its sockets) and silence (a stopped or hung one: a Ping, sent after
``ping_after_s`` without any message, unanswered for ``dead_after_s``).

Busy is not dead: the server answers Ping from its socket's own thread
(``examples.request_socket``), even while one engine step takes longer than ``dead_after_s``.
A server that answers pings keeps its requests until their own deadline (the router's
timeout), however slow its engine is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from connector.net.side_channel_client import zmq_endpoint
from examples.engine import EngineRequest, RequestOutput
from examples.engine_loop import (
    Command,
    Error,
    Event,
    GetInfo,
    GetStats,
    Info,
    Output,
    Ping,
    Stats,
    Submit,
    event_decoder,
)
from examples.request_socket import MAX_REQUEST_BYTES

Reply = TypeVar("Reply", Info, Stats)
MAX_EVENTS_PER_POLL = 1024
PING_AFTER_S = 1.0  # silence, while requests are pending, before a liveness ping
DEAD_AFTER_S = 5.0  # an unanswered ping older than this: the process is stopped or hung
MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class EngineClient:
    """An EngineHandle over one server's request socket (a ZMQ DEALER); every wait bounded."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ping_after_s: float = PING_AFTER_S,
        dead_after_s: float = DEAD_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = f"{host}:{port}"
        self.socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.socket.setsockopt(zmq.IPV6, 1)
        self.monitor: zmq.Socket = self.socket.get_monitor_socket(MONITORED)
        self.socket.connect(zmq_endpoint(host, port))
        self._outputs: list[RequestOutput] = []
        self._ping_after_s = ping_after_s
        self._dead_after_s = dead_after_s
        self._clock = clock
        self._last_heard_s = clock()
        self._ping_sent_s: float | None = None
        self._connected = False
        self._problem: str | None = None

    def submit(self, request: EngineRequest) -> None:
        self._send(Submit(request))

    def poll(self, timeout_s: float) -> list[RequestOutput]:
        """Outputs received since the last poll (waits at most ``timeout_s`` for the first)."""
        event = self._next_event(0.0 if self._outputs else timeout_s)
        for _ in range(MAX_EVENTS_PER_POLL):
            if event is None:
                break
            self._take(event)
            event = self._next_event(0.0)
        outputs, self._outputs = self._outputs, []
        return outputs

    def problem(self, num_pending: int) -> str | None:
        """Why this server cannot finish its ``num_pending`` requests, or None if it may."""
        self._watch_connection()
        if self._problem is None and num_pending > 0:
            self._watch_silence()
        return self._problem

    def info(self, timeout_s: float) -> Info:
        return self._call(GetInfo(), Info, timeout_s)

    def stats(self, timeout_s: float) -> Stats:
        return self._call(GetStats(), Stats, timeout_s)

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _watch_connection(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected and self._problem is None:
                # Its requests lived in that process: a restarted server does not know them.
                self._problem = (
                    f"the server at {self.address} closed the connection: it exited or was "
                    "killed, and the requests it held are lost"
                )

    def _watch_silence(self) -> None:
        now_s = self._clock()
        if self._ping_sent_s is None:
            if now_s - self._last_heard_s > self._ping_after_s:
                self._send(Ping())
                self._ping_sent_s = now_s
        elif now_s - self._ping_sent_s > self._dead_after_s:
            self._problem = (
                f"the server at {self.address} stopped answering: no reply to a ping within "
                f"{self._dead_after_s} s (is the process stopped or hung?)"
            )

    def _send(self, command: Command) -> None:
        self.socket.send(msgspec.json.encode(command))

    def _call(self, command: Command, reply_type: type[Reply], timeout_s: float) -> Reply:
        self._send(command)
        deadline_s = time.monotonic() + timeout_s
        while (remaining_s := deadline_s - time.monotonic()) > 0:
            event = self._next_event(remaining_s)
            if isinstance(event, reply_type):
                return event
            if event is not None:
                self._take(event)
        raise TimeoutError(
            f"no engine answered on {self.address} within {timeout_s} s: is `nixl-pd serve` "
            "running there?"
        )

    def _next_event(self, timeout_s: float) -> Event | None:
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        payload = self.socket.recv()
        self._last_heard_s, self._ping_sent_s = self._clock(), None
        try:
            return event_decoder.decode(payload)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise ConnectionError(f"{self.address} sent a message we cannot read: {exc}") from None

    def _take(self, event: Event) -> None:
        if isinstance(event, Output):
            self._outputs.append(event.output)
        elif isinstance(event, Error):
            raise ConnectionError(f"{self.address} refused a command: {event.message}")
