"""Every decoder on the side channel and the free-notification path survives generated garbage.

Issue 11: side-channel decoders raised untyped errors (RecursionError, UnicodeDecodeError) on
about 400 of 30,000 fuzzed frames, before authentication. Here hypothesis feeds at least 10,000
generated inputs to each decoder (batches of BATCH inputs per example, to keep the file to a
few seconds) and only typed results or typed errors may come out:

- the server's whole request path (``SideChannelServer.answer``: envelope, authentication,
  boot id, request payload), with and without a secret, including correctly signed garbage;
- the client's reply decoder (``decode_reply``), with and without a secret;
- the free notification decoder (``decode_free_notif``);
- the authenticated envelope (``decode_envelope`` + ``RequestAuthenticator.check``);
- the prefill rank's NotificationCounter, which must log a garbage flood in a few lines.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.errors import InvalidNotification, ProtocolError
from connector.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Envelope,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Hello,
    HelloReply,
    Release,
    decode_envelope,
    decode_free_notif,
    decode_reply,
    encode_reply,
    encode_request,
    request_mac,
)
from scheduler.auth import RequestAuthenticator
from scheduler.side_channel import SideChannelServer
from tests.test_protocol import make_handshake
from worker.notifications import NotificationCounter

SECRET = "correct horse battery staple"
ENGINE_ID = "prefill-0"
BOOT_ID = "b" * 32
NOW_S = 1_800_000_000.0
NUM_SEEDS = 8  # structured inputs hypothesis draws per example
NUM_MUTANTS = 24  # byte-level variants of each, from a hypothesis-controlled Random
BATCH = NUM_SEEDS * (1 + NUM_MUTANTS)
NUM_EXAMPLES = 50  # x BATCH = 10,000 inputs per decoder
MIN_INPUTS = 10_000

FUZZ = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# What a peer can send: raw bytes, msgpack of any shape, deep nesting, bad UTF-8 strings,
# near-valid envelopes and payloads, and valid frames with bytes flipped or cut.

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=24)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["type", "tp_rank", "engine_id", "remote_request_ids", "x"])
            | st.text(max_size=6),
            inner,
            max_size=4,
        )
    ),
    max_leaves=8,
)
_packed_values = _values.map(msgspec.msgpack.encode)


def _deep(depth: int, opener: bytes) -> bytes:
    return opener * depth + b"\x00"


_deep_nesting = st.builds(_deep, st.integers(1, 3_000), st.sampled_from([b"\x91", b"\x81\xa1k"]))
_bad_utf8_str = st.binary(min_size=1, max_size=16).map(
    lambda raw: b"\xd9" + bytes([len(raw) + 1]) + b"\xff" + raw
)
_payloads = st.one_of(
    _packed_values,
    _deep_nesting,
    st.binary(max_size=64),
    st.builds(
        lambda tag, rest: msgspec.msgpack.encode({"type": tag, **rest}),
        st.sampled_from(["hello", "handshake", "heartbeat", "release", "ack", "error", "nope"]),
        st.dictionaries(
            st.sampled_from(
                [
                    "tp_rank",
                    "engine_id",
                    "remote_request_ids",
                    "reason",
                    "num_known",
                    "code",
                    "handshake",
                ]
            ),
            _values,
            max_size=3,
        ),
    ),
    _bad_utf8_str.map(lambda s: b"\x82\xa4type\xa9heartbeat\xa9engine_id" + s),
)


def _envelope_dict(fields: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode({"protocol_version": PROTOCOL_VERSION, **fields})


_envelope_fields = st.fixed_dictionaries(
    {"payload": _payloads},
    optional={
        "nonce": st.binary(max_size=20),
        "timestamp_s": st.floats() | st.just(NOW_S),
        "mac": st.binary(max_size=40),
        "boot_id": st.text(max_size=40) | st.just(BOOT_ID),
        "protocol_version": _values,
        "extra": _values,
    },
)

_VALID_FRAMES = [
    encode_request(Hello(), secret=SECRET, nonce=b"n" * 16, timestamp_s=NOW_S),
    encode_request(HandshakeRequest(1), secret=None, nonce=b"", timestamp_s=0.0, boot_id=BOOT_ID),
    encode_request(
        Release(ENGINE_ID, ("r1", "r2")),
        secret=SECRET,
        nonce=b"m" * 16,
        timestamp_s=NOW_S,
        boot_id=BOOT_ID,
    ),
    encode_reply(HelloReply(ENGINE_ID, BOOT_ID), secret=SECRET, request_nonce=b"n" * 16),
    encode_reply(ErrorReply("no", code="stale_boot"), secret=None, request_nonce=b""),
]


@st.composite
def _mutated_frames(draw: st.DrawFn) -> bytes:
    frame = bytearray(draw(st.sampled_from(_VALID_FRAMES)))
    for _ in range(draw(st.integers(1, 4))):
        index = draw(st.integers(0, len(frame) - 1))
        frame[index] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(frame)))
    return bytes(frame[:cut]) if draw(st.booleans()) else bytes(frame)


@st.composite
def _signed_frames(draw: st.DrawFn) -> bytes:
    """Garbage payloads with a valid MAC, fresh timestamp and nonce: they get past auth."""
    payload = draw(_payloads)
    nonce = os.urandom(16)
    boot_id = draw(st.sampled_from([BOOT_ID, "", "other"]))
    mac = request_mac(SECRET, nonce, NOW_S, payload, boot_id)
    return msgspec.msgpack.encode(Envelope(PROTOCOL_VERSION, payload, nonce, NOW_S, mac, boot_id))


frames = st.one_of(
    st.binary(max_size=128),
    _packed_values,
    _deep_nesting,
    _envelope_fields.map(_envelope_dict),
    _mutated_frames(),
    _signed_frames(),
)


def _mutant(rnd: random.Random, base: bytes, other: bytes) -> bytes:
    """``base`` with bytes flipped, cut, inserted, repeated or spliced with ``other``."""
    data = bytearray(base)
    for _ in range(rnd.randint(1, 4)):
        kind = rnd.randrange(5)
        at = rnd.randint(0, len(data))
        if kind == 0 and data:
            data[min(at, len(data) - 1)] = rnd.randrange(256)
        elif kind == 1:
            del data[at:]
        elif kind == 2:
            data[at:at] = rnd.randbytes(rnd.randint(1, 8))
        elif kind == 3:
            data[at:at] = data[at : at + rnd.randint(1, 16)] * rnd.randint(1, 4)
        else:
            data[at:] = other[rnd.randint(0, len(other)) :]
    return bytes(data)


@st.composite
def _batches(draw: st.DrawFn, seeds: st.SearchStrategy[bytes]) -> list[bytes]:
    """NUM_SEEDS structured inputs and NUM_MUTANTS byte-level variants of each.

    Drawing every input structurally costs hypothesis milliseconds apiece; mutating a few
    drawn ones with a Random seeded by hypothesis keeps 10,000 inputs to well under a second
    per decoder, and a failure still replays from hypothesis's seed.
    """
    rnd = random.Random(draw(st.integers(0, 2**64 - 1)))  # drawing each call is 100x slower
    bases = draw(st.lists(seeds, min_size=NUM_SEEDS, max_size=NUM_SEEDS))
    batch = list(bases)
    for base in bases:
        batch += [_mutant(rnd, base, rnd.choice(bases)) for _ in range(NUM_MUTANTS)]
    return batch


def fuzz(strategy: st.SearchStrategy[bytes], check: Callable[[bytes], None]) -> int:
    """Run ``check`` on NUM_EXAMPLES x BATCH generated inputs; returns how many it saw."""
    seen = [0]

    @FUZZ
    @given(_batches(strategy))
    def run(batch: list[bytes]) -> None:
        for data in batch:
            check(data)
        seen[0] += len(batch)

    run()
    return seen[0]


def make_server(secret: str | None) -> SideChannelServer:
    """Never started: ``answer`` is called directly, no socket involved."""
    return SideChannelServer(
        "127.0.0.1",
        0,
        {0: make_handshake(0)},
        engine_id=ENGINE_ID,
        on_heartbeat=lambda ids: 0,
        on_release=lambda ids: 0,
        secret=secret,
        clock=lambda: NOW_S,
        boot_id=BOOT_ID,
        log_clock=lambda: 0.0,  # the whole run is inside one log interval
    )


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "with a secret"])
def test_the_server_answers_every_generated_frame_with_a_typed_reply(
    secret: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(secret)

    def check(frame: bytes) -> None:
        reply = decode_reply(server.answer([frame]), secret=secret, request_nonce=_nonce_of(frame))
        assert isinstance(reply, HelloReply | HandshakeReply | Ack | ErrorReply)

    with caplog.at_level(logging.DEBUG, logger="scheduler.side_channel"):
        assert fuzz(frames, check) >= MIN_INPUTS
    lines = [r for r in caplog.records if r.name == "scheduler.side_channel"]
    assert not [r for r in lines if r.exc_info or r.levelno >= logging.ERROR], "a decoder bug"
    assert len(lines) <= 8  # one per kind of refusal per interval, however many frames


def _nonce_of(frame: bytes) -> bytes:
    try:
        return decode_envelope(frame).nonce
    except ProtocolError:
        return b""


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "with a secret"])
def test_the_client_reply_decoder_returns_a_reply_or_protocol_error(secret: str | None) -> None:
    def check(frame: bytes) -> None:
        try:
            reply = decode_reply(frame, secret=secret, request_nonce=b"n" * 16)
        except ProtocolError:
            return
        assert isinstance(reply, HelloReply | HandshakeReply | Ack | ErrorReply)

    assert fuzz(frames, check) >= MIN_INPUTS


_notifications = st.one_of(
    st.binary(max_size=40),
    st.builds(
        lambda rid, sep, count: rid + sep + count,
        st.binary(max_size=12) | st.text(max_size=12).map(str.encode),
        st.sampled_from([b":", b"::", b"", b": "]),
        st.binary(max_size=6)
        | st.integers(-5, 10**12).map(lambda n: str(n).encode())
        | st.text("0123456789+-_ \u0663", max_size=10).map(str.encode),
    ),
)


def test_decode_free_notif_returns_an_id_and_count_or_invalid_notification() -> None:
    def check(msg: bytes) -> None:
        try:
            request_id, consumers = decode_free_notif(msg)
        except InvalidNotification:
            return
        id_bytes, _, count_bytes = msg.rpartition(b":")  # the oracle: the contract's own words
        assert request_id == id_bytes.decode() and request_id
        assert consumers == int(count_bytes) > 0 and count_bytes.isdigit()

    assert fuzz(_notifications, check) >= MIN_INPUTS


def test_the_authenticated_envelope_is_accepted_or_refused_with_protocol_error() -> None:
    auth = RequestAuthenticator(SECRET)
    accepted = [0]

    def check(frame: bytes) -> None:
        try:
            auth.check(decode_envelope(frame), NOW_S)
        except ProtocolError:
            return
        accepted[0] += 1

    assert fuzz(frames, check) >= MIN_INPUTS
    assert accepted[0] > 0  # the signed frames get through: the check is not refuse-all


def test_the_fuzz_inputs_include_what_used_to_escape() -> None:
    """The two untyped errors from the issue, pinned, whatever hypothesis draws."""
    deep = b"\x83" + _envelope_dict({"payload": b""})[1:] + b"\xa1x" + b"\x91" * 20_000 + b"\x00"
    bad_utf8 = _envelope_dict({"payload": b"\x82\xa4type\xa9heartbeat\xa9engine_id\xa2\xff\xfe"})
    server = make_server(None)
    started_s = time.perf_counter()
    for frame, message in [(deep, "nested too deeply"), (bad_utf8, "not valid UTF-8")]:
        reply = decode_reply(server.answer([frame]), secret=None, request_nonce=b"")
        assert isinstance(reply, ErrorReply) and message in reply.reason
    assert time.perf_counter() - started_s < 1.0


def test_the_notification_counter_survives_a_garbage_flood_with_a_short_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The free-notification path as a prefill rank runs it: typed errors become counters,
    and however many arrive, each kind is logged once per interval."""
    counter = NotificationCounter(clock=lambda: 0.0, early_ttl_s=5.0)
    counter.expect(["r1"])
    num_garbage = [0]

    def check(msg: bytes) -> None:
        try:
            decode_free_notif(msg)
        except InvalidNotification:
            num_garbage[0] += 1
        counter.receive({"decode-agent": [msg]})

    with caplog.at_level(logging.DEBUG, logger="worker.notifications"):
        assert fuzz(_notifications, check) >= MIN_INPUTS
    assert counter.stats.garbage == num_garbage[0] > 0
    lines = [r for r in caplog.records if r.name == "worker.notifications"]
    assert len(lines) <= 4, [r.getMessage() for r in lines]  # garbage, duplicate, stray, count
