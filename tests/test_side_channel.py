"""The side-channel server survives anything a peer sends, and the client's failures are bounded."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from connector.errors import HandshakeError, PeerRestarted, UnsupportedConfiguration
from connector.net.side_channel_client import (
    fetch_boot_id,
    fetch_handshake,
    send_heartbeat,
    send_release,
)
from connector.protocol import (
    PROTOCOL_VERSION,
    STALE_BOOT,
    Ack,
    ErrorReply,
    HandshakeRequest,
    Heartbeat,
    Release,
    Reply,
    Request,
    decode_reply,
    encode_request,
)
from scheduler.side_channel import (
    RECEIVE_HWM_MESSAGES,
    SEND_HWM_MESSAGES,
    TCP_RECEIVE_BUFFER_BYTES,
    SideChannelServer,
    router_socket,
)
from tests.test_protocol import make_handshake

HOST = "127.0.0.1"
ENGINE_ID = "prefill-0"  # make_handshake's engine
SECRET = "correct horse battery staple"
MAX_MESSAGE_BYTES = 2**16
TIMEOUT_S = 2.0
OPEN: dict[str, Any] = {"secret": None, "timeout_s": TIMEOUT_S}

pytestmark = pytest.mark.timeout(60)


class Leases:
    """Records the callbacks; raises when told to, to prove the server survives its own bugs."""

    def __init__(self) -> None:
        self.heartbeats: list[tuple[str, ...]] = []
        self.releases: list[tuple[str, ...]] = []
        self.fail = False

    def on_heartbeat(self, ids: tuple[str, ...]) -> int:
        if self.fail:
            raise RuntimeError("lease table exploded")
        self.heartbeats.append(ids)
        return len(ids)

    def on_release(self, ids: tuple[str, ...]) -> int:
        self.releases.append(ids)
        return 1


def start_server(
    leases: Leases, *, secret: str | None, port: int = 0, **kwargs: object
) -> SideChannelServer:
    server = SideChannelServer(
        HOST,
        port,
        {0: make_handshake(0), 1: make_handshake(1)},
        engine_id=ENGINE_ID,
        on_heartbeat=leases.on_heartbeat,
        on_release=leases.on_release,
        secret=secret,
        max_message_bytes=MAX_MESSAGE_BYTES,
        **kwargs,  # type: ignore[arg-type]
    )
    server.start()
    return server


def restart_on_port(start: Callable[[int], SideChannelServer], port: int) -> SideChannelServer:
    """``start(port)`` again right after a stop: zmq unbinds asynchronously after close, so
    the port can be busy for a moment; retry for up to 2 s (an engine restart is a new
    process, whose old sockets the kernel already closed)."""
    for _ in range(40):
        try:
            return start(port)
        except UnsupportedConfiguration:
            threading.Event().wait(0.05)
    return start(port)


@pytest.fixture
def leases() -> Leases:
    return Leases()


@pytest.fixture
def open_server(leases: Leases) -> Iterator[SideChannelServer]:
    server = start_server(leases, secret=None)
    yield server
    server.stop()


@pytest.fixture
def secret_server(leases: Leases) -> Iterator[SideChannelServer]:
    server = start_server(leases, secret=SECRET)
    yield server
    server.stop()


def assert_still_serving(server: SideChannelServer, secret: str | None = None) -> None:
    handshake = fetch_handshake(HOST, server.port, 1, secret=secret, timeout_s=TIMEOUT_S)
    assert handshake == make_handshake(1)


def raw_exchange(port: int, frames: list[bytes], *, timeout_s: float = TIMEOUT_S) -> bytes | None:
    """Send raw frames from a DEALER; return the reply's message frame, or None on timeout."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://{HOST}:{port}")
        dealer.send_multipart(frames)
        if not dealer.poll(int(timeout_s * 1000)):
            return None
        return dealer.recv_multipart()[-1]
    finally:
        dealer.close(linger=0)


def error_reason(frame: bytes | None) -> str:
    assert frame is not None, "the server did not answer"
    reply: Reply = decode_reply(frame, secret=None, request_nonce=b"")
    assert isinstance(reply, ErrorReply)
    return reply.reason


def envelope(payload: bytes, version: int = PROTOCOL_VERSION) -> bytes:
    return msgspec.msgpack.encode({"protocol_version": version, "payload": payload})


GARBAGE = [
    ("random bytes", [b"\x00\xffgarbage\x13\x37"], "not a nixl-pd side-channel message"),
    ("an empty frame", [b""], "expected one message frame, got 0"),
    ("three frames", [b"a", b"b", b"c"], "expected one message frame, got 3"),
    ("a msgpack integer", [msgspec.msgpack.encode(42)], "not a nixl-pd side-channel message"),
    (
        "a truncated request",
        [encode_request(HandshakeRequest(0), secret=None, nonce=b"", timestamp_s=0.0)[:-4]],
        "not a nixl-pd",
    ),
    ("another protocol version", [envelope(b"", version=PROTOCOL_VERSION + 1)], "protocol version"),
    ("a payload of garbage", [envelope(b"\xc1\xc1")], "malformed side-channel request"),
    (
        "a tp_rank of the wrong type",
        [envelope(msgspec.msgpack.encode({"type": "handshake", "tp_rank": [0]}))],
        "got `array`",
    ),
    (
        "an unknown request type",
        [envelope(msgspec.msgpack.encode({"type": "drop_tables"}))],
        "malformed side-channel request",
    ),
]


@pytest.mark.parametrize(
    ("frames", "message"), [c[1:] for c in GARBAGE], ids=[c[0] for c in GARBAGE]
)
def test_bad_input_gets_an_error_reply_and_the_server_keeps_serving(
    open_server: SideChannelServer, frames: list[bytes], message: str
) -> None:
    assert message in error_reason(raw_exchange(open_server.port, frames))
    assert_still_serving(open_server)


def test_an_oversized_message_is_dropped_and_the_server_keeps_serving(
    open_server: SideChannelServer,
) -> None:
    reply = raw_exchange(open_server.port, [b"x" * (MAX_MESSAGE_BYTES + 1)], timeout_s=0.5)
    assert reply is None  # zmq.MAXMSGSIZE disconnects the peer without reading the message
    assert_still_serving(open_server)


def test_raw_tcp_garbage_does_not_hurt_the_server(open_server: SideChannelServer) -> None:
    with socket.create_connection((HOST, open_server.port), timeout=TIMEOUT_S) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 4)
    assert_still_serving(open_server)


def test_the_router_bounds_what_one_peer_can_make_it_hold() -> None:
    """Issue 25: with zmq's defaults (1000 queued messages a peer, an autotuned kernel buffer)
    a garbage flood raised RSS by tens of MB that glibc then kept."""
    router = router_socket(zmq.Context.instance(), MAX_MESSAGE_BYTES)
    try:
        options = {name: router.getsockopt(getattr(zmq, name)) for name in BOUNDS}
    finally:
        router.close(linger=0)
    assert options == BOUNDS
    assert RECEIVE_HWM_MESSAGES <= 4 and SEND_HWM_MESSAGES <= 16  # zmq's default: 1000 each
    assert TCP_RECEIVE_BUFFER_BYTES <= 2**20


BOUNDS = {
    "MAXMSGSIZE": MAX_MESSAGE_BYTES,
    "RCVHWM": RECEIVE_HWM_MESSAGES,
    "SNDHWM": SEND_HWM_MESSAGES,
    "RCVBUF": TCP_RECEIVE_BUFFER_BYTES,
    "LINGER": 0,
}


def test_a_flood_from_many_peers_that_never_read_leaves_the_server_serving(
    open_server: SideChannelServer,
) -> None:
    """16 peers each push 40 frames just under the size bound (and one over it) as fast as
    zmq takes them, never reading a reply; a handshake is then still served."""
    frame, oversized = os.urandom(MAX_MESSAGE_BYTES - 64), b"x" * (MAX_MESSAGE_BYTES + 1)
    peers = []
    try:
        for _ in range(16):
            peer = zmq.Context.instance().socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(f"tcp://{HOST}:{open_server.port}")
            peers.append(peer)
        for _ in range(40):
            for peer in peers:
                with contextlib.suppress(zmq.Again):  # that peer's queue is full: skip it
                    peer.send(frame, zmq.NOBLOCK)
        for peer in peers:
            with contextlib.suppress(zmq.Again):
                peer.send(oversized, zmq.NOBLOCK)
        assert_still_serving(open_server)
    finally:
        for peer in peers:
            peer.close(linger=0)
    assert_still_serving(open_server)


def test_unknown_tp_rank_is_refused_with_the_served_ranks(open_server: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match="no tp_rank 5 here: this engine serves ranks 0, 1"):
        fetch_handshake(HOST, open_server.port, 5, secret=None, timeout_s=TIMEOUT_S)
    assert_still_serving(open_server)


def test_heartbeat_and_release_reach_the_lease_callbacks(
    open_server: SideChannelServer, leases: Leases
) -> None:
    port = open_server.port
    assert send_heartbeat(HOST, port, ["a", "b"], engine_id=ENGINE_ID, **OPEN) == 2
    assert send_release(HOST, port, ["c"], engine_id=ENGINE_ID, **OPEN) == 1
    assert leases.heartbeats == [("a", "b")]
    assert leases.releases == [("c",)]


@pytest.mark.parametrize(
    ("send", "kind"),
    [(send_heartbeat, "heartbeat"), (send_release, "release")],
    ids=["heartbeat", "release"],
)
@pytest.mark.parametrize(
    "engine_id",
    ["prefill-old", "prefill-0-restarted", "PREFILL-0"],
    ids=["an older engine", "a longer id", "another case"],
)
def test_a_message_for_another_engine_is_refused_and_touches_no_lease(
    open_server: SideChannelServer,
    leases: Leases,
    send: Callable[..., int],
    kind: str,
    engine_id: str,
) -> None:
    with pytest.raises(
        HandshakeError,
        match=f"refused the request: {kind} for prefill engine '{engine_id}' reached engine "
        f"'{ENGINE_ID}' at this host:port: that engine restarted .* nothing was extended or "
        "released here",
    ):
        send(HOST, open_server.port, ["a"], engine_id=engine_id, **OPEN)
    assert (leases.heartbeats, leases.releases) == ([], [])
    assert send(HOST, open_server.port, ["a"], engine_id=ENGINE_ID, **OPEN) == 1  # still serving


def test_a_server_without_an_engine_id_is_refused(leases: Leases) -> None:
    with pytest.raises(UnsupportedConfiguration, match="non-empty engine_id, got ''"):
        SideChannelServer(
            HOST,
            0,
            {},
            engine_id="",
            on_heartbeat=leases.on_heartbeat,
            on_release=leases.on_release,
        )


def test_a_failing_callback_is_an_error_reply_not_a_dead_thread(
    open_server: SideChannelServer, leases: Leases
) -> None:
    leases.fail = True
    with pytest.raises(HandshakeError, match="internal error: RuntimeError: lease table exploded"):
        send_heartbeat(HOST, open_server.port, ["a"], engine_id=ENGINE_ID, **OPEN)
    assert_still_serving(open_server)


def test_with_a_secret_the_right_secret_is_served(secret_server: SideChannelServer) -> None:
    assert_still_serving(secret_server, SECRET)


@pytest.mark.parametrize(
    ("client_secret", "message"),
    [
        (None, "authentication required"),
        ("wrong secret, same length!!!", "wrong side_channel_secret"),
    ],
    ids=["missing secret", "wrong secret"],
)
def test_with_a_secret_other_clients_are_refused(
    secret_server: SideChannelServer, client_secret: str | None, message: str
) -> None:
    with pytest.raises(HandshakeError, match=message):
        fetch_handshake(HOST, secret_server.port, 0, secret=client_secret, timeout_s=TIMEOUT_S)
    assert_still_serving(secret_server, SECRET)


def test_a_client_with_a_secret_refuses_an_open_server(open_server: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match="reply failed authentication"):
        fetch_handshake(HOST, open_server.port, 0, secret=SECRET, timeout_s=TIMEOUT_S)


def test_a_replayed_request_is_refused(secret_server: SideChannelServer) -> None:
    frame = encode_request(
        Heartbeat(ENGINE_ID, ("r",)),
        secret=SECRET,
        nonce=b"n" * 16,
        timestamp_s=time.time(),
        boot_id=secret_server.boot_id,
    )
    first = decode_reply(
        raw_exchange(secret_server.port, [frame]) or b"", secret=SECRET, request_nonce=b"n" * 16
    )
    assert not isinstance(first, ErrorReply)
    second = decode_reply(
        raw_exchange(secret_server.port, [frame]) or b"", secret=SECRET, request_nonce=b"n" * 16
    )
    assert isinstance(second, ErrorReply) and "replayed" in second.reason
    assert_still_serving(secret_server, SECRET)


def test_a_request_outside_the_replay_window_is_refused(leases: Leases) -> None:
    server = start_server(leases, secret=SECRET, clock=lambda: time.time() + 3600.0)
    try:
        with pytest.raises(HandshakeError, match="timestamp is -36.* s from this server's clock"):
            fetch_handshake(HOST, server.port, 0, secret=SECRET, timeout_s=TIMEOUT_S)
    finally:
        server.stop()


def test_port_in_use_names_host_port_and_what_to_do(open_server: SideChannelServer) -> None:
    with pytest.raises(
        UnsupportedConfiguration,
        match=f"cannot bind {HOST}:{open_server.port}.*VLLM_NIXL_SIDE_CHANNEL_PORT",
    ):
        start_server(Leases(), secret=None, port=open_server.port)
    assert_still_serving(open_server)


def test_fetch_handshake_against_a_dead_port_is_bounded() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago and has no listener
        probe.bind((HOST, 0))
        dead_port = probe.getsockname()[1]
    started_s = time.monotonic()
    with pytest.raises(HandshakeError, match=f"{HOST}:{dead_port} did not answer within 0.3 s"):
        fetch_handshake(HOST, dead_port, 0, secret=None, timeout_s=0.3)
    assert time.monotonic() - started_s < 2.0


def test_a_reply_larger_than_the_client_limit_times_out(open_server: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match="larger than max_message_bytes=16"):
        fetch_handshake(HOST, open_server.port, 0, secret=None, timeout_s=0.3, max_message_bytes=16)


def test_stop_joins_the_thread_and_frees_the_port(leases: Leases) -> None:
    server = start_server(leases, secret=None)
    port = server.port
    server.stop()
    assert not [t for t in threading.enumerate() if t.name == f"nixl-pd-side-channel-{port}"]
    again = restart_on_port(lambda port: start_server(leases, secret=None, port=port), port)
    again.stop()


def signed_exchange(server: SideChannelServer, request: Request, *, boot_id: str) -> Reply:
    """One signed request, as a client that already learned ``boot_id`` would send it."""
    nonce = os.urandom(16)
    frame = encode_request(
        request, secret=SECRET, nonce=nonce, timestamp_s=time.time(), boot_id=boot_id
    )
    return decode_reply(
        raw_exchange(server.port, [frame]) or b"", secret=SECRET, request_nonce=nonce
    )


def test_a_release_captured_before_a_restart_is_refused_by_the_restarted_engine(
    leases: Leases,
) -> None:
    """Issue 11: a captured Release replayed 17 s later against a prefill restarted with the
    same engine id and port freed a new lease's blocks (the nonce table died with the process)."""
    before = start_server(leases, secret=SECRET)
    port = before.port
    nonce = os.urandom(16)
    captured = encode_request(
        Release(ENGINE_ID, ("r1",)),
        secret=SECRET,
        nonce=nonce,
        timestamp_s=time.time(),
        boot_id=fetch_boot_id(HOST, port, engine_id=ENGINE_ID, secret=SECRET, timeout_s=TIMEOUT_S),
    )
    assert decode_reply(
        raw_exchange(port, [captured]) or b"", secret=SECRET, request_nonce=nonce
    ) == Ack(1)
    before.stop()
    # Same engine id, same port.
    after = restart_on_port(lambda port: start_server(leases, secret=SECRET, port=port), port)
    try:
        replayed = decode_reply(
            raw_exchange(port, [captured]) or b"", secret=SECRET, request_nonce=nonce
        )
        assert isinstance(replayed, ErrorReply) and replayed.code == STALE_BOOT
        assert "the engine restarted since the sender learned its boot id" in replayed.reason
        assert leases.releases == [("r1",)]  # only the original: the replay freed nothing
        assert after.boot_id != before.boot_id
        assert_still_serving(after, SECRET)
    finally:
        after.stop()


STALE_REQUESTS = [
    pytest.param(Release(ENGINE_ID, ("r1",)), id="release"),
    pytest.param(Heartbeat(ENGINE_ID, ("r1",)), id="heartbeat"),
    pytest.param(HandshakeRequest(0), id="handshake"),
]


@pytest.mark.parametrize("request_msg", STALE_REQUESTS)
@pytest.mark.parametrize("boot_id", ["", "0" * 32], ids=["no boot id", "another boot id"])
def test_a_request_for_another_boot_is_refused_and_touches_nothing(
    secret_server: SideChannelServer, leases: Leases, request_msg: Request, boot_id: str
) -> None:
    reply = signed_exchange(secret_server, request_msg, boot_id=boot_id)
    assert isinstance(reply, ErrorReply) and reply.code == STALE_BOOT
    assert f"names side-channel boot {boot_id!r} but engine 'prefill-0'" in reply.reason
    assert (leases.heartbeats, leases.releases) == ([], [])
    assert secret_server.num_refused == 1


@pytest.mark.parametrize("send", [send_heartbeat, send_release], ids=["heartbeat", "release"])
def test_the_client_raises_peer_restarted_for_a_stale_boot_id(
    open_server: SideChannelServer, send: Callable[..., int]
) -> None:
    with pytest.raises(PeerRestarted, match="the engine restarted since the sender learned"):
        send(HOST, open_server.port, ["a"], engine_id=ENGINE_ID, boot_id="0" * 32, **OPEN)
    assert send(HOST, open_server.port, ["a"], engine_id=ENGINE_ID, **OPEN) == 1  # asks Hello


def test_hello_names_the_engine_and_its_boot(open_server: SideChannelServer) -> None:
    boot_id = fetch_boot_id(HOST, open_server.port, engine_id=ENGINE_ID, **OPEN)
    assert boot_id == open_server.boot_id and len(boot_id) == 32
    with pytest.raises(HandshakeError, match="is engine 'prefill-0', not 'prefill-1'"):
        fetch_boot_id(HOST, open_server.port, engine_id="prefill-1", **OPEN)


def test_refusals_are_logged_once_per_kind_per_interval(
    open_server: SideChannelServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 11: every refused frame logged a line (a traceback for RecursionError and
    UnicodeDecodeError), so one connection flooded the log at ~1.7 MB/s."""
    # An unknown field nested 60,000 deep: msgspec raises RecursionError skipping it.
    deep = b"\x83" + envelope(b"")[1:] + b"\xa1x" + b"\x91" * 60_000 + b"\x00"
    bad_utf8 = envelope(msgspec.msgpack.encode({"type": "release", "engine_id": "\xff"}))
    bad_utf8 = bad_utf8.replace("\xff".encode(), b"\xff\xfe")  # UnicodeDecodeError
    with caplog.at_level(logging.DEBUG, logger="scheduler.side_channel"):
        cases = [(b"garbage", "not a nixl-pd"), (deep, "too deeply"), (bad_utf8, "not valid UTF-8")]
        for frame, message in cases * 100:
            assert message in error_reason(raw_exchange(open_server.port, [frame]))
    assert open_server.num_refused == 300
    lines = [r for r in caplog.records if r.name == "scheduler.side_channel"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "side channel refused a request (malformed)" in lines[0].getMessage()
    assert not any(r.exc_info for r in lines)


def test_a_slow_answer_is_logged_with_the_time_it_took(caplog: pytest.LogCaptureFixture) -> None:
    """A turn of the serving loop that took 5 s or more is logged: peers waited that long."""
    now_s = [100.0]
    leases = Leases()

    def slow_heartbeat(ids: tuple[str, ...]) -> int:
        now_s[0] += 6.0  # the callback waited 6 s (on the lease table's lock, say)
        return len(ids)

    leases.on_heartbeat = slow_heartbeat  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="scheduler.side_channel"):
        server = start_server(leases, secret=None, log_clock=lambda: now_s[0])
        try:
            assert send_heartbeat(HOST, server.port, ["a"], engine_id=ENGINE_ID, **OPEN) == 1
            for _ in range(200):  # the line follows the reply, on the server's thread
                slow = [r.getMessage() for r in caplog.records if "one turn" in r.getMessage()]
                if slow:
                    break
                threading.Event().wait(0.01)
        finally:
            server.stop()

    assert slow == [
        f"side channel of engine {ENGINE_ID}: one turn of its loop took 6.0 s, 6.0 s of it "
        "answering a request (the rest: the 50 ms poll returned late, so this thread waited "
        "for the CPU or the GIL); peers' handshakes and lease checks waited as long"
    ]


PAUSED_CLIENT = """
import sys
from connector.net.side_channel_client import send_heartbeat
known = send_heartbeat(
    "127.0.0.1", int(sys.argv[1]), ["a"], engine_id=sys.argv[2], secret=None, timeout_s=1.0
)
print("known", known, flush=True)
"""


def test_a_client_stopped_past_its_timeout_still_reads_the_reply_that_came_meanwhile(
    leases: Leases,
) -> None:
    # Drill b in CI: decode was SIGSTOPped while its lease check waited; prefill answered
    # during the pause, and the woken check reported a 10 s silence that was its own.
    entered, answer = threading.Event(), threading.Event()

    def on_heartbeat(ids: tuple[str, ...]) -> int:
        entered.set()  # the client has sent and now waits for the reply
        answer.wait(10.0)
        return len(ids)

    leases.on_heartbeat = on_heartbeat  # type: ignore[method-assign]
    server = start_server(leases, secret=None)
    child = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CLIENT, str(server.port), ENGINE_ID],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert entered.wait(20.0), "the client never sent its heartbeat"
        child.send_signal(signal.SIGSTOP)
        answer.set()  # the reply arrives while the client is stopped
        time.sleep(2.0)  # twice the client's timeout
        child.send_signal(signal.SIGCONT)
        out, err = child.communicate(timeout=20.0)
    finally:
        child.kill()
        server.stop()
    assert child.returncode == 0, err
    assert out.strip() == "known 1"


# --- connections kept per thread -------------------------------------------------------------


def established_to(port: int) -> int:
    """This host's ESTABLISHED TCP connections whose far end is 127.0.0.1:``port`` (the
    client's sockets allow IPv6, so they may be v4-mapped IPv6 ones)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            remote, state = line.split()[2:4]
            if state == "01" and remote.endswith(f"0100007F:{port:04X}"):
                count += 1
    return count


def test_a_thread_keeps_one_connection_per_side_channel(open_server: SideChannelServer) -> None:
    for _ in range(5):
        assert_still_serving(open_server)
    assert established_to(open_server.port) == 1
    seen_by_other: list[int] = []

    def other_thread() -> None:
        assert_still_serving(open_server)
        seen_by_other.append(established_to(open_server.port))

    other = threading.Thread(target=other_thread)
    other.start()
    other.join(timeout=10.0)
    assert seen_by_other == [2]  # each thread its own connection; the first one's is kept
    assert_still_serving(open_server)
    gc.collect()  # a thread's sockets close when it ends
    assert established_to(open_server.port) == 1


class SlowLeases(Leases):
    """Heartbeats wait for ``release``: the server answers them late."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()
        self.release = threading.Event()

    def on_heartbeat(self, ids: tuple[str, ...]) -> int:
        self.waiting.set()
        self.release.wait(5.0)
        return len(ids)


def test_after_a_timeout_the_next_exchange_gets_its_own_answer() -> None:
    """The socket that timed out is closed: the reply that comes late for it can never be
    read as the answer to the next request, which goes on a fresh connection."""
    slow = SlowLeases()
    server = start_server(slow, secret=None)
    try:
        with pytest.raises(HandshakeError, match="did not answer within 0.3 s"):
            send_heartbeat(HOST, server.port, ["r1"], engine_id=ENGINE_ID, secret=None,
                           timeout_s=0.3, boot_id=server.boot_id)  # fmt: skip
        assert slow.waiting.is_set()
        slow.release.set()  # the late Ack goes to the closed socket
        assert fetch_boot_id(HOST, server.port, engine_id=ENGINE_ID, **OPEN) == server.boot_id
        assert established_to(server.port) == 1  # the timed-out connection is gone
    finally:
        server.stop()


def test_a_kept_connection_reaches_a_side_channel_restarted_on_its_port(leases: Leases) -> None:
    first = start_server(leases, secret=None)
    port, first_boot = first.port, first.boot_id
    assert fetch_boot_id(HOST, port, engine_id=ENGINE_ID, **OPEN) == first_boot
    first.stop()
    second = restart_on_port(lambda p: start_server(leases, secret=None, port=p), port)
    try:
        boot_id = fetch_boot_id(HOST, port, engine_id=ENGINE_ID, **OPEN)
        assert boot_id == second.boot_id != first_boot
    finally:
        second.stop()
