"""The side-channel server: a ZMQ ROUTER on a background thread answering handshakes and leases.

It serves each TP rank's WorkerHandshake, and applies heartbeats and releases through two
callbacks (which must be thread-safe: they run on this thread). A heartbeat or release names
the engine it is for; one meant for another engine (a late message to an engine that restarted
on this host:port, whose request ids may repeat) is refused and never reaches the callbacks.
It is a network service: inbound messages are size-bounded (zmq.MAXMSGSIZE drops the peer's
connection), decoded only through typed msgspec decoders, optionally authenticated, and any bad
input is answered with an ErrorReply. Nothing a peer sends stops the thread; only ``stop()``
does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import zmq

from connector.errors import ProtocolError, UnsupportedConfiguration
from connector.protocol import (
    Ack,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Heartbeat,
    Release,
    Reply,
    Request,
    WorkerHandshake,
    decode_envelope,
    decode_request_payload,
    encode_reply,
)
from connector.side_channel_client import zmq_endpoint
from scheduler.auth import DEFAULT_REPLAY_WINDOW_S, RequestAuthenticator

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 50
LeaseCallback = Callable[[tuple[str, ...]], int]  # request ids -> how many were held


class SideChannelServer:
    """Bind with ``start()``, serve on a daemon thread, ``stop()`` to close and join.

    ``port`` 0 binds a free ephemeral port; ``port`` then reports the bound one.
    ``engine_id`` is this engine's id: heartbeats and releases naming another are refused.
    ``clock`` is wall-clock seconds, used only for the authentication replay window.
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
        secret: str | None = None,
        max_message_bytes: int = 16 * 2**20,
        clock: Callable[[], float] = time.time,
        replay_window_s: float = DEFAULT_REPLAY_WINDOW_S,
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
        self._secret = secret
        self._max_message_bytes = max_message_bytes
        self._clock = clock
        self._auth = RequestAuthenticator(secret, replay_window_s=replay_window_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._socket: zmq.Socket | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        return self._host

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
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("side channel thread did not stop within %s s", timeout_s)
            self._thread = None

    def _bind(self) -> zmq.Socket:
        socket: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        socket.setsockopt(zmq.IPV6, 1)
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
        try:
            while not self._stop.is_set():
                try:
                    if socket.poll(POLL_INTERVAL_MS, zmq.POLLIN):
                        self._serve_one(socket)
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ETERM:
                        return  # the zmq context is shutting down (interpreter exit)
                    logger.warning("side channel poll failed: %s", exc)
                    self._stop.wait(POLL_INTERVAL_MS / 1000)
        finally:
            socket.close(linger=0)
            self._socket = None

    def _serve_one(self, socket: zmq.Socket) -> None:
        try:
            identity, *frames = socket.recv_multipart(zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError) as exc:  # EAGAIN after a dropped oversized message
            logger.debug("side channel receive: %s", exc)
            return
        # A REQ peer sends [b"", message] and expects the empty delimiter back; DEALER: [message].
        delimiter = [b""] if frames and frames[0] == b"" else []
        reply_frame = self._answer(frames[len(delimiter) :])
        try:
            socket.send_multipart([identity, *delimiter, reply_frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("side channel could not reply to a peer: %s", exc)

    def _answer(self, frames: list[bytes]) -> bytes:
        """Always returns a reply frame; bad input becomes an ErrorReply."""
        nonce = b""
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one message frame, got {len(frames)}")
            envelope = decode_envelope(frames[0])
            nonce = envelope.nonce
            self._auth.check(envelope, self._clock())
            reply = self._dispatch(decode_request_payload(envelope.payload))
        except ProtocolError as exc:
            logger.warning("side channel rejected a request: %s", exc)
            reply = ErrorReply(str(exc))
        except Exception as exc:  # a bug must not kill the listener; the peer gets the reason
            logger.exception("side channel failed to answer a request")
            reply = ErrorReply(f"internal error: {type(exc).__name__}: {exc}")
        return encode_reply(reply, secret=self._secret, request_nonce=nonce)

    def _dispatch(self, request: Request) -> Reply:
        if isinstance(request, HandshakeRequest):
            return self._handshake(request.tp_rank)
        if isinstance(request, Heartbeat | Release) and request.engine_id != self._engine_id:
            return self._refuse_other_engine(request)
        if isinstance(request, Heartbeat):
            return Ack(self._on_heartbeat(request.remote_request_ids))
        if isinstance(request, Release):
            return Ack(self._on_release(request.remote_request_ids))
        raise ProtocolError(f"unexpected request {type(request).__name__}")

    def _refuse_other_engine(self, request: Heartbeat | Release) -> ErrorReply:
        """Touch no lease: the ids are another engine's, and may name this engine's requests."""
        kind = type(request).__name__.lower()
        logger.info(
            "side channel refused a %s for engine %r: this is engine %r",
            kind,
            request.engine_id,
            self._engine_id,
        )
        return ErrorReply(
            f"{kind} for prefill engine {request.engine_id!r} reached engine "
            f"{self._engine_id!r} at this host:port: that engine restarted (its KV is gone) or "
            "the request's remote_host/remote_port name the wrong engine; nothing was "
            "extended or released here"
        )

    def _handshake(self, tp_rank: int) -> Reply:
        handshake = self._handshakes.get(tp_rank)
        if handshake is None:
            return ErrorReply(
                f"no tp_rank {tp_rank} here: this engine serves ranks {_ranks(self._handshakes)}"
            )
        return HandshakeReply(handshake)


def _ranks(handshakes: Iterable[int]) -> str:
    ranks = sorted(handshakes)
    return ", ".join(map(str, ranks)) if ranks else "none"
