"""A running side channel under a garbage flood: it keeps serving, promptly, and logs little.

Issue 11: one connection sending fuzzed frames flooded the log at ~1.7 MB/s (a line, often a
traceback, per frame) even with a secret set. Here one connection sends random bytes, frames
over the size bound, deep nesting, bad UTF-8, forged MACs, replays and stale boot ids to a
real server with a secret; then a valid handshake must succeed within a second and the log
must hold a handful of lines.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from connector.net.side_channel_client import fetch_handshake
from connector.protocol import (
    PROTOCOL_VERSION,
    Envelope,
    HandshakeRequest,
    Heartbeat,
    Hello,
    decode_reply,
    encode_request,
)
from scheduler.side_channel import SideChannelServer
from tests.test_protocol import make_handshake

HOST = "127.0.0.1"
SECRET = "correct horse battery staple"
ENGINE_ID = "prefill-0"  # make_handshake's engine
MAX_MESSAGE_BYTES = 2**20
NUM_ROUNDS = 60

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    server = SideChannelServer(
        HOST,
        0,
        {0: make_handshake(0)},
        engine_id=ENGINE_ID,
        on_heartbeat=lambda ids: 0,
        on_release=lambda ids: 0,
        secret=SECRET,
        max_message_bytes=MAX_MESSAGE_BYTES,
    )
    server.start()
    yield server
    server.stop()


def garbage_frames(server: SideChannelServer, rnd: random.Random) -> list[tuple[str, bytes]]:
    """One round of every kind of bad frame, as (kind, frame)."""
    now_s = time.time()
    envelope = msgspec.msgpack.encode({"protocol_version": PROTOCOL_VERSION, "payload": b""})
    signed = encode_request(
        Heartbeat(ENGINE_ID, ("r",)),
        secret=SECRET,
        nonce=os.urandom(16),
        timestamp_s=now_s,
        boot_id=server.boot_id,
    )
    forged = msgspec.msgpack.encode(
        Envelope(PROTOCOL_VERSION, msgspec.msgpack.encode(Hello()), b"n" * 16, now_s, b"m" * 32)
    )
    stale = encode_request(
        HandshakeRequest(0), secret=SECRET, nonce=os.urandom(16), timestamp_s=now_s, boot_id="0"
    )
    return [
        ("random bytes", rnd.randbytes(rnd.randint(1, 512))),
        ("deep nesting", b"\x83" + envelope[1:] + b"\xa1x" + b"\x91" * 50_000 + b"\x00"),
        ("bad utf-8", envelope.replace(b"payload", b"paylo\xff\xfe")),
        ("bad hmac", forged),
        ("signed", signed),
        ("replay", signed),
        ("stale boot id", stale),
        ("another version", msgspec.msgpack.encode({"protocol_version": 99, "payload": b""})),
    ]


def test_a_garbage_flood_leaves_the_server_prompt_and_the_log_short(
    server: SideChannelServer, caplog: pytest.LogCaptureFixture
) -> None:
    rnd = random.Random(11)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{HOST}:{server.port}")
    num_frames = 0
    try:
        with caplog.at_level(logging.DEBUG, logger="scheduler.side_channel"):
            for _ in range(NUM_ROUNDS):
                for _kind, frame in garbage_frames(server, rnd):
                    dealer.send(frame)
                    assert dealer.poll(5_000), "the server stopped answering"
                    decode_reply(dealer.recv(), secret=None, request_nonce=b"")  # typed reply
                    num_frames += 1
            oversized = b"\x00" * (MAX_MESSAGE_BYTES + 1)  # dropped: zmq closes that peer
            dealer.send(oversized)
    finally:
        dealer.close(linger=0)
    started_s = time.monotonic()
    assert fetch_handshake(HOST, server.port, 0, secret=SECRET, timeout_s=2.0) == make_handshake(0)
    assert time.monotonic() - started_s < 1.0
    assert server.num_refused == num_frames - NUM_ROUNDS  # all but the first "signed" of each
    lines = [r for r in caplog.records if r.name == "scheduler.side_channel"]
    assert 1 <= len(lines) <= 6, [r.getMessage() for r in lines]  # one per kind of refusal
    assert not [r for r in lines if r.exc_info], "a traceback in the log"
    assert sum(len(r.getMessage()) for r in lines) < 4_000  # bytes, for 480 refused frames
