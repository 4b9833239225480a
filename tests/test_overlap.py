"""Overlapped dispatch's parts without an engine: the params' rules, prefill's transfer board,
the side channel's parked AwaitLease, and decode's LeaseWaiter (docs/overlap.md)."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest

from connector.errors import InvalidTransferParams
from connector.metadata import FailureKind
from connector.net import side_channel_client as client
from connector.params import AwaitedLease, parse_kv_transfer_params
from connector.protocol import (
    ANNOUNCED_FAILED,
    ANNOUNCED_LEASED,
    ANNOUNCED_PARTIAL,
    ANNOUNCED_PENDING,
    AwaitLease,
)
from scheduler.lease_waiter import LeaseWaiter, Settled
from scheduler.side_channel import SideChannelServer
from scheduler.transfer_board import TransferBoard
from tests.test_protocol import make_handshake
from tests.test_side_channel import ENGINE_ID, HOST

DECODE_KEYS = {
    "do_remote_prefill": True,
    "transfer_key": "0f3c9a",
    "remote_engine_id": "prefill-0",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Released:
    def __init__(self) -> None:
        self.keys: list[str] = []

    def __call__(self, keys: tuple[str, ...]) -> int:
        self.keys.extend(keys)
        return len(keys)


# ---- params ------------------------------------------------------------------------------


def test_decode_params_with_a_transfer_key_await_that_lease() -> None:
    params = parse_kv_transfer_params(DECODE_KEYS)
    assert params is not None
    assert params.awaited_lease() == AwaitedLease("0f3c9a", "prefill-0", "127.0.0.1", 5600)


def test_without_an_engine_id_decode_awaits_whichever_engine_serves_the_side_channel() -> None:
    params = parse_kv_transfer_params({**DECODE_KEYS, "remote_engine_id": None})
    assert params is not None
    assert params.awaited_lease() == AwaitedLease("0f3c9a", None, "127.0.0.1", 5600)


def test_prefill_params_with_a_transfer_key_await_nothing() -> None:
    params = parse_kv_transfer_params({"do_remote_decode": True, "transfer_key": "k-1"})
    assert params is not None and params.transfer_key == "k-1"
    assert params.awaited_lease() is None


def test_sequential_params_await_nothing() -> None:
    params = parse_kv_transfer_params(
        {**DECODE_KEYS, "transfer_key": None, "remote_request_id": "r", "remote_block_ids": [1]}
    )
    assert params is not None and params.awaited_lease() is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**DECODE_KEYS, "transfer_key": "a b"}, "kv_transfer_params['transfer_key']: value 'a b'"),
        ({**DECODE_KEYS, "transfer_key": "k" * 65}, "kv_transfer_params['transfer_key']"),
        ({**DECODE_KEYS, "transfer_key": 7}, "expected 1..64 characters of [0-9A-Za-z_.-]"),
        ({**DECODE_KEYS, "remote_port": None}, "with transfer_key but remote_port missing"),
        (
            {**DECODE_KEYS, "remote_host": None, "remote_port": None},
            "with transfer_key but remote_host, remote_port missing",
        ),
        (
            {**DECODE_KEYS, "remote_lease_id": "l-1"},
            "transfer_key with remote_lease_id; decode learns the lease",
        ),
        (
            {**DECODE_KEYS, "remote_request_id": "r", "remote_block_ids": [[1]]},
            "transfer_key with remote_request_id, remote_block_ids",
        ),
        (
            {"transfer_key": "k-1"},
            "transfer_key is set but neither do_remote_decode nor do_remote_prefill is true",
        ),
    ],
    ids=[
        "key-with-a-space",
        "key-too-long",
        "key-not-a-string",
        "no-side-channel-port",
        "no-host-no-port",
        "key-and-a-lease-id",
        "key-and-prefills-blocks",
        "key-without-a-direction",
    ],
)
def test_malformed_overlapped_params_are_refused_naming_the_keys(raw: Any, message: str) -> None:
    with pytest.raises(InvalidTransferParams) as refused:
        parse_kv_transfer_params(raw)
    assert message in str(refused.value)


# ---- prefill's transfer board -------------------------------------------------------------


def _board(clock: Clock, released: Released, **kwargs: Any) -> TransferBoard:
    return TransferBoard(ttl_s=10.0, release=released, clock=clock, **kwargs)


def test_an_announced_lease_is_answered_and_a_cancel_releases_it_at_once() -> None:
    clock, released = Clock(), Released()
    board = _board(clock, released)
    assert board.status("k") is None
    assert board.announce("k", {"remote_request_id": "p"}, "p@l1")
    status = board.status("k")
    assert status is not None and status.status == ANNOUNCED_LEASED
    assert status.params == {"remote_request_id": "p"}
    assert board.cancel("k") == 1 and released.keys == ["p@l1"]
    assert board.cancel("k") == 0 and released.keys == ["p@l1"]  # once


def test_a_cancel_before_the_lease_releases_the_late_lease_at_once() -> None:
    clock, released = Clock(), Released()
    board = _board(clock, released)
    assert board.cancel("k") == 0
    assert board.is_cancelled("k")
    assert not board.announce("k", {"remote_request_id": "p"}, "p@l1")
    assert released.keys == ["p@l1"]
    status = board.status("k")
    assert status is not None and status.status == ANNOUNCED_FAILED


def test_a_failure_is_announced_with_its_reason() -> None:
    board = _board(Clock(), Released())
    board.fail("k", "prefill aborted")
    status = board.status("k")
    assert status is not None and (status.status, status.reason) == (
        ANNOUNCED_FAILED,
        "prefill aborted",
    )


def test_the_board_forgets_keys_after_their_ttl_and_past_its_size() -> None:
    clock, released = Clock(), Released()
    board = _board(clock, released, max_keys=2)
    board.cancel("a")
    clock.now += 5
    board.fail("b", "x")
    board.fail("c", "x")  # past max_keys: "a" goes
    assert len(board) == 2 and board.status("a") is None
    clock.now += 6  # "b" and "c" written 6 s ago, within 10 s
    assert board.status("b") is not None
    clock.now += 5
    assert board.status("b") is None and len(board) == 0


# ---- the side channel's parked AwaitLease --------------------------------------------------


@pytest.fixture
def served_board() -> Any:
    board = TransferBoard(ttl_s=30.0, release=Released(), clock=time.monotonic)
    server = SideChannelServer(
        HOST,
        0,
        {0: make_handshake(0)},
        engine_id=ENGINE_ID,
        on_heartbeat=lambda ids: 0,
        on_release=lambda ids: 0,
        transfers=board,
    )
    server.start()
    yield server, board
    server.stop()


def _await(server: SideChannelServer, key: str, hold_s: float) -> Any:
    boot_id = client.fetch_boot_id(HOST, server.port, engine_id=ENGINE_ID, secret=None, timeout_s=2)
    return client.await_lease(
        HOST, server.port, key, engine_id=ENGINE_ID, boot_id=boot_id, hold_s=hold_s,
        secret=None, timeout_s=2.0,
    )  # fmt: skip


def test_an_await_is_answered_as_soon_as_the_lease_is_announced(served_board: Any) -> None:
    server, board = served_board
    announce = threading.Timer(0.2, board.announce, ("k", {"remote_request_id": "p"}, "p@l"))
    started = time.monotonic()
    announce.start()
    reply = _await(server, "k", hold_s=5.0)
    waited_s = time.monotonic() - started
    assert reply.status == ANNOUNCED_LEASED and reply.params == {"remote_request_id": "p"}
    assert 0.2 <= waited_s < 1.0, waited_s  # woken by the board, not by the 5 s hold


def test_an_await_with_nothing_announced_is_pending_after_its_hold(served_board: Any) -> None:
    server, _ = served_board
    started = time.monotonic()
    reply = _await(server, "unknown", hold_s=0.3)
    assert reply.status == ANNOUNCED_PENDING
    assert 0.3 <= time.monotonic() - started < 1.5


def test_a_cancel_over_the_side_channel_ends_the_lease(served_board: Any) -> None:
    server, board = served_board
    board.announce("k", {"remote_request_id": "p"}, "p@l")
    ended = client.cancel_transfer(
        HOST, server.port, "k", engine_id=ENGINE_ID, secret=None, timeout_s=2
    )
    assert ended == 1 and board.is_cancelled("k")


# ---- decode's waiter ------------------------------------------------------------------------


def _settled(waiter: LeaseWaiter, timeout_s: float = 5.0) -> list[Settled]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if settled := waiter.take():
            return settled
        time.sleep(0.01)
    raise AssertionError("the wait did not settle")


def test_the_waiter_hands_over_the_announced_params(served_board: Any) -> None:
    server, board = served_board
    waiter = LeaseWaiter(timeout_s=5.0, call_timeout_s=1.0, secret=None)
    waiter.wait("d", AwaitedLease("k", None, HOST, server.port))
    board.announce("k", {"remote_request_id": "p"}, "p@l")
    (settled,) = _settled(waiter)
    assert (settled.request_id, settled.params, settled.failure, settled.engine_id) == (
        "d", {"remote_request_id": "p"}, None, ENGINE_ID,
    )  # fmt: skip


def test_the_waiter_fails_with_prefill_timeout_at_its_deadline(served_board: Any) -> None:
    server, _ = served_board
    waiter = LeaseWaiter(timeout_s=0.4, call_timeout_s=0.5, secret=None)
    started = time.monotonic()
    waiter.wait("d", AwaitedLease("never", ENGINE_ID, HOST, server.port))
    (settled,) = _settled(waiter)
    assert settled.failure is not None and settled.failure.kind is FailureKind.PREFILL_TIMEOUT
    assert "announced no lease for transfer_key 'never' within 0.4 s" in settled.failure.message
    assert time.monotonic() - started < 1.5


def test_the_waiter_refuses_waits_past_its_bound() -> None:
    waiter = LeaseWaiter(timeout_s=5.0, call_timeout_s=0.2, secret=None, max_waits=0)
    waiter.wait("d", AwaitedLease("k", ENGINE_ID, HOST, 9))
    (settled,) = waiter.take()
    assert settled.failure is not None and settled.failure.kind is FailureKind.PREFILL_TIMEOUT
    assert "0 loads already wait" in settled.failure.message


# ---- chunked pulls: partial announcements ---------------------------------------------------


def test_partials_are_seen_only_by_awaits_that_ask_and_a_cancel_releases_their_lease() -> None:
    clock, released = Clock(), Released()
    board = _board(clock, released)
    assert board.announce_partial("k", {"remote_num_tokens": 16}, "p@l1")
    assert board.status("k") is None  # an await for the final one only keeps waiting
    first = board.status("k", after_generation=0)
    assert first is not None and (first.status, first.generation) == (ANNOUNCED_PARTIAL, 1)
    assert board.status("k", after_generation=1) is None  # nothing newer yet
    assert board.announce_partial("k", {"remote_num_tokens": 32}, "p@l1")
    second = board.status("k", after_generation=1)
    assert second is not None and (second.generation, second.params) == (
        2,
        {"remote_num_tokens": 32},
    )
    assert board.cancel("k") == 1 and released.keys == ["p@l1"]
    assert not board.announce_partial("k", {"remote_num_tokens": 48}, "p@l1")  # cancelled


def test_the_final_announcement_after_partials_answers_every_await() -> None:
    board = _board(Clock(), Released())
    board.announce_partial("k", {"remote_num_tokens": 16}, "p@l1")
    board.announce("k", {"remote_num_tokens": 20}, "p@l1")
    for after in (None, 0, 5):
        status = board.status("k", after_generation=after)
        assert status is not None and status.status == ANNOUNCED_LEASED


def test_without_partials_the_wire_carries_no_new_field_for_an_older_peer() -> None:
    """An older peer decodes with forbid_unknown_fields: an AwaitLease that asks for no
    partial, and a final or failed announcement, must not carry the new fields."""
    old_await = msgspec.defstruct(
        "AwaitLease", [("engine_id", str), ("transfer_key", str), ("hold_ms", int, 1000),
                       ("reader", object, None)],
        tag="await_lease", forbid_unknown_fields=True,
    )  # fmt: skip
    msgspec.msgpack.decode(msgspec.msgpack.encode(AwaitLease("e", "k")), type=old_await)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode(AwaitLease("e", "k", after_generation=0)), type=old_await
        )
    board = _board(Clock(), Released())
    board.announce("k", {"remote_request_id": "p"}, "p@l1")
    assert b"generation" not in msgspec.msgpack.encode(board.status("k"))


def test_a_chunked_waiter_hands_over_each_partial_then_the_final(served_board: Any) -> None:
    server, board = served_board
    waiter = LeaseWaiter(timeout_s=5.0, call_timeout_s=1.0, secret=None, chunked=True)
    waiter.wait("d", AwaitedLease("k", None, HOST, server.port))
    board.announce_partial("k", {"remote_num_tokens": 16}, "p@l")
    (first,) = _settled(waiter)
    assert first.partial and first.params == {"remote_num_tokens": 16}
    board.announce("k", {"remote_num_tokens": 20}, "p@l")
    (final,) = _settled(waiter)
    assert not final.partial and final.params == {"remote_num_tokens": 20}
    assert waiter.num_waiting == 0
