"""The side-channel wire protocol: typed messages in an authenticated envelope, and free notifications.

Every side-channel frame is one msgpack-encoded ``Envelope``. Its ``payload`` is a msgpack
``Request`` (client -> server) or ``Reply`` (server -> client), each a tagged msgspec union.
Decoders are built once, at import; untrusted bytes only ever go through them.

Authentication (optional: both sides configured with one shared secret) uses a client nonce +
timestamp, not a server-issued challenge: one round trip per call (handshakes are on a
request's critical path, heartbeats are frequent), and no per-client state on the server
beyond the nonces seen within the replay window. The client sends

    mac = HMAC-SHA256(secret, b"nixl-pd request" | version | timestamp_s | len(boot_id) |
                      boot_id | nonce | payload)

so the MAC also covers the message itself. The server (scheduler/auth.py) accepts a request
only if the MAC matches (constant-time compare), the timestamp is within the replay window of
its own clock, and the nonce was not seen within that window. Replies are authenticated too,
bound to the request they answer: HMAC-SHA256(secret, b"nixl-pd reply" | version | request
nonce | payload), so a client never trusts a handshake from a party that lacks the secret.
The scheme needs clocks synchronised to within the replay window (NTP is plenty).

The nonce table dies with the server process, so replay protection across a restart comes
from the boot id: a random id each side-channel server draws when it starts. Every request
but ``Hello`` names the boot id it is meant for (``Envelope.boot_id``, covered by the MAC);
a server refuses any other boot id with ``ErrorReply(code=STALE_BOOT)``. A client learns the
boot id from ``Hello`` (whose reply is signed and bound to the client's nonce); a frame
captured before a restart names the old boot id and is refused by the restarted engine even
when it reuses the engine id and port. ``Hello`` is harmless to replay: it changes nothing.

Lease messages name their sender (``ReaderId``: a reader restarted under its engine id is
another reader, scheduler/readers.py), and a LeaseRef the tokens and blocks it reads
(connector/lease_binding.py). The fields are optional on the wire, so an older peer's
messages decode, but an older reader's refs are refused (``LeaseStatus.refused``).

Overlapped dispatch (docs/overlap.md): AwaitLease awaits a transfer key's lease (chunked
pulls: its partials too), CancelTransfer ends it. Decoders raise only ProtocolError (and
InvalidNotification), never msgspec's UnicodeDecodeError or RecursionError: no traceback.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from typing import Annotated, Literal, TypeVar

import msgspec

from connector.errors import InvalidNotification, ProtocolError, clipped
from connector.layout import RankLayout
from connector.memory import HOST_MEMORY, Memory

PROTOCOL_VERSION = 2
NONCE_BYTES = 16
BOOT_ID_CHARS = 32  # a server's boot id: 16 random bytes in hex
STALE_BOOT = "stale_boot"  # ErrorReply.code: the request named another boot of this server

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
LeaseKeys = Annotated[tuple[RequestId, ...], msgspec.Meta(max_length=100_000)]  # lease_key() each
LeaseId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
BootId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


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
    memory: Memory = HOST_MEMORY  # where the regions live: a reader builds its READs with it
    backends: tuple[str, ...] = ("UCX",)  # NIXL backends the rank's agent has


# Requests: client -> server.


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="hello"):
    """Ask the server who it is: its engine id and boot id (the only request without one)."""


class HandshakeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="handshake"):
    """Ask for the WorkerHandshake of one TP rank of the serving engine."""

    tp_rank: Annotated[int, msgspec.Meta(ge=0)]


class Heartbeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="heartbeat"):
    """Decode still wants these prefill requests' blocks: extend their leases.

    ``lease_keys`` name leases: ``lease_key(request id, lease id)`` from the params
    (a bare request id only for params without a lease id), so a message meant for an earlier
    lease of a repeated request id touches nothing.

    ``engine_id`` names the prefill engine that holds them: request ids may repeat across a
    restart on the same host:port, so the server refuses a message meant for another engine.
    ``reader`` names the sender; the held leases it names are claimed by that reader boot.
    """

    engine_id: EngineId
    lease_keys: LeaseKeys = msgspec.field(name="remote_request_ids")  # the wire's older name
    reader: ReaderId | None = None  # None: an older reader that does not name itself


class Release(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="release"):
    """Decode will never read these prefill requests' blocks on ``engine_id``: free them now."""

    engine_id: EngineId
    lease_keys: LeaseKeys = msgspec.field(name="remote_request_ids")
    reader: ReaderId | None = None


class DigestClaim(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """verify_kv: what a decode rank READ of one group, and the sum of its digests.

    Units [first_unit, first_unit + num_units) of ``group`` for ``model_heads``
    (worker/kv_digest.py says what a unit is); ``value`` is the sum of their digests mod 2**64.
    """

    group: Annotated[int, msgspec.Meta(ge=0, le=4096)]
    first_unit: Annotated[int, msgspec.Meta(ge=0)]
    num_units: Annotated[int, msgspec.Meta(ge=1, le=2**24)]
    model_heads: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=4096)
    ]
    value: Annotated[int, msgspec.Meta(ge=0)]  # uint64 (msgspec bounds stop at int64)


class TokenDigest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """The token ids a reader expects a lease's blocks to hold: their first ``num_tokens``,
    digested (connector/lease_binding.py: blake2b-64 over the count and the int32 ids)."""

    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**31)]
    value: Annotated[int, msgspec.Meta(ge=0)]  # uint64 (msgspec bounds stop at int64)


class BlockDigest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """What a reader's READs come from: the remote block ids it was given, per cache group in
    order, and the tokens it assumes they hold, digested (connector/lease_binding.py:
    blake2b-64). The holder compares it with the blocks it leased (``Refusal``)."""

    num_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31)]
    value: Annotated[int, msgspec.Meta(ge=0)]  # uint64 (msgspec bounds stop at int64)


class ReaderId(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Who sends a lease message: the reading engine's id and the boot of its process (a random
    id drawn when its scheduler-side connector starts; its worker ranks send the same one)."""

    engine_id: EngineId
    boot_id: BootId


class LeaseRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One lease as its holder issued it: its request id and the lease id drawn for it,
    (verify_kv) what the reader claims to have read from it, the tokens the reader expects
    its blocks to hold, and the blocks (and token count) it reads them from. A ref without
    ``tokens`` or ``blocks`` (an older reader, one that knows no token ids) is never held
    for a lease bound to both, which every lease a holder offers is."""

    remote_request_id: RequestId
    lease_id: LeaseId
    claims: Annotated[tuple[DigestClaim, ...], msgspec.Meta(max_length=4096)] = ()
    tokens: TokenDigest | None = None
    blocks: BlockDigest | None = None


class LeaseCheck(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="lease_check"):
    """Decode finished reading these leases' blocks: are they all still held, right now?

    The answer is the proof a load needs (DESIGN: block ids are addresses, not capabilities):
    a lease that is held after the last READ landed was held during every READ, because a
    lease never revives and its id is never reused; except a host-staged lease, which starts
    not readable (``LeaseStatus.staged``: the reader must have seen it held before its first
    READ too). Changes nothing on the server.
    """

    engine_id: EngineId
    leases: Annotated[tuple[LeaseRef, ...], msgspec.Meta(max_length=100_000)]
    reader: ReaderId | None = None


TransferKey = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[0-9A-Za-z_.-]+$")]
MAX_AWAIT_HOLD_MS = 10_000  # the longest a server parks one AwaitLease before "pending"


class AwaitLease(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, tag="await_lease"
):
    """Overlapped dispatch: decode asks for the lease prefill draws for ``transfer_key``; the
    server answers as soon as it knows, or "pending" after ``hold_ms`` (ask again); with
    ``after_generation`` (chunked pulls) a newer "partial" one too (defaults are not sent)."""

    engine_id: EngineId
    transfer_key: TransferKey
    hold_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_AWAIT_HOLD_MS)] = 1000
    reader: ReaderId | None = None
    after_generation: Annotated[int, msgspec.Meta(ge=0)] | None = None


class CancelTransfer(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="cancel_transfer"
):
    """Overlapped dispatch: decode will never read ``transfer_key``'s lease: end it now, or
    (not drawn yet) never draw it. Answered with Ack (1: a lease was ended)."""

    engine_id: EngineId
    transfer_key: TransferKey
    reader: ReaderId | None = None


Request = Hello | HandshakeRequest | Heartbeat | Release | LeaseCheck | AwaitLease | CancelTransfer


# Replies: server -> client.


class HelloReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="hello_reply"):
    """Who answers at this host:port: send ``boot_id`` in every later request to it."""

    engine_id: str
    boot_id: str


class HandshakeReply(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="handshake_reply"
):
    handshake: WorkerHandshake


class Ack(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="ack"):
    """A heartbeat or release was applied; ``num_known`` of its ids had a live lease."""

    num_known: int


DIGEST_OK = "ok"
DIGEST_PENDING = "pending"  # prefill's ranks have not reported this lease's digests yet
RefusalKind = Literal["tokens", "blocks"]
REFUSED_TOKENS: RefusalKind = "tokens"  # the lease's blocks hold other tokens
REFUSED_BLOCKS: RefusalKind = "blocks"  # the reader reads other blocks or another token count


class Refusal(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Why a held lease is not held for one reader: ``kind`` says which part of its ref
    disagrees with what the holder leased, ``reason`` says how (for the load's failure)."""

    kind: RefusalKind
    reason: Annotated[str, msgspec.Meta(max_length=4096)]


class LeaseStatus(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, tag="lease_status"
):
    """Per LeaseRef of a LeaseCheck, in order: is that very lease held now, and (for refs with
    claims) do the claims match prefill's digests: "ok", "pending", or why not.

    ``refused`` (empty unless some ref was refused; omitted on the wire then): per ref, why
    a lease that is held is not held *for this reader* (None where it is): its blocks hold
    other tokens than the ref's ``tokens`` say, or the ref's ``blocks`` are not the blocks
    and token count the lease holds. Such a ref's ``held`` is False.
    """

    held: tuple[bool, ...]
    digests: tuple[str, ...] = ()
    refused: tuple[Refusal | None, ...] = ()
    # Host staging (both empty unless some ref names a staged lease; omitted on the wire then).
    # ``pending``: per ref, the lease is held but its blocks' device->host copy is not done
    # yet: not readable, ``held`` is False; ask again. ``staged``: per ref, the lease was
    # not readable at first (pending), so a reader must have seen it held before its READs.
    pending: tuple[bool, ...] = ()
    staged: tuple[bool, ...] = ()


class ErrorReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="error"):
    reason: str
    code: str = ""  # machine-readable kind where the client acts on it (STALE_BOOT), else ""


AnnouncementStatus = Literal["leased", "failed", "pending", "partial"]
ANNOUNCED_LEASED: AnnouncementStatus = "leased"  # ``params``: what prefill returned for decode
ANNOUNCED_FAILED: AnnouncementStatus = "failed"  # prefill ended the request without a lease
ANNOUNCED_PENDING: AnnouncementStatus = "pending"  # nothing yet (or not known here): ask again
ANNOUNCED_PARTIAL: AnnouncementStatus = "partial"  # chunked pulls: the whole blocks so far


class LeaseAnnouncement(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True,
    tag="lease_announcement",
):  # fmt: skip
    """The answer to AwaitLease. ``params`` ("leased") are exactly the kv_transfer_params
    prefill returned for its decode engine: decode validates them as it validates a router's;
    ("partial") the same for the blocks written so far, under the lease the final one keeps.
    ``reason`` says why ("failed"). ``generation`` numbers a key's partials from 1 (0, not
    sent, on the others: an older decode reads them)."""

    status: AnnouncementStatus
    params: dict[str, object] | None = None
    reason: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    generation: int = 0


Reply = HelloReply | HandshakeReply | Ack | LeaseStatus | ErrorReply | LeaseAnnouncement


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One side-channel frame. Authentication fields are empty when no secret is configured."""

    protocol_version: int
    payload: bytes  # a msgpack-encoded Request or Reply
    nonce: bytes = b""  # request: fresh random bytes; reply: empty
    timestamp_s: float = 0.0  # request: sender's wall clock (seconds since the epoch)
    mac: bytes = b""
    boot_id: str = ""  # request: the server boot it is meant for ("" only in Hello); reply: ""


class _VersionProbe(msgspec.Struct):
    """Reads only the version, so a peer on another version gets a clear error, not 'garbage'."""

    protocol_version: int


_encoder = msgspec.msgpack.Encoder()
_probe_decoder = msgspec.msgpack.Decoder(_VersionProbe)
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def request_mac(
    secret: str, nonce: bytes, timestamp_s: float, payload: bytes, boot_id: str = ""
) -> bytes:
    boot = boot_id.encode()
    header = b"nixl-pd request" + struct.pack(">IdI", PROTOCOL_VERSION, timestamp_s, len(boot))
    return _mac(secret, header + boot + nonce + payload)


def reply_mac(secret: str, request_nonce: bytes, payload: bytes) -> bytes:
    header = b"nixl-pd reply" + struct.pack(">I", PROTOCOL_VERSION)
    return _mac(secret, header + request_nonce + payload)


def macs_equal(expected: bytes, seen: bytes) -> bool:
    return hmac.compare_digest(expected, seen)


def _mac(secret: str, message: bytes) -> bytes:
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def encode_request(
    request: Request, *, secret: str | None, nonce: bytes, timestamp_s: float, boot_id: str = ""
) -> bytes:
    """One request frame for server boot ``boot_id`` (from its HelloReply; "" for a Hello).

    Signed when ``secret`` is given (``nonce``: NONCE_BYTES random bytes).
    """
    payload = _encoder.encode(request)
    if secret is None:
        return _encoder.encode(Envelope(PROTOCOL_VERSION, payload, boot_id=boot_id))
    mac = request_mac(secret, nonce, timestamp_s, payload, boot_id)
    return _encoder.encode(Envelope(PROTOCOL_VERSION, payload, nonce, timestamp_s, mac, boot_id))


def encode_reply(reply: Reply, *, secret: str | None, request_nonce: bytes) -> bytes:
    payload = _encoder.encode(reply)
    mac = b"" if secret is None else reply_mac(secret, request_nonce, payload)
    return _encoder.encode(Envelope(PROTOCOL_VERSION, payload, mac=mac))


def decode_envelope(frame: bytes) -> Envelope:
    """Decode a frame's envelope; raises ProtocolError for garbage or another protocol version."""
    version = _decode(_probe_decoder, frame, "not a nixl-pd side-channel message").protocol_version
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks side-channel protocol version {version}, this side speaks "
            f"{PROTOCOL_VERSION}: run the same nixl-pd-connector version on both engines"
        )
    return _decode(_envelope_decoder, frame, "malformed side-channel envelope")


def decode_request_payload(payload: bytes) -> Request:
    """Decode an envelope's payload into a Request; raises ProtocolError for anything else."""
    return _decode(_request_decoder, payload, "malformed side-channel request")


def decode_reply(frame: bytes, *, secret: str | None, request_nonce: bytes) -> Reply:
    """Decode and (with a secret) authenticate the reply to the request sent with ``request_nonce``."""
    envelope = decode_envelope(frame)
    reply = _decode(_reply_decoder, envelope.payload, "malformed side-channel reply")
    if secret is None or macs_equal(
        reply_mac(secret, request_nonce, envelope.payload), envelope.mac
    ):
        return reply
    # Never trust an unauthenticated reply; an error's reason is still worth showing.
    said = f": it said {clipped(reply.reason, 200)!r}" if isinstance(reply, ErrorReply) else ""
    raise ProtocolError(
        "reply failed authentication: the server does not hold our side_channel_secret "
        f"(configure the same secret on both engines){said}"
    )


_T = TypeVar("_T")


def _decode(decoder: msgspec.msgpack.Decoder[_T], data: bytes, what: str) -> _T:
    """``decoder.decode(data)``, with every failure on untrusted bytes as ProtocolError."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # Bad UTF-8: msgspec 0.23 says so in a DecodeError, older ones raise UnicodeDecodeError.
        bad_utf8 = isinstance(exc, UnicodeDecodeError) or "UTF-8" in str(exc)
        reason = "a string is not valid UTF-8" if bad_utf8 else clipped(str(exc), 200)
        raise ProtocolError(f"{what} ({reason})") from None
    except RecursionError:
        raise ProtocolError(f"{what} (nested too deeply)") from None
    except Exception as exc:  # any other failure on a peer's bytes is still malformed input
        raise ProtocolError(f"{what} ({type(exc).__name__}: {clipped(str(exc), 200)})") from None


# Free notifications: b"<remote_request_id>:<consumers>", sent by NIXL once a READ's data landed.


def lease_key(remote_request_id: str, lease_id: str) -> str:
    """What a free notification names: one lease, not just a request id.

    ``"<remote_request_id>@<lease_id>"``. Request ids repeat (routers reuse them, a restarted
    prefill reuses its engine id); lease ids are random per lease, so a late notification for
    an ended lease, or one meant for an earlier boot, can never count towards a live lease.
    Params without a lease id (an older prefill) name the bare request id.
    """
    return f"{remote_request_id}@{lease_id}" if lease_id else remote_request_id


_COUNT_PATTERN = re.compile(rb"[0-9]{1,9}")


def encode_free_notif(remote_request_id: str, consumers: int) -> bytes:
    """``b"<remote_request_id>:<consumers>"``: this reader is one of ``consumers`` readers.

    ``remote_request_id`` (the DESIGN contract's name) is what the prefill side counts by: the
    lease key (``lease_key``), a bare request id only for params of an older prefill.
    """
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
    """Split ``msg`` on its LAST ':' into (remote_request_id, consumers): (lease key, count).

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
        return id_bytes.decode("utf-8"), int(count_bytes)
    except UnicodeDecodeError:
        raise InvalidNotification(
            f"free notification {_show(msg)}: request id is not UTF-8"
        ) from None


def _show(msg: bytes | bytearray) -> str:
    return clipped(repr(bytes(msg)), 80)
