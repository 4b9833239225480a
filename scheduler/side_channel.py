"""The side-channel server: a ZMQ ROUTER on a background thread answering handshakes and leases.

It serves each TP rank's WorkerHandshake, applies heartbeats and releases, and answers lease
checks, through three thread-safe callbacks (they run on this thread). A heartbeat or release
names the engine it is for; one meant for another engine (a late message to an engine that
restarted on this host:port, whose request ids may repeat) is refused, never reaching them.
Every request but Hello also names this server's boot id, drawn at random when it is made:
a frame captured before a restart (same engine id, same port) is refused as stale.
A reader that names itself in a message (``reader``: its engine id and boot) is reported to
``on_reader`` with the leases the message named (for a lease check, those found held): the
holder remembers which reader boot claimed which lease, and ends the leases of a reader's
earlier boot (scheduler/readers.py). Messages without a reader (older peers) skip it.
Overlapped dispatch (docs/overlap.md, with a ``transfers`` board): an AwaitLease whose
transfer key has not settled is parked (at most MAX_PARKED, each until its ``hold_ms``) and
answered from this thread as soon as the board says what the key came to; the board wakes
the poll through a socket pair. A CancelTransfer goes to the board, which ends the lease.
``lag_s`` says how long the serving thread has been in its current turn: the lease owner does
not expire leases while it is behind (scheduler/producer.py), since heartbeats may be waiting.
It is a network service: inbound messages are size-bounded (zmq.MAXMSGSIZE drops the peer's
connection), decoded only through typed msgspec decoders, optionally authenticated, and any bad
input is answered with an ErrorReply. Refusals are logged through a rate-limited log (one line
per kind of refusal per interval), so a flood of garbage cannot flood the log. Nothing a peer
sends stops the thread; only ``stop()`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import socket as stdlib_socket
import threading
import time
from collections.abc import Callable, Mapping

import zmq

from connector.errors import ProtocolError, UnsupportedConfiguration
from connector.net.side_channel_client import zmq_endpoint
from connector.observability.ratelimit import RateLimitedLog
from connector.protocol import (
    ANNOUNCED_PENDING,
    STALE_BOOT,
    Ack,
    AwaitLease,
    CancelTransfer,
    Envelope,
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
    decode_envelope,
    decode_request_payload,
    encode_reply,
    lease_key,
)
from scheduler.auth import RequestAuthenticator
from scheduler.transfer_board import TransferBoard

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 50
MAX_PARKED = 1024  # AwaitLease requests parked at once; past it, one is answered "pending" now
PENDING = LeaseAnnouncement(ANNOUNCED_PENDING)
# A turn of the serving loop (a poll, and the answer if a request came) this slow means peers
# waited as long for their handshakes and lease checks: logged (rate-limited) with how much of
# it went into answering (a callback waiting on a lock) and how much elsewhere (a poll that
# returned late: this thread did not get the CPU or the GIL).
SLOW_TURN_S = 5.0
LeaseCallback = Callable[[tuple[str, ...]], int]  # lease keys -> how many were held
# The leases a LeaseCheck names -> whether each very lease is held now (and its digests match)
LeaseCheckCallback = Callable[[tuple[LeaseRef, ...]], LeaseStatus]
# A reader named itself in a message naming these leases (lease keys) -> leases it ended
ReaderCallback = Callable[[ReaderId, tuple[str, ...]], int]


def _no_leases(refs: tuple[LeaseRef, ...]) -> LeaseStatus:
    return LeaseStatus((False,) * len(refs))


def _ignore_reader(reader: ReaderId, names: tuple[str, ...]) -> int:
    return 0


@dataclasses.dataclass(frozen=True, slots=True)
class _Park:
    """An AwaitLease with nothing to announce yet: answer it when the key settles (or, asked
    with ``after_generation``, announces a newer partial) or at ``hold_ms``, from the serving
    thread (the only one that touches the socket)."""

    transfer_key: str
    hold_ms: int
    after_generation: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Parked:
    transfer_key: str
    route: tuple[bytes, ...]  # the peer's identity, and the REQ delimiter if any
    nonce: bytes
    deadline: float  # monotonic seconds
    after_generation: int | None


class SideChannelServer:
    """Bind with ``start()``, serve on a daemon thread, ``stop()`` to close and join.

    ``port`` 0 binds a free ephemeral port; ``port`` then reports the bound one.
    ``engine_id`` is this engine's id: heartbeats and releases naming another are refused.
    ``boot_id`` (default: random) is this server's incarnation; requests naming another are
    refused. ``clock`` is wall-clock seconds, used only for the authentication replay window;
    ``log_clock`` (monotonic seconds) paces the rate-limited log, at most one line per kind of
    refusal per interval, and times the serving loop's turns.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handshakes: Mapping[int, WorkerHandshake],
        *,
        engine_id: str,
        on_heartbeat: LeaseCallback,
        on_release: LeaseCallback,
        on_lease_check: LeaseCheckCallback = _no_leases,
        on_reader: ReaderCallback = _ignore_reader,
        secret: str | None = None,
        max_message_bytes: int = 16 * 2**20,
        clock: Callable[[], float] = time.time,
        boot_id: str | None = None,
        log_clock: Callable[[], float] = time.monotonic,
        transfers: TransferBoard | None = None,  # overlapped dispatch (scheduler/transfer_board.py)
    ) -> None:
        if not engine_id:
            raise UnsupportedConfiguration(
                "the side channel needs this engine's non-empty engine_id, got ''"
            )
        self._host = host
        self._engine_id = engine_id
        self._port = port
        self._handshakes = dict(handshakes)
        self._on_heartbeat = on_heartbeat
        self._on_release = on_release
        self._on_lease_check = on_lease_check
        self._on_reader = on_reader
        self._secret = secret
        self._max_message_bytes = max_message_bytes
        self._clock = clock
        self._auth = RequestAuthenticator(secret)
        self._boot_id = boot_id or secrets.token_hex(16)
        self._log = RateLimitedLog(logger, clock=log_clock)
        self._log_clock = log_clock  # also times the serving loop's turns
        self._transfers = transfers
        self._parked: list[_Parked] = []  # the serving thread's own
        # A board change wakes the serving thread's poll through this pair (any thread writes).
        self._wake_recv, self._wake_send = stdlib_socket.socketpair()
        self._wake_send.setblocking(False)
        self._wake_recv.setblocking(False)
        if transfers is not None:
            transfers.watch(self._wake)
        self.num_refused = 0  # requests answered with an ErrorReply; side-channel thread writes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._socket: zmq.Socket | None = None
        # When the serving thread's turn began (log_clock; None: not serving); one float store
        self._turn_started_s: float | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        return self._host

    @property
    def boot_id(self) -> str:
        return self._boot_id

    def lag_s(self) -> float:
        """Seconds the serving thread has been in its current turn (any thread; 0.0 when not
        serving): over a tenth of a second, messages (heartbeats) may wait unread."""
        started_s = self._turn_started_s
        return 0.0 if started_s is None else max(0.0, self._log_clock() - started_s)

    def start(self) -> None:
        """Bind (raising UnsupportedConfiguration naming host:port on failure), then serve."""
        if self._thread is not None:
            return
        self._socket = self._bind()
        # The socket moves to the serving thread; Thread.start() is the memory barrier zmq needs.
        self._thread = threading.Thread(
            target=self._serve, name=f"nixl-pd-side-channel-{self._port}", daemon=True
        )
        self._thread.start()
        logger.info("side channel serving on %s:%d", self._host, self._port)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving, close the socket and join the thread (bounded by ``timeout_s``)."""
        self._stop.set()
        if self._thread is None:  # never served: the serving thread closes them otherwise
            self._wake_recv.close()
            self._wake_send.close()
        else:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("side channel thread did not stop within %s s", timeout_s)
            self._thread = None

    def _bind(self) -> zmq.Socket:
        socket = router_socket(zmq.Context.instance(), self._max_message_bytes)
        try:
            socket.bind(zmq_endpoint(self._host, self._port or "*"))
            self._port = int(socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise UnsupportedConfiguration(
                f"side channel cannot bind {self._host}:{self._port} ({exc}); another engine or "
                "process may hold the port: set VLLM_NIXL_SIDE_CHANNEL_PORT (and _HOST) to a "
                "free port on an address of this machine, one per engine"
            ) from None
        return socket

    def _serve(self) -> None:
        socket = self._socket
        if socket is None:
            return
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._wake_recv.fileno(), zmq.POLLIN)
        try:
            while not self._stop.is_set():
                turn_started_s = self._log_clock()
                self._turn_started_s = turn_started_s
                try:
                    answering_s = 0.0
                    ready = dict(poller.poll(POLL_INTERVAL_MS))
                    if socket in ready:
                        answering_s = self._serve_one(socket)
                    if self._wake_recv.fileno() in ready:
                        self._drain_wake()
                    if self._parked:
                        self._answer_parked(socket)
                    self._note_slow_turn(self._log_clock() - turn_started_s, answering_s)
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ETERM:
                        return  # the zmq context is shutting down (interpreter exit)
                    logger.warning("side channel poll failed: %s", exc)
                    self._stop.wait(POLL_INTERVAL_MS / 1000)
        finally:
            self._turn_started_s = None
            socket.close(linger=0)
            self._socket = None
            self._wake_recv.close()
            self._wake_send.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            self._wake_send.send(b"\0")

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):  # drained
            while self._wake_recv.recv(4096):
                pass

    def _answer_parked(self, socket: zmq.Socket) -> None:
        """Answer the parked AwaitLease requests whose key settled or whose hold ran out."""
        now, still = self._log_clock(), []
        for parked in self._parked:
            key, after = parked.transfer_key, parked.after_generation
            status = None if self._transfers is None else self._transfers.status(key, after)
            if status is None and parked.deadline > now:
                still.append(parked)
                continue
            frame = encode_reply(status or PENDING, secret=self._secret, request_nonce=parked.nonce)
            self._send(socket, [*parked.route, frame])
        self._parked = still

    def _send(self, socket: zmq.Socket, frames: list[bytes]) -> None:
        try:
            socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._log.warning("reply", "side channel could not reply to a peer: %s", exc)

    def _serve_one(self, socket: zmq.Socket) -> float:
        """Receive one request and reply; returns the seconds spent answering it."""
        try:
            identity, *frames = socket.recv_multipart(zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError) as exc:  # EAGAIN after a dropped oversized message
            self._log.log(logging.DEBUG, "receive", "side channel receive: %s", exc)
            return 0.0
        # A REQ peer sends [b"", message] and expects the empty delimiter back; DEALER: [message].
        delimiter = [b""] if frames and frames[0] == b"" else []
        started_s = self._log_clock()
        reply, nonce = self._reply(frames[len(delimiter) :])
        if isinstance(reply, _Park) and len(self._parked) < MAX_PARKED:
            deadline = self._log_clock() + reply.hold_ms / 1000
            route = (identity, *delimiter)
            parked = _Parked(reply.transfer_key, route, nonce, deadline, reply.after_generation)
            self._parked.append(parked)
            return self._log_clock() - started_s
        frame = self._encode(reply, nonce)
        answering_s = self._log_clock() - started_s
        self._send(socket, [identity, *delimiter, frame])
        return answering_s

    def _note_slow_turn(self, turn_s: float, answering_s: float) -> None:
        if turn_s >= SLOW_TURN_S:
            self._log.warning(
                "slow turn",
                "side channel of engine %s: one turn of its loop took %.1f s, %.1f s of it "
                "answering a request (the rest: the %d ms poll returned late, so this thread "
                "waited for the CPU or the GIL); peers' handshakes and lease checks waited as long",
                self._engine_id, turn_s, answering_s, POLL_INTERVAL_MS,
            )  # fmt: skip

    def answer(self, frames: list[bytes]) -> bytes:
        """The reply frame to one request's message frames; bad input becomes an ErrorReply.

        Never raises. Tests may call it on a server that was never started (it touches no
        socket); an AwaitLease with nothing to announce is answered "pending" at once here.
        """
        return self._encode(*self._reply(frames))

    def _encode(self, reply: Reply | _Park, nonce: bytes) -> bytes:
        if isinstance(reply, _Park):  # not parked (too many are, or answer()): pending now
            reply = PENDING
        elif isinstance(reply, ErrorReply):
            self.num_refused += 1
        return encode_reply(reply, secret=self._secret, request_nonce=nonce)

    def _reply(self, frames: list[bytes]) -> tuple[Reply | _Park, bytes]:
        """The reply to one request (or _Park: answer it later) and the request's nonce."""
        nonce = b""
        stage = "malformed"  # the kind of refusal, for the rate-limited log
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one message frame, got {len(frames)}")
            envelope = decode_envelope(frames[0])
            nonce = envelope.nonce
            stage = "unauthenticated"
            self._auth.check(envelope, self._clock())
            stage = "malformed"
            reply = self._dispatch(decode_request_payload(envelope.payload), envelope)
        except ProtocolError as exc:
            self._log.warning(stage, "side channel refused a request (%s): %s", stage, exc)
            reply = ErrorReply(str(exc))
        except Exception as exc:  # a bug must not kill the listener; the peer gets the reason
            self._log.error("internal", "side channel failed to answer a request", exc_info=True)
            reply = ErrorReply(f"internal error: {type(exc).__name__}: {exc}")
        return reply, nonce

    def _dispatch(self, request: Request, envelope: Envelope) -> Reply | _Park:
        if isinstance(request, Hello):
            return HelloReply(self._engine_id, self._boot_id)
        if envelope.boot_id != self._boot_id:
            return self._refuse_stale_boot(request, envelope.boot_id)
        if isinstance(request, HandshakeRequest):
            return self._handshake(request.tp_rank)
        if request.engine_id != self._engine_id:
            return self._refuse_other_engine(request)
        if isinstance(request, AwaitLease | CancelTransfer):
            return self._transfer(request)
        reply: Reply
        if isinstance(request, LeaseCheck):
            reply = self._on_lease_check(request.leases)
            names = _held_names(request.leases, reply)
        else:
            on_ids = self._on_heartbeat if isinstance(request, Heartbeat) else self._on_release
            reply = self._ack(request, on_ids(request.lease_keys))
            names = request.lease_keys
        if request.reader is not None:
            self._note_reader(request.reader, names)
        return reply

    def _transfer(self, request: AwaitLease | CancelTransfer) -> Reply | _Park:
        """Overlapped dispatch: what a transfer key came to (parked until known), or its cancel."""
        if self._transfers is None:
            return ErrorReply(
                f"engine {self._engine_id!r} serves no overlapped dispatch (transfer keys)"
            )
        key = request.transfer_key
        if isinstance(request, CancelTransfer):
            return Ack(self._transfers.cancel(key))
        status = self._transfers.status(key, request.after_generation)
        return status or _Park(key, request.hold_ms, request.after_generation)

    def _note_reader(self, reader: ReaderId, names: tuple[str, ...]) -> None:
        """Tell the holder who sent the message; log the leases its restart orphaned."""
        num_ended = self._on_reader(reader, names)
        if num_ended:
            self._log.info(
                "reader_restarted", "side channel: reader engine %r is now boot %r; ended %d lease(s) only its "
                "earlier boot had claimed (it will never read or free them)",
                reader.engine_id[:80], reader.boot_id, num_ended,
            )  # fmt: skip

    def _ack(self, request: Heartbeat | Release, num_known: int) -> Ack:
        """Acknowledge, noting keys with no lease here (never leased, or already ended)."""
        num_stray = len(set(request.lease_keys)) - num_known
        if num_stray > 0:
            kind = type(request).__name__.lower()
            self._log.info(
                f"stray_{kind}", "side channel: a %s named %d lease key(s) with no lease here "
                "(never leased by this engine, or already freed); they were ignored",
                kind, num_stray,
            )  # fmt: skip
        return Ack(num_known)

    def _refuse_stale_boot(self, request: Request, boot_id: str) -> ErrorReply:
        """A request for another boot of this server (or none): replayed, late or from old code."""
        kind = type(request).__name__
        self._log.info(
            "stale_boot", "side channel refused a %s for boot %r: this is boot %r",
            kind, boot_id[:40], self._boot_id,
        )  # fmt: skip
        return ErrorReply(
            f"{kind} names side-channel boot {boot_id[:40]!r} but engine {self._engine_id!r} "
            f"at this host:port is boot {self._boot_id!r}: the engine restarted since the "
            "sender learned its boot id (its leases are gone) or the request is a replay; "
            "nothing was done here. Send Hello to learn the current boot id",
            code=STALE_BOOT,
        )

    def _refuse_other_engine(
        self, request: Heartbeat | Release | LeaseCheck | AwaitLease | CancelTransfer
    ) -> ErrorReply:
        """Touch no lease: the ids are another engine's, and may name this engine's requests."""
        kind = type(request).__name__.lower()
        self._log.info(
            "other_engine", "side channel refused a %s for engine %r: this is engine %r",
            kind, request.engine_id[:80], self._engine_id,
        )  # fmt: skip
        return ErrorReply(
            f"{kind} for prefill engine {request.engine_id[:80]!r} reached engine "
            f"{self._engine_id!r} at this host:port: that engine restarted (its KV is gone) or "
            "the request's remote_host/remote_port name the wrong engine; nothing was "
            "extended or released here"
        )

    def _handshake(self, tp_rank: int) -> Reply:
        handshake = self._handshakes.get(tp_rank)
        if handshake is None:
            ranks = ", ".join(map(str, sorted(self._handshakes))) or "none"
            return ErrorReply(f"no tp_rank {tp_rank} here: this engine serves ranks {ranks}")
        return HandshakeReply(handshake)


def _held_names(refs: tuple[LeaseRef, ...], status: Reply) -> tuple[str, ...]:
    """The lease keys of the refs a LeaseStatus found held."""
    if not isinstance(status, LeaseStatus) or len(status.held) != len(refs):
        return ()
    return tuple(
        lease_key(ref.remote_request_id, ref.lease_id)
        for ref, held in zip(refs, status.held, strict=True)
        if held
    )


# What one peer can make this process hold, whatever it sends. A client call is a fresh REQ
# socket with one request in flight, so queueing more only feeds a flood (allocated by zmq's
# I/O thread, freed by this one, and glibc keeps that high-water mark).
RECEIVE_HWM_MESSAGES = 1  # requests queued per peer; a full queue stops reading its TCP
SEND_HWM_MESSAGES = 4  # replies queued for a peer that does not read them; more are dropped
TCP_RECEIVE_BUFFER_BYTES = 256 * 2**10  # the kernel's per connection (Linux doubles it)


def router_socket(context: zmq.Context, max_message_bytes: int) -> zmq.Socket:
    """The side channel's ROUTER, not yet bound, with what a peer can cost bounded.

    Per peer, at most about ``(RECEIVE_HWM_MESSAGES + 1) * max_message_bytes`` of requests
    (one queued, one being read; an oversized one drops the peer's connection),
    ``SEND_HWM_MESSAGES`` replies and ``TCP_RECEIVE_BUFFER_BYTES`` of kernel buffer. The
    number of peers is bounded only by the process's file descriptors.
    """
    socket: zmq.Socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM_MESSAGES)
    socket.setsockopt(zmq.SNDHWM, SEND_HWM_MESSAGES)
    socket.setsockopt(zmq.RCVBUF, TCP_RECEIVE_BUFFER_BYTES)
    socket.setsockopt(zmq.IPV6, 1)
    return socket
