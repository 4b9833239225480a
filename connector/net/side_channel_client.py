"""Blocking side-channel client calls: fetch a rank's handshake, send heartbeats, releases and
lease checks.

Each exchange sends one request on a ZMQ REQ socket (linger 0, bounded reply size) and waits
for one reply (time this process spent stopped does not count against the timeout). Each
thread keeps its connected sockets, one per side channel, for the next exchange: a round trip
on a connected socket skips TCP's and ZMQ's connection handshakes. A socket whose exchange
failed in any way (timeout, zmq error) is closed, so a late reply can never answer a later
request.

Every request but Hello names the server's boot id (see connector/protocol.py):
``fetch_boot_id`` asks for it, and a call given no boot id asks first (one more round trip).
Every failure (timeout, refused authentication, error reply, garbage, zmq error) raises
HandshakeError with the reason; a server that restarted since ``boot_id`` was learned raises
its subclass PeerRestarted, and one that did not answer in time its subclass
SideChannelTimeout. Calls are safe from any thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

import zmq

from connector.errors import (
    HandshakeError,
    PeerRestarted,
    ProtocolError,
    SideChannelTimeout,
    clipped,
)
from connector.protocol import (
    MAX_AWAIT_HOLD_MS,
    NONCE_BYTES,
    STALE_BOOT,
    Ack,
    AwaitLease,
    CancelTransfer,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Heartbeat,
    Hello,
    HelloReply,
    LeaseAnnouncement,
    LeaseCheck,
    LeaseRef,
    LeaseStatus,
    ReaderId,
    Release,
    Reply,
    Request,
    WorkerHandshake,
    decode_reply,
    encode_request,
)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 2**20
_SLICE_S = 0.25  # a reply wait polls in slices this long (see _receive)
MAX_SOCKETS_PER_THREAD = 64  # connected side channels a thread keeps; the oldest is closed
SocketKey = tuple[str, int, int]  # (host, port, max_message_bytes)
_R = TypeVar("_R", bound=Reply)


def zmq_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port`` (port may be "*": any free port), with IPv6 literals bracketed."""
    if ":" in host and not host.startswith("["):
        return f"tcp://[{host}]:{port}"
    return f"tcp://{host}:{port}"


def fetch_boot_id(
    host: str,
    port: int,
    *,
    engine_id: str | None,
    secret: str | None,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> str:
    """The boot id of the side channel at host:port: ``fetch_identity``'s."""
    return fetch_identity(
        host, port, engine_id=engine_id, secret=secret, timeout_s=timeout_s,
        max_message_bytes=max_message_bytes,
    ).boot_id  # fmt: skip


def fetch_identity(
    host: str,
    port: int,
    *,
    engine_id: str | None,
    secret: str | None,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> HelloReply:
    """Who serves the side channel at host:port: its engine id and boot id (Hello).

    With ``engine_id``, a server that is another engine raises HandshakeError.
    """
    reply = _call(host, port, Hello(), secret, timeout_s, max_message_bytes, boot_id="")
    reply = _expect(HelloReply, reply, host, port, "Hello")
    if engine_id is not None and reply.engine_id != engine_id:
        raise HandshakeError(
            f"side channel {host}:{port} is engine {reply.engine_id[:80]!r}, not {engine_id!r}: "
            "that engine restarted under another id (its KV is gone) or the request's "
            "remote_host/remote_port name the wrong engine"
        )
    return reply


def fetch_handshake(
    host: str,
    port: int,
    tp_rank: int,
    *,
    secret: str | None,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    boot_id: str = "",
) -> WorkerHandshake:
    """The WorkerHandshake of ``tp_rank`` of the engine whose side channel is host:port.

    With ``boot_id`` (the boot the request's params name), one exchange: a server that is
    another boot raises PeerRestarted at once (the KV the params name died with that boot).
    Without, two: Hello for the boot id, then the handshake request naming it.
    """
    request = HandshakeRequest(tp_rank)
    reply = _call(
        host, port, request, secret, timeout_s, max_message_bytes, boot_id=boot_id or None
    )
    reply = _expect(HandshakeReply, reply, host, port, "a handshake request")
    if reply.handshake.tp_rank != tp_rank:
        raise HandshakeError(
            f"side channel {host}:{port} answered a handshake for tp_rank {tp_rank} with "
            f"rank {reply.handshake.tp_rank}'s handshake"
        )
    return reply.handshake


def send_heartbeat(
    host: str,
    port: int,
    lease_keys: Sequence[str],
    *,
    engine_id: str,
    secret: str | None,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    boot_id: str | None = None,
    reader: ReaderId | None = None,
) -> int:
    """Extend the leases of ``lease_keys`` on prefill engine ``engine_id``.

    Returns how many the server still held; a server that is not ``engine_id`` (a restarted
    engine on the same host:port) refuses, and this raises HandshakeError; one that is not
    boot ``boot_id`` raises PeerRestarted. ``boot_id`` None: ask the server for it first.
    """
    request = Heartbeat(engine_id, tuple(lease_keys), reader)
    reply = _call(host, port, request, secret, timeout_s, max_message_bytes, boot_id=boot_id)
    return _expect(Ack, reply, host, port, "a Heartbeat").num_known


def send_release(
    host: str,
    port: int,
    lease_keys: Sequence[str],
    *,
    engine_id: str,
    secret: str | None,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    boot_id: str | None = None,
    reader: ReaderId | None = None,
) -> int:
    """Tell prefill engine ``engine_id`` decode will never read ``lease_keys``.

    Returns how many it held; refused (HandshakeError) by a server that is not ``engine_id``,
    or (PeerRestarted) not boot ``boot_id``. ``boot_id`` None: ask the server for it first.
    """
    request = Release(engine_id, tuple(lease_keys), reader)
    reply = _call(host, port, request, secret, timeout_s, max_message_bytes, boot_id=boot_id)
    return _expect(Ack, reply, host, port, "a Release").num_known


def check_leases_status(
    host: str,
    port: int,
    leases: Sequence[tuple[str, str] | LeaseRef],
    *,
    engine_id: str,
    boot_id: str,
    secret: str | None,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    reader: ReaderId | None = None,
) -> LeaseStatus:
    """For each (remote request id, lease id): does prefill ``engine_id``, boot ``boot_id``,
    hold that very lease now (``LeaseStatus.held``)? With verify_kv claims in the refs, also
    the digest verdict per ref (``digests``), and why a held lease is not held for this reader
    (``refused``: a ref's ``tokens`` or ``blocks`` are not what it leased). ``reader`` names
    the asking engine and boot (scheduler/readers.py).

    One exchange, no Hello: the boot id comes from the params, so a prefill that restarted
    since it leased raises PeerRestarted (its leases died with it).
    """
    refs = tuple(ref if isinstance(ref, LeaseRef) else LeaseRef(*ref) for ref in leases)
    request = LeaseCheck(engine_id, refs, reader)
    reply = _call(host, port, request, secret, timeout_s, max_message_bytes, boot_id=boot_id)
    claimed = any(ref.claims for ref in refs)
    if (
        not isinstance(reply, LeaseStatus)
        or len(reply.held) != len(refs)
        or (claimed and len(reply.digests) != len(refs))
        or len(reply.refused) not in (0, len(refs))
    ):
        raise HandshakeError(
            f"side channel {host}:{port} answered a lease check of {len(refs)} lease(s) with "
            f"{clipped(repr(reply), 500)}"
        )
    return reply


def await_lease(
    host: str,
    port: int,
    transfer_key: str,
    *,
    engine_id: str,
    boot_id: str,
    hold_s: float,
    secret: str | None,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    reader: ReaderId | None = None,
    after_generation: int | None = None,
) -> LeaseAnnouncement:
    """Overlapped dispatch: what prefill ``engine_id`` (boot ``boot_id``) drew for
    ``transfer_key``, waiting up to ``hold_s`` on its side (then "pending": ask again).
    ``timeout_s`` bounds the wait for the reply beyond the hold. ``after_generation``
    (chunked pulls): a partial announcement newer than it answers too."""
    hold_ms = max(0, min(MAX_AWAIT_HOLD_MS, round(hold_s * 1000)))
    request = AwaitLease(engine_id, transfer_key, hold_ms, reader, after_generation)
    reply = _call(
        host, port, request, secret, hold_ms / 1000 + timeout_s, max_message_bytes,
        boot_id=boot_id,
    )  # fmt: skip
    return _expect(LeaseAnnouncement, reply, host, port, "an AwaitLease")


def cancel_transfer(
    host: str,
    port: int,
    transfer_key: str,
    *,
    engine_id: str,
    secret: str | None,
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    boot_id: str | None = None,
    reader: ReaderId | None = None,
) -> int:
    """Overlapped dispatch: decode will never read ``transfer_key``'s lease on prefill
    ``engine_id``; returns 1 if a lease was ended, 0 if the cancel was remembered for later."""
    request = CancelTransfer(engine_id, transfer_key, reader)
    reply = _call(host, port, request, secret, timeout_s, max_message_bytes, boot_id=boot_id)
    return _expect(Ack, reply, host, port, "a CancelTransfer").num_known


def _expect(reply_type: type[_R], reply: Reply, host: str, port: int, asked: str) -> _R:
    """``reply`` if it is a ``reply_type``; else HandshakeError naming what was ``asked``."""
    if not isinstance(reply, reply_type):
        raise HandshakeError(
            f"side channel {host}:{port} answered {asked} with {type(reply).__name__}"
        )
    return reply


def _call(
    host: str,
    port: int,
    request: Request,
    secret: str | None,
    timeout_s: float,
    max_message_bytes: int,
    *,
    boot_id: str | None,
) -> Reply:
    """One exchange for server boot ``boot_id``; None: ask the server's Hello for it first,
    whichever engine it is (the server, not Hello, checks a request's engine id: one refusal,
    naming both engines)."""
    if boot_id is None:
        boot_id = fetch_boot_id(
            host, port, engine_id=None, secret=secret, timeout_s=timeout_s,
            max_message_bytes=max_message_bytes,
        )  # fmt: skip
    nonce = os.urandom(NONCE_BYTES)
    frame = encode_request(
        request, secret=secret, nonce=nonce, timestamp_s=time.time(), boot_id=boot_id
    )
    raw_reply = _exchange(host, port, frame, timeout_s, max_message_bytes)
    try:
        reply = decode_reply(raw_reply, secret=secret, request_nonce=nonce)
    except ProtocolError as exc:
        raise HandshakeError(f"side channel {host}:{port}: {exc}") from None
    if isinstance(reply, ErrorReply):
        error = PeerRestarted if reply.code == STALE_BOOT else HandshakeError
        raise error(f"side channel {host}:{port} refused the request: {clipped(reply.reason, 500)}")
    return reply


def _exchange(
    host: str, port: int, frame: bytes, timeout_s: float, max_message_bytes: int
) -> bytes:
    timeout_ms = max(1, int(timeout_s * 1000))
    key = (host, port, max_message_bytes)
    socket = _SOCKETS.take(key)
    try:
        socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        socket.send(frame)
        if (reply := _receive(socket, timeout_s)) is not None:
            _SOCKETS.keep(key, socket)
            return reply
        raise zmq.Again()
    except zmq.Again:
        socket.close(linger=0)
        raise SideChannelTimeout(
            f"side channel {host}:{port} did not answer within {timeout_s} s (is the remote "
            "engine up, is host:port its VLLM_NIXL_SIDE_CHANNEL_HOST/PORT, or was the reply "
            f"larger than max_message_bytes={max_message_bytes}?)"
        ) from None
    except BaseException as exc:
        socket.close(linger=0)  # a REQ socket mid-exchange cannot be used again
        if isinstance(exc, zmq.ZMQError):
            raise HandshakeError(f"side channel {host}:{port}: zmq error: {exc}") from None
        raise


class _ThreadSockets(threading.local):
    """This thread's connected REQ sockets, one per side channel, least recently used first.

    A socket is taken out for an exchange and kept again only after a whole one; a process
    forked from this one starts with none (the parent's sockets are not its own)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.sockets: OrderedDict[SocketKey, zmq.Socket] = OrderedDict()

    def take(self, key: SocketKey) -> zmq.Socket:
        if self.pid != os.getpid():
            self.pid, self.sockets = os.getpid(), OrderedDict()
        socket = self.sockets.pop(key, None)
        return socket if socket is not None else _connect(*key)

    def keep(self, key: SocketKey, socket: zmq.Socket) -> None:
        self.sockets[key] = socket
        while len(self.sockets) > MAX_SOCKETS_PER_THREAD:
            _, oldest = self.sockets.popitem(last=False)
            oldest.close(linger=0)


_SOCKETS = _ThreadSockets()


def _connect(host: str, port: int, max_message_bytes: int) -> zmq.Socket:
    socket: zmq.Socket = zmq.Context.instance().socket(zmq.REQ)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        socket.setsockopt(zmq.IPV6, 1)
        socket.connect(zmq_endpoint(host, port))
    except zmq.ZMQError as exc:
        socket.close(linger=0)
        raise HandshakeError(f"side channel {host}:{port}: zmq error: {exc}") from None
    return socket


def _receive(socket: zmq.Socket, timeout_s: float) -> bytes | None:
    """The reply, or None once ``timeout_s`` of waiting passed without one.

    Waits in slices and counts each at most ``_SLICE_S`` twice over: time this process spent
    stopped (SIGSTOP, a long pause of the whole host) is not time the peer kept us waiting, so
    a reader paused past the timeout still reads the reply that arrived meanwhile instead of
    failing a load on a silence that was its own.
    """
    waited_s = 0.0
    for _ in range(int(4 * timeout_s / _SLICE_S) + 8):  # bounded: each slice counts >= 1/4
        slice_s = max(0.001, min(_SLICE_S, timeout_s - waited_s))
        started = time.monotonic()
        if socket.poll(max(1, round(slice_s * 1000)), zmq.POLLIN):
            return socket.recv(zmq.NOBLOCK)
        waited_s += max(slice_s / 4, min(time.monotonic() - started, 2 * _SLICE_S))
        if waited_s >= timeout_s:
            return None
    return None
