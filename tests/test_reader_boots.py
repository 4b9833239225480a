"""A reader restarted under its engine id: the holder ends the leases only its earlier boot
claimed, at the new boot's first message, instead of holding the blocks until the lease TTL.

Unit level: the lease table's claims and retirements (scheduler/readers.py), and the side
channel reporting who sent a message. End to end on the example engine (FakeNixl, in
process, an injected clock that never reaches the TTL): decode boot 1 (TP 1, or TP 2: two
ranks read each lease, and prefill waits for both) reads under a prefill lease and dies
mid-load; decode boot 2, same engine id, serves another request, and prefill
frees boot 1's lease at once, leaving a never-claimed lease and one another reader also
claimed alone. The prefill-restart analogue is tests/test_e2e_two_boots.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from connector.config import ConnectorConfig
from connector.metrics import LEASES_READER_RESTARTED, default_recorder
from connector.protocol import (
    Heartbeat,
    LeaseCheck,
    LeaseRef,
    ReaderId,
    Release,
    Request,
    encode_request,
    lease_key,
)
from connector.side_channel_client import check_leases
from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from scheduler.heartbeats import HeartbeatSender
from scheduler.leases import LeaseTable
from scheduler.side_channel import SideChannelServer
from worker.fake import FakeFabric, FakeNixl, FakeRead
from worker.nixl_api import TransferState

OLD, NEW = ReaderId("decode-0", "a" * 32), ReaderId("decode-0", "b" * 32)
OTHER = ReaderId("decode-1", "c" * 32)


def _table(*request_ids: str) -> LeaseTable:
    table = LeaseTable(100.0)
    for request_id in request_ids:
        table.lease(request_id, 0.0, f"L{request_id}")
    return table


def _key(request_id: str) -> str:
    return lease_key(request_id, f"L{request_id}")


def test_a_new_boot_ends_the_leases_only_the_earlier_boot_claimed() -> None:
    table = _table("mine", "shared", "unclaimed", "renamed")
    assert table.seen(OLD, [_key("mine"), _key("shared"), _key("renamed")]) == 0
    assert table.seen(OTHER, [_key("shared")]) == 0
    # The new boot's first message names "renamed" (it got those params too): it keeps it.
    assert table.seen(NEW, [_key("renamed")]) == 1
    assert table.take_reader_restarted() == ("mine",)
    assert table.take_reader_restarted() == ()
    assert ("mine" in table, "shared" in table, "unclaimed" in table, "renamed" in table) == (
        False,
        True,
        True,
        True,
    )
    assert table.held([("mine", "Lmine")], 1.0) == (False,)


def test_a_late_message_from_the_retired_boot_claims_and_ends_nothing() -> None:
    table = _table("a", "b")
    table.seen(OLD, [_key("a")])
    table.seen(NEW, [_key("b")])
    assert table.take_reader_restarted() == ("a",)
    table.lease("c", 0.0, "Lc")
    assert table.seen(OLD, [_key("c")]) == 0  # late: never current again
    assert table.seen(NEW, []) == 0  # so NEW is no new boot, and "b" and "c" stay
    assert ("b" in table, "c" in table) == (True, True)


def test_the_same_boot_again_or_an_ended_lease_changes_nothing() -> None:
    table = _table("a", "b")
    table.seen(OLD, [_key("a"), _key("b")])
    assert table.seen(OLD, [_key("a")]) == 0
    table.complete("b")  # every rank notified: its claims are forgotten with it
    table.seen(OLD, [_key("ended-long-ago"), _key("b")])  # names no held lease: no claim
    assert table.seen(NEW, []) == 1
    assert table.take_reader_restarted() == ("a",)


# ---- the side channel reports who sent a message ----------------------------------------


class _Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[ReaderId, tuple[str, ...]]] = []

    def __call__(self, reader: ReaderId, names: tuple[str, ...]) -> int:
        self.calls.append((reader, names))
        return 0


READER_CASES: dict[str, tuple[Request, tuple[str, ...] | None]] = {
    "lease-check-names-the-held-refs": (
        LeaseCheck("p", (LeaseRef("held", "Lheld"), LeaseRef("gone", "L")), NEW),
        (lease_key("held", "Lheld"),),
    ),
    "heartbeat-names-its-ids": (Heartbeat("p", ("x@L",), NEW), ("x@L",)),
    "release-names-its-ids": (Release("p", ("x@L",), NEW), ("x@L",)),
    "an-older-peer-names-no-reader": (Heartbeat("p", ("x@L",)), None),
}


@pytest.mark.parametrize("request_, names", READER_CASES.values(), ids=READER_CASES)
def test_the_side_channel_tells_the_holder_who_sent_a_message(
    request_: Request, names: tuple[str, ...] | None
) -> None:
    seen = _Seen()
    server = SideChannelServer(
        "127.0.0.1",
        0,
        {},
        engine_id="p",
        on_heartbeat=len,
        on_release=len,
        on_lease_check=lambda refs: _table("held").check(refs, 1.0),
        on_reader=seen,
        boot_id="boot",
    )
    server.answer(
        [encode_request(request_, secret=None, nonce=b"", timestamp_s=0.0, boot_id="boot")]
    )
    assert seen.calls == ([] if names is None else [(NEW, names)])


def test_heartbeats_and_releases_name_their_reader_over_the_network() -> None:
    class Recorded(_Seen):
        def __init__(self) -> None:
            super().__init__()
            self.arrived = threading.Event()

        def __call__(self, reader: ReaderId, names: tuple[str, ...]) -> int:
            super().__call__(reader, names)
            if len(self.calls) == 2:
                self.arrived.set()
            return 0

    seen = Recorded()
    server = SideChannelServer(
        "127.0.0.1", 0, {}, engine_id="p", on_heartbeat=len, on_release=len, on_reader=seen
    )
    server.start()
    sender = HeartbeatSender(secret=None, timeout_s=2.0, reader=NEW)
    try:
        address = ("127.0.0.1", server.port)
        sender.submit(*address, ["h@L"], engine_id="p", boot_id=server.boot_id)
        sender.submit_release(*address, ["r@L"], engine_id="p", boot_id=server.boot_id)
        assert seen.arrived.wait(10.0)
    finally:
        sender.stop()
        server.stop()
    assert seen.calls == [(NEW, ("h@L",)), (NEW, ("r@L",))]


# ---- end to end: decode boot 1 dies mid-load, boot 2 serves ------------------------------


class CountingNixl(FakeNixl):
    """FakeNixl that records the READs it posts (given a list), which then never land."""

    def __init__(self, name: str, fabric: FakeFabric, posted: list[str] | None) -> None:
        super().__init__(name, fabric)
        self._posted = [] if posted is None else posted
        if posted is not None:
            self.faults.stall_polls = 10**9  # its READs never land (the process dies first)

    def post(self, transfer: FakeRead) -> TransferState:
        self._posted.append(self.name)
        return super().post(transfer)


class _Clock:
    now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _engine(
    role: str,
    engine_id: str,
    fabric: FakeFabric,
    clock: _Clock,
    posted: list[str] | None = None,
    tp_size: int = 1,
) -> Engine:
    config = ConnectorConfig(side_channel_port=0, kv_lease_duration_s=30.0, handshake_timeout_s=5.0)
    return Engine(
        EngineConfig(engine_id, role=role, num_blocks=64, tp_size=tp_size),
        connector_config=config,
        clock=clock,
        agent_factory=lambda name: CountingNixl(name, fabric, posted),
    )


def _run(engines: tuple[Engine, ...], request_id: str) -> RequestOutput:
    for _ in range(20_000):
        for engine in engines:
            for output in engine.step():
                if output.request_id == request_id:
                    return output
    raise AssertionError(f"{request_id} unfinished")


def _prefill(prefill: Engine, request_id: str, prompt: list[int]) -> dict[str, Any]:
    prefill.add_request(EngineRequest(request_id, prompt, 1, {"do_remote_decode": True}))
    first = _run((prefill,), request_id)
    assert first.error is None and first.kv_transfer_params is not None
    return first.kv_transfer_params


def _prompt(seed: int) -> list[int]:
    return [(seed * 7 + t * 3) % 64 for t in range(32)]


def _restarted() -> int:
    return sum(
        default_recorder().snapshot().counters.get(LEASES_READER_RESTARTED.name, {}).values()
    )


@pytest.mark.parametrize(
    "decode_tp", [1, 2], ids=["decode-tp1", "decode-tp2-two-readers-per-lease"]
)
def test_a_decode_restarted_under_its_engine_id_frees_what_its_old_boot_claimed(
    decode_tp: int,
) -> None:
    fabric, clock = FakeFabric(), _Clock()
    prefill = _engine("prefill", "prefill-rb", fabric, clock)
    posted: list[str] = []
    boot1 = _engine("decode", "decode-pinned", fabric, clock, posted, decode_tp)
    boot2: Engine | None = None
    try:
        params = {name: _prefill(prefill, name, _prompt(seed)) for seed, name in enumerate("abcd")}
        # Boot 1 loads "a" and dies with its READ in flight: its lease check claimed "a".
        boot1.add_request(EngineRequest("da", [*_prompt(0), 1], 2, params["a"]))
        for _ in range(2000):
            boot1.step()
            if posted:
                break
        else:
            raise AssertionError("boot 1 never posted its READ")
        boot1.shutdown()
        # Another reader engine claims "c" too; "b" is claimed by nobody.
        c = params["c"]
        held = check_leases(
            c["remote_host"],
            c["remote_port"],
            [LeaseRef("c", c["remote_lease_id"])],
            engine_id="prefill-rb",
            boot_id=c["remote_boot_id"],
            secret=None,
            timeout_s=5.0,
            reader=OTHER,
        )
        assert held == (True,)
        assert set(prefill.held) == {"a", "b", "c", "d"}
        before = _restarted()
        # Boot 2 (same engine id, a new process boot) serves "d": its first check names it.
        boot2 = _engine("decode", "decode-pinned", fabric, clock, tp_size=decode_tp)
        boot2.add_request(EngineRequest("dd", [*_prompt(3), 1], 2, params["d"]))
        done = _run((prefill, boot2), "dd")
        assert done.error is None and done.num_external_tokens == 32
        for _ in range(100):
            prefill.step()
        assert set(prefill.held) == {"b", "c"}  # "a" freed long before its 30 s lease
        assert _restarted() - before == 1
    finally:
        prefill.shutdown()
        boot1.shutdown()
        if boot2 is not None:
            boot2.shutdown()
