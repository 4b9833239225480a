"""Side-channel messages and free notifications: round trips, and bad bytes rejected clearly."""

from __future__ import annotations

import msgspec
import pytest

from connector.errors import InvalidNotification, ProtocolError
from connector.layout import MemoryLayout, RankLayout
from connector.protocol import (
    PROTOCOL_VERSION,
    STALE_BOOT,
    Ack,
    Envelope,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Heartbeat,
    Hello,
    HelloReply,
    Release,
    Reply,
    Request,
    WorkerHandshake,
    decode_envelope,
    decode_free_notif,
    decode_reply,
    decode_request_payload,
    encode_free_notif,
    encode_reply,
    encode_request,
)

NONCE = b"n" * 16


def make_handshake(tp_rank: int = 0) -> WorkerHandshake:
    return WorkerHandshake(
        protocol_version=PROTOCOL_VERSION,
        engine_id="prefill-0",
        tp_rank=tp_rank,
        tp_size=2,
        agent_name="agent-0",
        agent_metadata=b"\x00\x01nixl",
        region_addresses=(4096, 8192),
        layout=RankLayout(tp_rank, 2, MemoryLayout.NHD, (), (1024, 1024)),
        fingerprint="abc123",
        compat_facts={"model": "tiny"},
    )


# ---- free notifications ----

VALID_NOTIFS = [
    ("a plain id", b"req-1:2", ("req-1", 2)),
    ("an id containing colons splits on the last one", b"cmpl:a:b:3", ("cmpl:a:b", 3)),
    ("a UTF-8 id", "zäh-✓:1".encode(), ("zäh-✓", 1)),
    ("leading zeros are still decimal", b"r:007", ("r", 7)),
    ("an id ending in a colon", b"r::4", ("r:", 4)),
]


@pytest.mark.parametrize(
    ("msg", "expected"), [c[1:] for c in VALID_NOTIFS], ids=[c[0] for c in VALID_NOTIFS]
)
def test_decode_free_notif_valid(msg: bytes, expected: tuple[str, int]) -> None:
    assert decode_free_notif(msg) == expected


INVALID_NOTIFS = [
    ("an empty message", b"", "has no ':'"),
    ("no colon", b"req-1", "has no ':'"),
    ("an empty id", b":3", "empty request id"),
    ("a zero count", b"req:0", "not a positive decimal"),
    ("a negative count", b"req:-1", "not a positive decimal"),
    ("a plus sign", b"req:+1", "not a positive decimal"),
    ("a leading space", b"req: 1", "not a positive decimal"),
    ("a trailing newline", b"req:1\n", "not a positive decimal"),
    ("an empty count", b"req:", "not a positive decimal"),
    ("a hex count", b"req:0x2", "not a positive decimal"),
    ("non-ASCII digits", "req:²".encode(), "not a positive decimal"),
    ("a huge count", b"req:" + b"9" * 5000, "not a positive decimal"),
    ("an id that is not UTF-8", b"\xff\xfe:1", "not UTF-8"),
]


@pytest.mark.parametrize(
    ("msg", "message"), [c[1:] for c in INVALID_NOTIFS], ids=[c[0] for c in INVALID_NOTIFS]
)
def test_decode_free_notif_invalid(msg: bytes, message: str) -> None:
    with pytest.raises(InvalidNotification, match=message):
        decode_free_notif(msg)


def test_decode_free_notif_rejects_str() -> None:
    with pytest.raises(InvalidNotification, match="must be bytes"):
        decode_free_notif("req:1")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_id", "consumers"),
    [("req", 1), ("a:b", 4), ("ünï", 128)],
    ids=["plain", "id with a colon", "unicode id"],
)
def test_free_notif_round_trip(request_id: str, consumers: int) -> None:
    assert decode_free_notif(encode_free_notif(request_id, consumers)) == (request_id, consumers)


@pytest.mark.parametrize(
    ("request_id", "consumers", "message"),
    [("", 1, "non-empty"), ("r", 0, "positive"), ("r", -2, "positive"), ("r", True, "positive")],
    ids=["empty id", "zero consumers", "negative consumers", "bool consumers"],
)
def test_encode_free_notif_rejects_bad_input(request_id: str, consumers: int, message: str) -> None:
    with pytest.raises(InvalidNotification, match=message):
        encode_free_notif(request_id, consumers)


# ---- side-channel messages ----

REQUESTS: list[Request] = [
    Hello(),
    HandshakeRequest(3),
    Heartbeat("prefill-0", ("a", "b")),
    Release("prefill-0", ("c",)),
]


@pytest.mark.parametrize("request_msg", REQUESTS, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("secret", [None, "s" * 16], ids=["open", "with secret"])
def test_request_round_trip(request_msg: Request, secret: str | None) -> None:
    frame = encode_request(request_msg, secret=secret, nonce=NONCE, timestamp_s=1.0, boot_id="b")
    envelope = decode_envelope(frame)
    assert decode_request_payload(envelope.payload) == request_msg
    assert bool(envelope.mac) == (secret is not None)
    assert envelope.boot_id == "b"


@pytest.mark.parametrize(
    "reply",
    [
        HelloReply("prefill-0", "b" * 32),
        HandshakeReply(make_handshake()),
        Ack(2),
        ErrorReply("nope"),
        ErrorReply("restarted", code=STALE_BOOT),
    ],
    ids=["hello", "handshake", "ack", "error", "stale boot"],
)
def test_reply_round_trip_with_secret(reply: Reply) -> None:
    frame = encode_reply(reply, secret="k" * 16, request_nonce=NONCE)
    assert decode_reply(frame, secret="k" * 16, request_nonce=NONCE) == reply


REPLY_FAILURES = [
    ("a reply to another request", "k" * 16, b"x" * 16, "failed authentication"),
    ("a reply signed with another secret", "q" * 16, NONCE, "failed authentication"),
]


@pytest.mark.parametrize(
    ("secret", "nonce", "message"),
    [c[1:] for c in REPLY_FAILURES],
    ids=[c[0] for c in REPLY_FAILURES],
)
def test_reply_authentication_failures(secret: str, nonce: bytes, message: str) -> None:
    frame = encode_reply(Ack(1), secret="k" * 16, request_nonce=NONCE)
    with pytest.raises(ProtocolError, match=message):
        decode_reply(frame, secret=secret, request_nonce=nonce)


def test_unauthenticated_error_reply_still_shows_its_reason() -> None:
    frame = encode_reply(ErrorReply("authentication required"), secret=None, request_nonce=b"")
    with pytest.raises(ProtocolError, match="it said 'authentication required'"):
        decode_reply(frame, secret="k" * 16, request_nonce=NONCE)


encode = msgspec.msgpack.encode

BAD_FRAMES = [
    ("random bytes", b"\x93\xff\x00garbage", "not a nixl-pd side-channel message"),
    ("empty bytes", b"", "not a nixl-pd side-channel message"),
    ("a msgpack list", encode([1, 2, 3]), "not a nixl-pd side-channel message"),
    ("a version that is a string", encode({"protocol_version": "1"}), "not a nixl-pd"),
    ("another protocol version", encode({"protocol_version": 99, "payload": b""}), "version 99"),
    (
        "an envelope missing its payload",
        encode({"protocol_version": PROTOCOL_VERSION}),
        "malformed",
    ),
    (
        "an envelope with an unknown field",
        encode({"protocol_version": PROTOCOL_VERSION, "payload": b"", "extra": 1}),
        "malformed side-channel envelope",
    ),
    (
        "a truncated envelope",
        encode_request(HandshakeRequest(0), secret=None, nonce=b"", timestamp_s=0.0)[:-3],
        "not a nixl-pd side-channel message",
    ),
    (
        "an unknown field nested 5,000 deep (RecursionError inside msgspec)",
        b"\x83"
        + encode({"protocol_version": PROTOCOL_VERSION, "payload": b""})[1:]
        + b"\xa1x"
        + b"\x91" * 5_000
        + b"\x00",
        r"not a nixl-pd side-channel message \(nested too deeply\)",
    ),
    (
        "a boot id that is not UTF-8 (UnicodeDecodeError inside msgspec)",
        encode({"protocol_version": PROTOCOL_VERSION, "payload": b"", "boot_id": "\xe9"}).replace(
            "\xe9".encode(), b"\xff\xfe"
        ),
        r"malformed side-channel envelope \(a string is not valid UTF-8\)",
    ),
]


@pytest.mark.parametrize(
    ("frame", "message"), [c[1:] for c in BAD_FRAMES], ids=[c[0] for c in BAD_FRAMES]
)
def test_decode_envelope_rejects_bad_frames(frame: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_envelope(frame)


BAD_PAYLOADS = [
    ("an unknown tag", encode({"type": "shutdown"}), "malformed side-channel request"),
    ("a negative tp_rank", encode({"type": "handshake", "tp_rank": -1}), ">= 0"),
    ("a string tp_rank", encode({"type": "handshake", "tp_rank": "0"}), "got `str`"),
    (
        "a heartbeat with int ids",
        encode({"type": "heartbeat", "engine_id": "e", "remote_request_ids": [1]}),
        "got `int`",
    ),
    (
        "a release with an empty id",
        encode({"type": "release", "engine_id": "e", "remote_request_ids": [""]}),
        "length >= 1",
    ),
    (
        "a heartbeat without an engine id",
        encode({"type": "heartbeat", "remote_request_ids": ["a"]}),
        "missing required field `engine_id`",
    ),
    (
        "a release without an engine id",
        encode({"type": "release", "remote_request_ids": ["a"]}),
        "missing required field `engine_id`",
    ),
    (
        "a heartbeat with an empty engine id",
        encode({"type": "heartbeat", "engine_id": "", "remote_request_ids": ["a"]}),
        r"length >= 1 - at `\$.engine_id`",
    ),
    (
        "a release with an engine id too long",
        encode({"type": "release", "engine_id": "e" * 4097, "remote_request_ids": ["a"]}),
        r"length <= 4096 - at `\$.engine_id`",
    ),
    (
        "a heartbeat with an engine id that is not a string",
        encode({"type": "heartbeat", "engine_id": 7, "remote_request_ids": ["a"]}),
        r"Expected `str`, got `int` - at `\$.engine_id`",
    ),
    ("a reply sent as a request", encode({"type": "ack", "num_known": 1}), "malformed"),
    (
        "a request id that is not UTF-8",
        encode({"type": "release", "engine_id": "e", "remote_request_ids": ["\xe9"]}).replace(
            "\xe9".encode(), b"\xff\xfe"
        ),
        r"malformed side-channel request \(a string is not valid UTF-8\)",
    ),
    (
        "ids nested 3,000 deep",
        b"\x83"
        + encode({"type": "release", "engine_id": "e"})[1:]
        + b"\xb2remote_request_ids"
        + b"\x91" * 3_000
        + b"\xa1a",
        r"malformed side-channel request \(",
    ),
    ("a truncated payload", encode(HandshakeRequest(5))[:-1], "malformed"),
]


@pytest.mark.parametrize(
    ("payload", "message"), [c[1:] for c in BAD_PAYLOADS], ids=[c[0] for c in BAD_PAYLOADS]
)
def test_decode_request_payload_rejects_bad_payloads(payload: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_request_payload(payload)


def test_worker_handshake_forbids_unknown_fields() -> None:
    raw = msgspec.to_builtins(make_handshake())
    raw["surprise"] = 1
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        msgspec.convert(raw, WorkerHandshake)


def test_envelope_is_versioned() -> None:
    frame = encode_request(HandshakeRequest(0), secret=None, nonce=b"", timestamp_s=0.0)
    assert msgspec.msgpack.decode(frame, type=Envelope).protocol_version == PROTOCOL_VERSION
