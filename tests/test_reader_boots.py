"""A reader restarted under its engine id: the holder ends the leases only its earlier boot
claimed, at the new boot's first message, instead of holding the blocks until the lease TTL.

Unit level: the lease table's claims and retirements (scheduler/readers.py), and the side
channel reporting who sent a message. End to end on the example engine (FakeNixl, in
process, an injected clock that never reaches the TTL): decode boot 1 (TP 1, or TP 2: two
ranks read each lease, and prefill waits for both) checks its lease on every rank, as its
scheduler side and ranks do before any READ, and dies; decode boot 2, same engine id, serves another request, and prefill
frees boot 1's lease at once, leaving a never-claimed lease and one another reader also
claimed alone. The prefill-restart analogue is tests/test_e2e_two_boots.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from connector.config import ConnectorConfig
from connector.lease_binding import block_digest, token_digest
from connector.metadata import SideChannelBoot
from connector.net.side_channel_client import check_leases_status
from connector.observability.metrics import LEASES_READER_RESTARTED, default_recorder
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
from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from scheduler.connector import RequestInfo, Role, SchedulerConnector
from scheduler.heartbeats import HeartbeatSender
from scheduler.leases import LeaseTable
from scheduler.side_channel import SideChannelServer
from worker.fake import FakeFabric, FakeNixl
from worker.lease_proof import SilentSideChannels, side_channel_batch_check
from worker.loads import checked_source

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
        prefill = SideChannelBoot("p", "127.0.0.1", server.port, server.boot_id)
        sender.submit(prefill, ["h@L"])
        sender.submit_release(prefill, ["r@L"])
        assert seen.arrived.wait(10.0)
    finally:
        sender.stop()
        server.stop()
    assert seen.calls == [(NEW, ("h@L",)), (NEW, ("r@L",))]


# ---- end to end: decode boot 1 dies mid-load, boot 2 serves ------------------------------


class _Clock:
    now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _engine(
    role: str,
    engine_id: str,
    fabric: FakeFabric,
    clock: _Clock,
    *,
    tp_size: int = 1,
    bidirectional: bool = False,
) -> Engine:
    config = ConnectorConfig(
        side_channel_port=0,
        kv_lease_duration_s=30.0,
        handshake_timeout_s=5.0,
        bidirectional_kv_xfer=bidirectional,
        kv_recompute_threshold=8,
    )

    return Engine(
        EngineConfig(engine_id, role=role, num_blocks=64, tp_size=tp_size),
        connector_config=config,
        clock=clock,
        agent_factory=lambda name: FakeNixl(name, fabric),
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


def _held_becomes(engine: Engine, expected: set[str], timeout_s: float = 10.0) -> bool:
    """Step ``engine`` until it holds exactly ``expected`` (notifications arrive on its
    transfer thread); bounded by ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        engine.step()
        if set(engine.held) == expected:
            return True
    return False


def _claim_as_ranks(boot: SchedulerConnector, info: RequestInfo, num_ranks: int) -> None:
    """What a reader boot's ranks do first with a load: its LeaseCheck before any READ (the
    scheduler names this boot in the LoadSpec; the ranks send the real check). The boot then
    dies before reading: nothing frees the lease but its holder."""
    num_tokens, loads = boot.get_num_new_matched_tokens(info, 0)
    assert loads and num_tokens > 0
    block_ids = (tuple(range(10, 10 + -(-num_tokens // 16))),)
    boot.update_state_after_alloc(info, block_ids, num_tokens)
    (spec,) = boot.build_connector_meta().loads
    assert spec.source.reader == boot.reader
    config = ConnectorConfig(handshake_timeout_s=5.0)
    check = side_channel_batch_check(config, SilentSideChannels(5.0))
    for _ in range(num_ranks):
        assert check([checked_source(spec)], False) == [True]  # as the transfer thread binds
    boot.shutdown()


def _boot(engine_id: str, like: Engine, tp_size: int, **config: Any) -> SchedulerConnector:
    """A reader engine's scheduler side, as a restarted process starts it: a new boot."""
    return SchedulerConnector(
        ConnectorConfig(side_channel_port=0, **config),
        engine_id=engine_id,
        role=Role.BOTH,
        spec=like.spec,
        tp_size=tp_size,
    )


@pytest.mark.parametrize(
    "decode_tp", [1, 2], ids=["decode-tp1", "decode-tp2-two-readers-per-lease"]
)
def test_a_decode_restarted_under_its_engine_id_frees_what_its_old_boot_claimed(
    decode_tp: int,
) -> None:
    fabric, clock = FakeFabric(), _Clock()
    prefill = _engine("prefill", "prefill-rb", fabric, clock)
    boot2: Engine | None = None
    try:
        params = {name: _prefill(prefill, name, _prompt(seed)) for seed, name in enumerate("abcd")}
        # Boot 1 checks its lease of "a" on every rank, then dies before reading.
        boot1 = _boot("decode-pinned", prefill, decode_tp)
        _claim_as_ranks(boot1, RequestInfo("da", 32, params["a"], token_ids=_prompt(0)), decode_tp)
        # Another reader engine claims "c" too; "b" is claimed by nobody.
        c = params["c"]
        held = check_leases_status(
            c["remote_host"],
            c["remote_port"],
            [
                LeaseRef(
                    "c",
                    c["remote_lease_id"],
                    (),
                    token_digest(_prompt(2), 32),
                    block_digest(c["remote_block_ids"], 32),
                )
            ],
            engine_id="prefill-rb",
            boot_id=c["remote_boot_id"],
            secret=None,
            timeout_s=5.0,
            reader=OTHER,
        ).held
        assert held == (True,)
        for _ in range(20):
            prefill.step()
        assert set(prefill.held) == {"a", "b", "c", "d"}
        before = _restarted()
        # Boot 2 (same engine id, a new process boot) serves "d": its first check names it.
        boot2 = _engine("decode", "decode-pinned", fabric, clock, tp_size=decode_tp)
        boot2.add_request(EngineRequest("dd", [*_prompt(3), 1], 2, params["d"]))
        done = _run((prefill, boot2), "dd")
        assert done.error is None and done.num_external_tokens == 32
        # "a" freed long before its 30 s lease ("d" once boot 2's notification arrives)
        assert _held_becomes(prefill, {"b", "c"})
        assert _restarted() - before == 1
    finally:
        prefill.shutdown()
        if boot2 is not None:
            boot2.shutdown()


def test_a_prefill_restarted_mid_pull_frees_the_decode_hold_its_old_boot_claimed() -> None:
    """Multi-turn: decode holds two conversations' turn 1 for prefill; prefill boot 1 checks
    its pull of the first and dies; boot 2 (same engine id) pulls the second, and decode ends
    the first hold at once instead of at decoder_kv_blocks_ttl."""
    fabric, clock = FakeFabric(), _Clock()
    prefill = _engine("prefill", "prefill-mt", fabric, clock, bidirectional=True)
    decode = _engine("decode", "decode-mt", fabric, clock, bidirectional=True)
    boot2: Engine | None = None
    try:
        held = {}
        for seed, name in enumerate(("c1", "c2")):
            params = _prefill(prefill, f"{name}-t1p", _prompt(seed))
            decode.add_request(EngineRequest(name, [*_prompt(seed), 1], 20, params))
            turn1 = _run((prefill, decode), name)
            assert turn1.error is None and turn1.kv_transfer_params is not None
            held[name] = ([*_prompt(seed), 1, *turn1.token_ids], turn1.kv_transfer_params)
        prefill.shutdown()  # turn 1's prefill is done; the next turns meet new boots
        for _ in range(50):
            decode.step()
        assert set(decode.held) == {"c1", "c2"}
        history, params = held["c1"]
        boot1 = _boot("prefill-mt", decode, 1, bidirectional_kv_xfer=True, kv_recompute_threshold=8)
        prompt = [*history, 9, 9]
        _claim_as_ranks(boot1, RequestInfo("c1-t2p", len(prompt), params, token_ids=prompt), 1)
        before = _restarted()
        boot2 = _engine("prefill", "prefill-mt", fabric, clock, bidirectional=True)
        history, params = held["c2"]
        boot2.add_request(EngineRequest("c2-t2p", [*history, 9, 9], 1, params))
        pulled = _run((boot2, decode), "c2-t2p")
        assert pulled.error is None and pulled.num_external_tokens > 0
        # c1: its reader restarted; c2: pulled and notified
        assert _held_becomes(decode, set())
        assert _restarted() - before == 1
    finally:
        prefill.shutdown()
        decode.shutdown()
        if boot2 is not None:
            boot2.shutdown()
