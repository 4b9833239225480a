"""The side-channel wire protocol: typed messages in an authenticated envelope, and free notifications.

Every side-channel frame is one msgpack-encoded ``Envelope``. Its ``payload`` is a msgpack
``Request`` (client -> server) or ``Reply`` (server -> client), each a tagged msgspec union.
Decoders are built once, at import; untrusted bytes only ever go through them.

Authentication (optional, when both sides are configured with the same shared secret) uses a
client nonce + timestamp rather than a server-issued challenge: one round trip per call (the
handshake is on a request's critical path and heartbeats are frequent), and the server keeps
no per-client state beyond the nonces it saw within the replay window. The client sends

    mac = HMAC-SHA256(secret, b"nixl-pd request" | version | nonce | timestamp_s | payload)

so the MAC also covers the message itself. The server (scheduler/auth.py) accepts a request
only if the MAC matches (constant-time compare), the timestamp is within the replay window of
its own clock, and the nonce was not seen within that window. Replies are authenticated too,
bound to the request they answer: HMAC-SHA256(secret, b"nixl-pd reply" | version | request
nonce | payload), so a client never trusts a handshake from a party that lacks the secret.
The scheme needs clocks synchronised to within the replay window (NTP is plenty).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from typing import Annotated

import msgspec

from connector.errors import InvalidNotification, ProtocolError
from connector.layout import RankLayout

PROTOCOL_VERSION = 1
NONCE_BYTES = 16

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
RequestIds = Annotated[tuple[RequestId, ...], msgspec.Meta(max_length=100_000)]


class WorkerHandshake(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one worker rank tells a peer: its NIXL agent, memory and compatibility facts."""

    protocol_version: int
    engine_id: str
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    region_addresses: tuple[int, ...]  # base address of each region of `layout`
    layout: RankLayout
    fingerprint: str  # hash of the model-wide compatibility facts
    compat_facts: dict[str, str]  # the facts that went into it, for error messages


# Requests: client -> server.


class HandshakeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="handshake"):
    """Ask for the WorkerHandshake of one TP rank of the serving engine."""

    tp_rank: Annotated[int, msgspec.Meta(ge=0)]


class Heartbeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="heartbeat"):
    """Decode still wants these prefill requests' blocks: extend their leases.

    ``engine_id`` names the prefill engine that holds them: request ids may repeat across a
    restart on the same host:port, so the server refuses a message meant for another engine.
    """

    engine_id: EngineId
    remote_request_ids: RequestIds


class Release(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="release"):
    """Decode will never read these prefill requests' blocks on ``engine_id``: free them now."""

    engine_id: EngineId
    remote_request_ids: RequestIds


Request = HandshakeRequest | Heartbeat | Release


# Replies: server -> client.


class HandshakeReply(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="handshake_reply"
):
    handshake: WorkerHandshake


class Ack(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="ack"):
    """A heartbeat or release was applied; ``num_known`` of its ids had a live lease."""

    num_known: int


class ErrorReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="error"):
    reason: str


Reply = HandshakeReply | Ack | ErrorReply


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One side-channel frame. Authentication fields are empty when no secret is configured."""

    protocol_version: int
    payload: bytes  # a msgpack-encoded Request or Reply
    nonce: bytes = b""  # request: fresh random bytes; reply: empty
    timestamp_s: float = 0.0  # request: sender's wall clock (seconds since the epoch)
    mac: bytes = b""


class _VersionProbe(msgspec.Struct):
    """Reads only the version, so a peer on another version gets a clear error, not 'garbage'."""

    protocol_version: int


_encoder = msgspec.msgpack.Encoder()
_probe_decoder = msgspec.msgpack.Decoder(_VersionProbe)
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def request_mac(secret: str, nonce: bytes, timestamp_s: float, payload: bytes) -> bytes:
    header = b"nixl-pd request" + struct.pack(">Id", PROTOCOL_VERSION, timestamp_s)
    return _mac(secret, header + nonce + payload)


def reply_mac(secret: str, request_nonce: bytes, payload: bytes) -> bytes:
    header = b"nixl-pd reply" + struct.pack(">I", PROTOCOL_VERSION)
    return _mac(secret, header + request_nonce + payload)


def macs_equal(expected: bytes, seen: bytes) -> bool:
    return hmac.compare_digest(expected, seen)


def _mac(secret: str, message: bytes) -> bytes:
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def encode_request(
    request: Request, *, secret: str | None, nonce: bytes, timestamp_s: float
) -> bytes:
    """One request frame; signed when ``secret`` is given (``nonce``: NONCE_BYTES random bytes)."""
    payload = _encoder.encode(request)
    if secret is None:
        return _encoder.encode(Envelope(PROTOCOL_VERSION, payload))
    mac = request_mac(secret, nonce, timestamp_s, payload)
    return _encoder.encode(Envelope(PROTOCOL_VERSION, payload, nonce, timestamp_s, mac))


def encode_reply(reply: Reply, *, secret: str | None, request_nonce: bytes) -> bytes:
    payload = _encoder.encode(reply)
    mac = b"" if secret is None else reply_mac(secret, request_nonce, payload)
    return _encoder.encode(Envelope(PROTOCOL_VERSION, payload, mac=mac))


def decode_envelope(frame: bytes) -> Envelope:
    """Decode a frame's envelope; raises ProtocolError for garbage or another protocol version."""
    try:
        version = _probe_decoder.decode(frame).protocol_version
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not a nixl-pd side-channel message ({_short(exc)})") from None
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks side-channel protocol version {version}, this side speaks "
            f"{PROTOCOL_VERSION}: run the same nixl-pd-connector version on both engines"
        )
    try:
        return _envelope_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed side-channel envelope ({_short(exc)})") from None


def decode_request_payload(payload: bytes) -> Request:
    try:
        return _request_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed side-channel request ({_short(exc)})") from None


def decode_reply(frame: bytes, *, secret: str | None, request_nonce: bytes) -> Reply:
    """Decode and (with a secret) authenticate the reply to the request sent with ``request_nonce``."""
    envelope = decode_envelope(frame)
    try:
        reply = _reply_decoder.decode(envelope.payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed side-channel reply ({_short(exc)})") from None
    if secret is None or macs_equal(
        reply_mac(secret, request_nonce, envelope.payload), envelope.mac
    ):
        return reply
    # Never trust an unauthenticated reply; an error's reason is still worth showing.
    said = f": it said {reply.reason!r}" if isinstance(reply, ErrorReply) else ""
    raise ProtocolError(
        "reply failed authentication: the server does not hold our side_channel_secret "
        f"(configure the same secret on both engines){said}"
    )


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:197] + "..."


# Free notifications: b"<remote_request_id>:<consumers>", carried by NIXL after a READ's data.

_COUNT_PATTERN = re.compile(rb"[0-9]{1,9}")


def encode_free_notif(remote_request_id: str, consumers: int) -> bytes:
    """``b"<remote_request_id>:<consumers>"``: this reader is one of ``consumers`` readers."""
    if not isinstance(remote_request_id, str) or not remote_request_id:
        raise InvalidNotification(
            f"free notification needs a non-empty prefill request id, got {remote_request_id!r}"
        )
    if isinstance(consumers, bool) or not isinstance(consumers, int) or not 0 < consumers < 10**9:
        raise InvalidNotification(
            f"free notification consumer count must be a positive integer below 1e9, got {consumers!r}"
        )
    return f"{remote_request_id}:{consumers}".encode()


def decode_free_notif(msg: bytes) -> tuple[str, int]:
    """Split ``msg`` on its LAST ':' into (remote_request_id, consumers).

    The id may itself contain ':'; it must be non-empty UTF-8. The count must be a positive
    decimal integer of ASCII digits (no sign, no spaces). Anything else: InvalidNotification.
    """
    if not isinstance(msg, bytes | bytearray):
        raise InvalidNotification(f"free notification must be bytes, got {type(msg).__name__}")
    id_bytes, colon, count_bytes = bytes(msg).rpartition(b":")
    if not colon:
        raise InvalidNotification(
            f"free notification {_show(msg)} has no ':'; expected b'<id>:<count>'"
        )
    if not _COUNT_PATTERN.fullmatch(count_bytes) or int(count_bytes) == 0:
        raise InvalidNotification(
            f"free notification {_show(msg)}: count {count_bytes!r} is not a positive decimal integer"
        )
    if not id_bytes:
        raise InvalidNotification(f"free notification {_show(msg)} has an empty request id")
    try:
        remote_request_id = id_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidNotification(
            f"free notification {_show(msg)}: request id is not UTF-8"
        ) from None
    return remote_request_id, int(count_bytes)


def _show(msg: bytes | bytearray) -> str:
    text = repr(bytes(msg))
    return text if len(text) <= 80 else text[:77] + "..."
