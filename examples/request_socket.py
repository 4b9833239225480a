"""The request socket of `nixl-pd serve`: a loopback ZMQ ROUTER whose own thread answers pings.

One engine step can hold the engine loop's thread for seconds (200 requests x 64 tokens: 2.9 s
on a 2-core VM; 150 x 256: 12 s, issue 25), longer than a router waits for a ping. So the socket
is not the loop's: a relay thread owns the bound ROUTER, answers ``{"type": "ping"}`` itself (a
live process answers even mid-step; a stopped or killed one cannot), and hands every other
message to the engine loop's thread over an inproc PAIR, and the loop's replies back out::

    clients --tcp--> ROUTER (relay thread) --inproc PAIR--> EngineLoop thread
                       `-- Pong for each Ping

Messages are size-bounded (an oversized one drops that peer's connection); commands the loop
has not taken yet are bounded too (beyond that the relay refuses them with a reply).
"""

from __future__ import annotations

import logging
import math
import threading
import uuid

import msgspec
import zmq

from connector.errors import UnsupportedConfiguration
from connector.net.side_channel_client import zmq_endpoint
from examples.engine import RequestOutput
from examples.engine_loop import (
    BadCommand,
    Command,
    Error,
    Event,
    GetInfo,
    GetStats,
    Output,
    Peer,
    Ping,
    Pong,
    Submit,
    decode_command,
)

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 4 * 2**20  # a 4096-token prompt is ~25 KiB of JSON
MAX_BATCH_MESSAGES = 256  # messages moved per turn, so steps (and replies) keep flowing
MAX_PING_BYTES = 64  # `{"type": "ping"}` and some whitespace; larger goes to the loop
MAX_QUEUED_COMMANDS = 4096  # relayed, not yet taken by the loop (its in-flight limit too)
MAX_QUEUED_BYTES = 256 * 2**20
RELAY_POLL_MS = 100  # the relay thread notices close() within this
RELAY_JOIN_S = 2.0
# Shutdown is not a socket command: whoever started the server stops it (Ctrl-C, SIGTERM).
socket_command_decoder = msgspec.json.Decoder(Submit | GetStats | GetInfo | Ping)


def is_ping(payload: bytes) -> bool:
    if len(payload) > MAX_PING_BYTES:
        return False
    try:
        return isinstance(decode_command(socket_command_decoder, payload), Ping)
    except BadCommand:
        return False


def refusal(payload: bytes, num_queued: int) -> Event:
    """The reply to a command that arrives while ``num_queued`` wait for the engine."""
    message = f"the server has {num_queued} commands queued for its engine; retry later"
    try:
        command = decode_command(socket_command_decoder, payload)
    except BadCommand as exc:
        return Error(f"bad command: {exc}")
    if isinstance(command, Submit):  # a refused request fails alone, with the reason
        return Output(RequestOutput(command.request.request_id, [], error=message))
    return Error(message)


class SocketTransport:
    """The engine loop's Transport over a bound ROUTER that a relay thread owns.

    ``receive``, ``decode``, ``send`` and ``close`` are the loop thread's; the ROUTER and the
    PAIR's relay end are the relay thread's only (ZMQ sockets are not thread-safe).
    """

    def __init__(self, host: str, port: int, max_message_bytes: int = MAX_REQUEST_BYTES) -> None:
        context: zmq.Context = zmq.Context.instance()
        self._router: zmq.Socket = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._router.setsockopt(zmq.IPV6, 1)
        try:
            self._router.bind(zmq_endpoint(host, port or "*"))
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            raise UnsupportedConfiguration(
                f"request socket cannot bind {host}:{port} ({exc}); another server may hold "
                "the port: pass a free --port (0 picks one)"
            ) from None
        self.port = int(self._router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._relay_end, self._loop_end = _inproc_pair(context)
        self._lock = threading.Lock()  # guards the two counters below (relay adds, loop takes)
        self._num_queued = 0
        self._queued_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._relay, name="nixl-pd-request-relay", daemon=True
        )
        self._thread.start()

    def receive(self, timeout_s: float) -> list[tuple[bytes, Peer]] | None:
        """Commands relayed so far (waits ``timeout_s`` for the first); None once the relay
        thread is gone, so the server stops instead of serving a deaf socket."""
        messages: list[tuple[bytes, Peer]] = []
        if not self._thread.is_alive():
            return None
        if not self._loop_end.poll(math.ceil(timeout_s * 1000)):  # 0.5 ms -> 1 ms, not 0
            return messages
        while len(messages) < MAX_BATCH_MESSAGES:
            try:
                frames = self._loop_end.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            # ROUTER prepends the peer's identity; a REQ peer adds an empty delimiter frame.
            messages.append((frames[len(frames) - 1], tuple(frames[: len(frames) - 1])))
        with self._lock:
            self._num_queued -= len(messages)
            self._queued_bytes -= sum(len(payload) for payload, _ in messages)
        return messages

    def decode(self, payload: bytes) -> Command:
        return decode_command(socket_command_decoder, payload)

    def send(self, peer: Peer, event: Event) -> None:
        try:  # the relay thread sends it on; a peer that is gone: ROUTER drops the reply
            self._loop_end.send_multipart([*peer, msgspec.json.encode(event)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("reply to a peer dropped: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(RELAY_JOIN_S)
        if self._thread.is_alive():  # cannot happen: each relay turn is bounded
            logger.error("the request relay thread did not stop within %s s", RELAY_JOIN_S)
            return  # leave its sockets to it rather than close them under it
        for socket in (self._router, self._relay_end, self._loop_end):
            socket.close(linger=0)

    def _relay(self) -> None:
        """Relay thread: move messages both ways until close(); a crash is logged, and
        ``receive`` then tells the loop the transport is closed."""
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._relay_end, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(RELAY_POLL_MS))
                if self._relay_end in ready:
                    self._relay_replies()
                if self._router in ready:
                    self._relay_commands()
        except Exception:
            logger.exception("the request relay thread failed; the server stops")

    def _relay_replies(self) -> None:
        for _ in range(MAX_BATCH_MESSAGES):
            try:
                frames = self._relay_end.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._send_out(frames)

    def _relay_commands(self) -> None:
        for _ in range(MAX_BATCH_MESSAGES):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            payload, peer = frames[len(frames) - 1], frames[: len(frames) - 1]
            if is_ping(payload):
                self._send_out([*peer, msgspec.json.encode(Pong())])
                continue
            num_queued = self._admit(len(payload))
            if num_queued is not None:
                self._send_out([*peer, msgspec.json.encode(refusal(payload, num_queued))])
                continue
            self._relay_end.send_multipart(frames)  # no high-water mark: never blocks

    def _admit(self, num_bytes: int) -> int | None:
        """Count one more queued command; or, if the queue is full, how many wait (refuse)."""
        with self._lock:
            if (
                self._num_queued >= MAX_QUEUED_COMMANDS
                or self._queued_bytes + num_bytes > MAX_QUEUED_BYTES
            ):
                return self._num_queued
            self._num_queued += 1
            self._queued_bytes += num_bytes
            return None

    def _send_out(self, frames: list[bytes]) -> None:
        try:  # a peer that is gone or not reading: ROUTER drops the reply
            self._router.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("reply to a peer dropped: %s", exc)


def _inproc_pair(context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """Two connected PAIR sockets without high-water marks (the relay bounds the commands;
    replies are the loop's own outputs, drained as fast as they come)."""
    address = f"inproc://nixl-pd-request-relay-{uuid.uuid4().hex}"
    ends = []
    for connect in (False, True):
        socket = context.socket(zmq.PAIR)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        if connect:
            socket.connect(address)
        else:
            socket.bind(address)
        ends.append(socket)
    return ends[0], ends[1]
