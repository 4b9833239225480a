"""Lease-proven loads: a decode load succeeds only when prefill says, once its READs landed,
that the very lease its params name still holds (DESIGN: block ids are addresses, not
capabilities).

From the bottom up: ``LeaseTable.held`` case by case; the LeaseCheck through a real side
channel on loopback; one decode rank on FakeNixl with a scripted lease check (what each answer
makes of the load, and when prefill hears it may free); prefill counting lease-keyed free
notifications; and two engines end to end, where stale params meet blocks prefill reused.
Clocks are injected; the waits below are for real handshake and check threads, bounded.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from connector.config import ConnectorConfig
from connector.errors import HandshakeError, PeerRestarted
from connector.geometry import build_rank_layout
from connector.lease_binding import bound_to_blocks
from connector.metadata import (
    ABORTED_LOAD,
    ConnectorMetadata,
    FailureKind,
    LoadFailure,
    LoadSpec,
    ReleaseSpec,
    RemoteSource,
    WorkerReport,
)
from connector.net.side_channel_client import check_leases_status, send_release
from connector.params import parse_kv_transfer_params
from connector.protocol import LeaseRef, LeaseStatus, encode_free_notif, lease_key
from scheduler.connector import Role, SchedulerConnector
from scheduler.leases import LeaseTable
from scheduler.producer import Producer
from tests import oracle
from tests.scheduler_helpers import (
    DENSE,
    FakeClock,
    bound_ref,
    bound_source,
    handshakes,
    prefill_request,
)
from tests.test_lifecycle import (
    LEASE_S,
    Clock,
    CountingNixl,
    Engine,
    assert_accounted,
    assert_bytes_landed,
    make_spec,
    run_until,
)
from tests.test_worker_connector import Rig
from worker import lease_proof
from worker.connector import WorkerConnector
from worker.fake import FakeFabric, FakeNixl
from worker.lease_proof import SilentSideChannels, asked_again, side_channel_checks
from worker.load_lifecycle import AFTER_READS, BEFORE_READS, Staging, lease_failure
from worker.nixl_api import TransferState

DURATION_S = 30.0
HOST = "127.0.0.1"

# --- LeaseTable.held: is that very lease held, now? ------------------------------------------

# Steps on a fresh table (duration 30 s): ("lease", request id, lease id, now),
# ("extend", request id, now), ("complete", request id), ("release", request id),
# ("expired", now).
LEASE_R_L1 = ("lease", "r", "L1", 0.0)
HELD_CASES: dict[str, tuple[list[tuple[Any, ...]], tuple[str, str], float, bool]] = {
    "the very lease, before its expiry": ([LEASE_R_L1], ("r", "L1"), 29.9, True),
    "another lease id of the same request id": ([LEASE_R_L1], ("r", "L2"), 1.0, False),
    "a request id never leased": ([LEASE_R_L1], ("s", "L1"), 1.0, False),
    "at its expiry": ([LEASE_R_L1], ("r", "L1"), 30.0, False),
    "past its expiry, before expired() collected it": ([LEASE_R_L1], ("r", "L1"), 30.1, False),
    "extended by a heartbeat past its first expiry": (
        [LEASE_R_L1, ("extend", "r", 20.0)], ("r", "L1"), 45.0, True,
    ),
    "completed: every rank freed it": ([LEASE_R_L1, ("complete", "r")], ("r", "L1"), 1.0, False),
    "released over the side channel": ([LEASE_R_L1, ("release", "r")], ("r", "L1"), 1.0, False),
    "expired and collected (asked with an earlier clock)": (
        [LEASE_R_L1, ("expired", 30.0)], ("r", "L1"), 1.0, False,
    ),
    "never revives: the request id leased again": (
        [LEASE_R_L1, ("complete", "r"), ("lease", "r", "L2", 1.0)], ("r", "L1"), 2.0, False,
    ),
    "the new lease of a reused request id is its own": (
        [LEASE_R_L1, ("complete", "r"), ("lease", "r", "L2", 1.0)], ("r", "L2"), 2.0, True,
    ),
    "never revives: a heartbeat after the end": (
        [LEASE_R_L1, ("expired", 31.0), ("extend", "r", 32.0)], ("r", "L1"), 33.0, False,
    ),
}  # fmt: skip


def apply_step(table: LeaseTable, step: tuple[Any, ...], lease_ids: dict[str, str]) -> None:
    """Heartbeats and releases name the request's latest lease by its key, as decode does."""
    kind, *args = step
    if kind == "lease":
        request_id, lease_id, now = args
        table.lease(request_id, now, lease_id)
        lease_ids[request_id] = lease_id
    elif kind == "extend":
        table.extend([lease_key(args[0], lease_ids[args[0]])], args[1])
    elif kind == "complete":
        table.complete(args[0])
    elif kind == "release":
        table.release([lease_key(args[0], lease_ids[args[0]])])
    else:
        table.expired(args[0])


@pytest.mark.parametrize(
    ("steps", "ref", "now", "held"), list(HELD_CASES.values()), ids=list(HELD_CASES)
)
def test_held_answers_for_that_very_lease(
    steps: list[tuple[Any, ...]], ref: tuple[str, str], now: float, held: bool
) -> None:
    table = LeaseTable(DURATION_S)
    lease_ids: dict[str, str] = {}
    for step in steps:
        apply_step(table, step, lease_ids)
    assert table.held([ref], now) == (held,)


def test_held_answers_every_ref_in_order_and_changes_nothing() -> None:
    table = LeaseTable(DURATION_S)
    table.lease("a", 0.0, "A")
    table.lease("b", 0.0, "B")
    refs = [("a", "A"), ("b", "X"), ("never", "N"), ("b", "B"), ("a", "A")]
    assert table.held(refs, 1.0) == (True, False, False, True, True)
    assert table.held(refs, 1.0) == (True, False, False, True, True)
    assert len(table) == 2 and table.expired(1.0) == ()


# --- LeaseCheck through a prefill engine's side channel --------------------------------------


@pytest.fixture
def served_prefill() -> Iterator[tuple[SchedulerConnector, FakeClock]]:
    clock = FakeClock()
    config = ConnectorConfig(side_channel_host=HOST, side_channel_port=0, kv_lease_duration_s=30.0)
    connector = SchedulerConnector(
        config, engine_id="prefill-0", role=Role.PRODUCER, spec=DENSE, tp_size=2, clock=clock
    )
    connector.start_side_channel(handshakes())
    yield connector, clock
    connector.shutdown()


def lease_of(connector: SchedulerConnector, request_id: str) -> dict[str, Any]:
    delay, params = connector.request_finished(prefill_request(request_id), ((1,),))
    assert delay is True and params is not None
    return params


def ask(params: dict[str, Any], refs: list[tuple[str, str]], **overrides: Any) -> tuple[bool, ...]:
    """Which refs a lease check at the side channel the params name holds, asked as the
    params' engine and boot, as a reader of those params (its tokens and blocks)."""
    where: dict[str, Any] = {
        "engine_id": params["remote_engine_id"], "boot_id": params["remote_boot_id"],
        "secret": None, "timeout_s": 2.0,
    } | overrides  # fmt: skip
    bound = [bound_ref(request_id, lease_id, params) for request_id, lease_id in refs]
    return check_leases_status(params["remote_host"], params["remote_port"], bound, **where).held


def test_a_lease_check_answers_per_ref(served_prefill: tuple[SchedulerConnector, Any]) -> None:
    connector, clock = served_prefill
    p1, p2 = lease_of(connector, "p1"), lease_of(connector, "p2")
    refs = [
        ("p1", p1["remote_lease_id"]),
        ("p2", p2["remote_lease_id"]),
        ("p1", p2["remote_lease_id"]),  # another lease's id
        ("never", "0123456789abcdef"),
    ]
    assert ask(p1, refs) == (True, True, False, False)
    p2_key = lease_key("p2", p2["remote_lease_id"])
    assert send_release(HOST, p1["remote_port"], [p2_key], engine_id="prefill-0", secret=None,
                        timeout_s=2.0) == 1  # fmt: skip
    assert ask(p1, refs) == (True, False, False, False)
    clock.advance(30.0)  # p1's lease is due, though the engine has not collected it yet
    assert ask(p1, refs[:1]) == (False,)


def test_a_lease_check_for_another_boot_raises_peer_restarted(
    served_prefill: tuple[SchedulerConnector, Any],
) -> None:
    connector, _ = served_prefill
    params = lease_of(connector, "p1")
    refs = [("p1", params["remote_lease_id"])]
    with pytest.raises(PeerRestarted, match="LeaseCheck names side-channel boot 'a-former-boot'"):
        ask(params, refs, boot_id="a-former-boot")
    assert ask(params, refs) == (True,)  # the refusal touched nothing


def test_a_lease_check_for_another_engine_is_refused(
    served_prefill: tuple[SchedulerConnector, Any],
) -> None:
    connector, _ = served_prefill
    params = lease_of(connector, "p1")
    refs = [("p1", params["remote_lease_id"])]
    with pytest.raises(
        HandshakeError,
        match="leasecheck for prefill engine 'prefill-9' reached engine 'prefill-0'",
    ):
        ask(params, refs, engine_id="prefill-9")
    assert ask(params, refs) == (True,)


def test_the_default_lease_check_asks_the_side_channel_the_params_name(
    served_prefill: tuple[SchedulerConnector, Any],
) -> None:
    connector, clock = served_prefill
    remote = parse_kv_transfer_params(lease_of(connector, "p1"))
    assert remote is not None
    check, _ = side_channel_checks(ConnectorConfig(handshake_timeout_s=2.0))
    assert check(bound_source(remote.remote_source())) is True
    clock.advance(30.0)
    assert check(bound_source(remote.remote_source())) is False


UNANSWERED_ONCE = HandshakeError("side channel 127.0.0.1:7001 did not answer within 2.0 s")
# case id -> (handshake_retries, what each ask does in turn, the check's result, asks made)
ASKED_AGAIN: dict[str, tuple[int, list[bool | Exception], bool | type[Exception], int]] = {
    "answered at once": (1, [True], True, 1),
    "unanswered once, then held": (1, [UNANSWERED_ONCE, True], True, 2),
    "unanswered once, then not held": (1, [UNANSWERED_ONCE, False], False, 2),
    "unanswered every time": (1, [UNANSWERED_ONCE, UNANSWERED_ONCE], HandshakeError, 2),
    "another boot answered: final at once": (
        2, [PeerRestarted("stale boot"), True], PeerRestarted, 1,
    ),
    "no retries configured": (0, [UNANSWERED_ONCE, True], HandshakeError, 1),
}  # fmt: skip


@pytest.mark.parametrize(
    ("retries", "script", "result", "num_asks"), list(ASKED_AGAIN.values()), ids=list(ASKED_AGAIN)
)
def test_the_default_lease_check_asks_again_while_prefill_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, retries: int, script: list[bool | Exception],
    result: bool | type[Exception], num_asks: int,
) -> None:  # fmt: skip
    asks: list[tuple[str, str]] = []

    def check_leases_status(host: str, port: int, leases: list[LeaseRef], **_: Any) -> LeaseStatus:
        asks.extend((ref.remote_request_id, ref.lease_id) for ref in leases)
        answer = script[len(asks) - 1]
        if isinstance(answer, Exception):
            raise answer
        return LeaseStatus((answer,))

    monkeypatch.setattr(
        "connector.net.side_channel_client.check_leases_status", check_leases_status
    )
    check, _ = side_channel_checks(ConnectorConfig(handshake_retries=retries))
    if isinstance(result, bool):
        assert check(remote_of()) is result
    else:
        with pytest.raises(result):
            check(remote_of())
    assert asks == [("p-1", "L1")] * num_asks


# --- one decode rank on FakeNixl, prefill's answers scripted ---------------------------------

REQUEST = oracle.Request(9, 0, ((0, 1, 2),), ((3, 4, 5),))  # 9 tokens, blocks of 4
CONFIG = ConnectorConfig(handshake_retries=0, kv_lease_duration_s=30.0, handshake_timeout_s=2.0)


def remote_of(request_id: str = "p-1", **changes: Any) -> RemoteSource:
    fields: dict[str, Any] = {"boot_id": "b1", "lease_id": "L1"} | changes
    return RemoteSource("prefill", HOST, 7001, 1, request_id, REQUEST.remote_block_ids, **fields)


class ScriptedCheck:
    """Prefill's answers to a rank's lease checks, in call order: True, False, or an exception
    to raise. Call number ``hold_at`` (0: the check made with the load, 1: the proof after its
    READs) waits until ``release`` is set."""

    def __init__(self, *answers: bool | Exception, hold_at: int | None = None) -> None:
        self.answers = answers
        self.calls: list[RemoteSource] = []
        self.hold_at = hold_at
        self.holding = threading.Event()
        self.release = threading.Event()

    def __call__(self, remote: RemoteSource) -> bool:
        number = len(self.calls)
        self.calls.append(remote)
        if number == self.hold_at:
            self.holding.set()
            self.release.wait(10.0)
        answer = self.answers[number]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Pair:
    """A prefill rank and a decode rank (TP 1 each) on one FakeFabric; decode checks leases
    with ``check`` and fetches prefill's handshake directly."""

    def __init__(self, check: ScriptedCheck, decode_agent: type[FakeNixl] = FakeNixl) -> None:
        fabric = FakeFabric()
        spec = make_spec()
        self.layout = build_rank_layout(spec, 0, 1)
        self.prefill_buffers = oracle.fill_prefill(self.layout, REQUEST, 7)
        self.decode_buffers = oracle.sentinel(self.layout)
        self.check = check
        self.prefill = self._rank("prefill", spec, FakeNixl("prefill-r0", fabric), None)
        self.prefill.register_kv_caches([b.ctypes.data for b in self.prefill_buffers])
        handshake = self.prefill.get_handshake_metadata()
        self.decode_agent = decode_agent("decode-r0", fabric)
        self.decode = self._rank("decode", spec, self.decode_agent, handshake)
        self.decode.register_kv_caches([b.ctypes.data for b in self.decode_buffers])
        self.outcomes: list[tuple[str, LoadFailure | None]] = []  # decode, in report order
        self.finished_sending: list[str] = []  # prefill

    def _rank(self, engine_id: str, spec: Any, agent: FakeNixl, handshake: Any) -> WorkerConnector:
        return WorkerConnector(
            CONFIG, engine_id=engine_id, tp_rank=0, tp_size=1, spec=spec, agent=agent,
            clock=Clock(), fetch=lambda host, port, tp_rank: handshake, lease_check=self.check,
        )  # fmt: skip

    def start(self, remote: RemoteSource, request_id: str = "d-1") -> None:
        """Prefill's rank expects the lease's notification; decode's rank loads it."""
        key = lease_key(remote.remote_request_id, remote.lease_id)
        self.prefill.start_load_kv(ConnectorMetadata(sends=(key,)))
        spec = LoadSpec(request_id, REQUEST.local_block_ids, REQUEST.num_tokens, 0, remote)
        self.decode.start_load_kv(ConnectorMetadata(loads=(spec,)))

    def step(self) -> None:
        assert self.decode.flush() and self.prefill.flush()
        report = self.decode.get_finished()
        self.outcomes += [(rid, None) for rid in report.finished_recving]
        self.outcomes += list(report.failed_recving.items())
        self.finished_sending += self.prefill.get_finished().finished_sending

    def until(self, condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "not reached in time"
            self.step()

    def close(self) -> None:
        self.check.release.set()
        self.decode.shutdown()
        self.prefill.shutdown()


@pytest.fixture
def make_pair() -> Iterator[Callable[[ScriptedCheck], Pair]]:
    made: list[Pair] = []

    def make(check: ScriptedCheck) -> Pair:
        made.append(Pair(check))
        return made[-1]

    yield make
    for pair in made:
        pair.close()


UNANSWERED = HandshakeError("side channel 127.0.0.1:7001 did not answer within 2.0 s")
RESTARTED = PeerRestarted("side channel 127.0.0.1:7001 refused the request: stale boot")
NO_LEASE = (
    "^lease not proven: the kv_transfer_params of prefill request 'p-1' carry no remote_lease_id"
)
EXPIRED, UNPROVEN = FailureKind.LEASE_EXPIRED, FailureKind.LEASE_UNPROVEN
# case id -> (prefill's answers, RemoteSource changes, (kind, message pattern) (None: success),
# checks)
ANSWERS: dict[str, tuple[tuple[Any, ...], dict[str, str], tuple[FailureKind, str] | None, int]] = {
    "held before and after the READs: success": ((True, True), {}, None, 2),
    "gone after the READs: lease expired": (
        (True, False), {},
        (EXPIRED, r"^lease expired: prefill engine 'prefill' request 'p-1' \(lease L1\) was no "
         r"longer held when this rank's READs completed"), 2,
    ),
    "gone before the READs: lease expired, nothing read": (
        (False,), {}, (EXPIRED, r"^lease expired: .* was no longer held before any READ was posted"),
        1,
    ),
    "prefill restarted since it leased: its own kind": (
        (True, RESTARTED), {},
        (FailureKind.PREFILL_RESTARTED,
         r"^lease expired: .*: the prefill engine restarted since it leased"), 2,
    ),
    "prefill cannot be asked: lease not proven": (
        (True, UNANSWERED), {},
        (UNPROVEN, r"^lease not proven: asking prefill engine 'prefill' request 'p-1' \(lease L1\) "
         r"whether the lease holds failed: side channel .* did not answer"), 2,
    ),
    "params without a lease id: lease not proven, nobody asked": (
        (), {"lease_id": ""}, (UNPROVEN, NO_LEASE), 0,
    ),
    "params without a boot id: lease not proven, nobody asked": (
        (), {"boot_id": ""}, (UNPROVEN, NO_LEASE), 0,
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("answers", "changes", "expected", "num_checks"), list(ANSWERS.values()), ids=list(ANSWERS)
)
def test_prefills_word_on_the_lease_decides_the_load_and_prefill_always_hears(
    make_pair: Callable[[ScriptedCheck], Pair], answers: tuple[Any, ...], changes: dict[str, str],
    expected: tuple[FailureKind, str] | None, num_checks: int,
) -> None:  # fmt: skip
    pair = make_pair(ScriptedCheck(*answers))
    remote = remote_of(**changes)
    pair.start(remote)
    key = lease_key("p-1", remote.lease_id)
    # A restarted prefill's old boot is gone with its agent: nothing to notify there (a
    # notification to a dead agent blocks the transfer thread until UCX gives up on it).
    notified = expected is None or expected[0] is not FailureKind.PREFILL_RESTARTED
    pair.until(lambda: bool(pair.outcomes) and (bool(pair.finished_sending) or not notified))
    [(request_id, outcome)] = pair.outcomes
    assert request_id == "d-1" and len(pair.check.calls) == num_checks
    read = LoadSpec("d-1", REQUEST.local_block_ids, REQUEST.num_tokens, 0, remote)
    assert all(called == bound_to_blocks(read) for called in pair.check.calls)
    if notified:  # success or not, prefill may free: once
        assert pair.finished_sending == [key]
        assert pair.prefill.notification_stats.counted == 1
    else:
        assert pair.finished_sending == [] and pair.prefill.notification_stats.counted == 0
    landed = oracle.first_difference(
        pair.decode_buffers, oracle.expected_decode(pair.layout, REQUEST)
    )
    if expected is None:
        assert outcome is None and landed is None  # prefill's bytes, where decode needs them
        return
    kind, pattern = expected
    assert outcome is not None and re.search(pattern, outcome.message), outcome
    assert outcome.kind is kind
    if num_checks <= 1:  # refused before any READ: decode's blocks were never written
        assert oracle.first_difference(pair.decode_buffers, oracle.sentinel(pair.layout)) is None


class PassCountingNixl(FakeNixl):
    """FakeNixl that numbers the transfer thread's passes (each collects notifications once)
    and records the pass in which each READ was posted and each check of one was made."""

    def __init__(self, name: str, fabric: FakeFabric) -> None:
        super().__init__(name, fabric)
        self.num_passes = 0
        self.posted_in: list[int] = []
        self.checked_in: list[int] = []

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.num_passes += 1
        return super().get_new_notifs()

    def post(self, transfer: Any) -> TransferState:
        self.posted_in.append(self.num_passes)
        return super().post(transfer)

    def check(self, transfer: Any) -> TransferState:
        self.checked_in.append(self.num_passes)
        return super().check(transfer)


def test_a_read_is_checked_in_the_pass_that_posted_it_and_its_proof_asked_then() -> None:
    """A small READ lands inside post(); the load does not wait a poll interval (1 ms, more
    on a loaded machine) to notice, so its lease proof goes out in the same pass."""
    pair = Pair(ScriptedCheck(True, True, hold_at=1), decode_agent=PassCountingNixl)
    try:
        pair.start(remote_of())
        pair.until(pair.check.holding.is_set)  # the proof is being asked
        agent = pair.decode_agent
        assert isinstance(agent, PassCountingNixl)
        assert len(agent.posted_in) == 1 and agent.checked_in[:1] == agent.posted_in
        pair.check.release.set()
        pair.until(lambda: bool(pair.outcomes))
        assert pair.outcomes == [("d-1", None)]
    finally:
        pair.close()


def test_the_free_notification_reaches_prefill_only_after_the_proof(
    make_pair: Callable[[ScriptedCheck], Pair],
) -> None:
    pair = make_pair(ScriptedCheck(True, True, hold_at=1))
    pair.start(remote_of())
    pair.until(pair.check.holding.is_set)  # every READ landed; prefill is being asked
    for _ in range(3):
        pair.step()
    assert pair.outcomes == [] and pair.finished_sending == []
    assert pair.prefill.notification_stats.counted == 0  # nothing reached prefill's rank
    pair.check.release.set()
    pair.until(lambda: bool(pair.outcomes) and bool(pair.finished_sending))
    assert pair.outcomes == [("d-1", None)] and pair.finished_sending == ["p-1@L1"]


def test_an_abort_while_confirming_ends_aborted_and_the_late_answer_is_dropped(
    make_pair: Callable[[ScriptedCheck], Pair],
) -> None:
    pair = make_pair(ScriptedCheck(True, True, True, True, hold_at=1))
    pair.start(remote_of())
    pair.until(pair.check.holding.is_set)
    pair.decode.start_load_kv(ConnectorMetadata(releases=(ReleaseSpec("d-1", remote_of()),)))
    pair.until(lambda: bool(pair.outcomes) and bool(pair.finished_sending))
    assert pair.outcomes == [("d-1", ABORTED_LOAD)] and pair.finished_sending == ["p-1@L1"]
    pair.check.release.set()  # the answer comes after its load ended
    pair.start(remote_of("p-2", lease_id="L2"), "d-2")  # the next load gets its own answers
    pair.until(lambda: len(pair.outcomes) == 2 and len(pair.finished_sending) == 2)
    for _ in range(3):
        pair.step()
    assert pair.outcomes == [("d-1", ABORTED_LOAD), ("d-2", None)]
    assert pair.finished_sending == ["p-1@L1", "p-2@L2"]
    # d-2 skips the check before its READs (prefill answered d-1's moments ago): its proof only
    assert [remote.remote_request_id for remote in pair.check.calls] == ["p-1", "p-1", "p-2"]


# --- prefill: only the lease's own key counts -------------------------------------------------

STRAY_KEYS = {
    "an earlier lease of the same request id": "p1@00000000000000ff",
    "the same request id leased by another boot": "p1@ffffffffffffff00",
    "the bare request id (params without a lease)": "p1",
}


def test_a_rank_report_of_an_unsaved_request_ends_its_lease_at_once() -> None:
    """Host staging with verify_kv: a rank whose device->host copy differs reports the
    request unsaved; the lease ends (no check says held) and its blocks are freed."""
    clock = FakeClock()
    leases = LeaseTable(DURATION_S)
    producer = Producer(
        engine_id="p", tp_size=2, leases=leases, clock=clock, address=lambda: (HOST, 7000),
        boot_id=lambda: "b1",
    )  # fmt: skip
    _, params = producer.request_finished("p1", ((1,),), 2, token_ids=[5, 6])
    _, other = producer.request_finished("p2", ((2,),), 2, token_ids=[5, 6])
    assert params is not None and other is not None
    producer.on_reports([WorkerReport(tp_rank=1, unsaved=("p1", "never-leased"))])
    assert producer.take_finished() == ("p1",)
    assert leases.held([("p1", params["remote_lease_id"])], clock()) == (False,)
    assert leases.held([("p2", other["remote_lease_id"])], clock()) == (True,)  # untouched


@pytest.mark.parametrize("stray", list(STRAY_KEYS.values()), ids=list(STRAY_KEYS))
def test_a_rank_report_for_another_lease_key_is_stray_and_the_lease_stays_held(
    stray: str,
) -> None:
    clock = FakeClock()
    leases = LeaseTable(DURATION_S)
    producer = Producer(
        engine_id="p", tp_size=1, leases=leases, clock=clock, address=lambda: (HOST, 7000),
        boot_id=lambda: "b1",
    )  # fmt: skip
    _, params = producer.request_finished("p1", ((1,),), 2, token_ids=[5, 6])
    assert params is not None
    key = lease_key("p1", params["remote_lease_id"])
    assert producer.take_step()[0] == (key,)  # sends: the lease key
    producer.on_reports([WorkerReport(tp_rank=0, finished_sending=(stray,))])
    assert producer.take_finished() == () and producer.num_stray_reports == 1
    assert leases.held([("p1", params["remote_lease_id"])], clock()) == (True,)
    producer.on_reports([WorkerReport(tp_rank=0, finished_sending=(key,))])
    assert producer.take_finished() == ("p1",) and len(leases) == 0


@pytest.mark.parametrize("stray", list(STRAY_KEYS.values()), ids=list(STRAY_KEYS))
def test_a_free_notification_for_another_lease_key_counts_towards_nothing(stray: str) -> None:
    rig = Rig()  # a prefill rank here: it expects one notification for the lease's key
    try:
        key = "p1@0123456789abcdef"
        rig.step(sends=(key,))
        rig.agent.inbox = {"d0": [encode_free_notif(stray, 1)]}
        assert rig.collect().finished_sending == ()
        rig.clock.now_s += 31.0  # past the early-notification window: written off
        assert rig.collect().finished_sending == ()
        stats = rig.worker.notification_stats
        assert (stats.counted, stats.stray) == (0, 1)
        rig.agent.inbox = {"d0": [encode_free_notif(key, 1)]}
        assert rig.collect().finished_sending == (key,)
    finally:
        rig.close()


# --- two engines end to end: stale params meet reused blocks ---------------------------------


class HeldNixl(CountingNixl):
    """A decode agent whose READs stay in flight until ``land`` is set; then they copy the
    bytes the prefill blocks hold at that moment, as a READ does."""

    def __init__(self, name: str, fabric: FakeFabric) -> None:
        super().__init__(name, fabric)
        self.faults.stall_polls = 1  # posting never completes a READ at once
        self.land = threading.Event()

    def check(self, transfer: Any) -> TransferState:
        if not self.land.is_set():
            return TransferState.IN_PROGRESS
        return super().check(transfer)


class Engines:
    """Makes engines (SchedulerConnector + WorkerConnectors, FakeNixl) on one fabric and clock."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.fabric = FakeFabric()
        self.made: list[Engine] = []
        self._names = itertools.count()

    def __call__(self, role: Role, *, agent: type[CountingNixl] = CountingNixl) -> Engine:
        kind = "prefill" if role is Role.PRODUCER else "decode"
        engine = Engine(
            f"{kind}{next(self._names)}", role, make_spec(), 1, clock=self.clock,
            fabric=self.fabric, make_agent=lambda name: agent(name, self.fabric),
        )  # fmt: skip
        self.made.append(engine)
        return engine


@pytest.fixture
def engines() -> Iterator[Engines]:
    made = Engines()
    yield made
    for engine in made.made:
        engine.shutdown()


def reuse_blocks(prefill: Engine) -> None:
    """Prefill's blocks now hold other bytes, as when another request got them."""
    for layout, buffers in zip(prefill.layouts, prefill.buffers, strict=True):
        for buffer, other in zip(buffers, oracle.noise(layout, 8), strict=True):
            buffer[:] = other


@pytest.mark.parametrize(
    "expired", [False, True], ids=["lease-alive", "lease-expired-blocks-reused"]
)
def test_decode_with_params_whose_lease_ended_fails_and_never_succeeds(
    engines: Engines, expired: bool
) -> None:
    prefill, decode = engines(Role.PRODUCER), engines(Role.CONSUMER)
    params = prefill.prefill("p-1", 9)
    prefill_ids = prefill.held["p-1"]
    prefill.step()
    if expired:
        engines.clock.now_s += LEASE_S + 1
        prefill.step()  # the lease ended: the engine freed the blocks...
        assert prefill.outcomes == {"p-1": None} and "p-1" not in prefill.held
        reuse_blocks(prefill)  # ...and another request wrote them
    info = decode.receive("d-1", params, 9)
    run_until([prefill, decode], lambda: "d-1" in decode.outcomes and "p-1" in prefill.outcomes)
    if expired:
        reason = decode.outcomes["d-1"]
        assert reason is not None and reason.startswith("lease expired: "), reason
        assert "before any READ was posted" in reason and decode.agents[0].num_posted == 0
    else:
        assert decode.outcomes == {"d-1": None}
        assert_bytes_landed(decode, "d-1", prefill_ids, 9, 0)
    decode.finish(info)
    assert_accounted(prefill, decode)


def test_a_reader_whose_lease_ended_under_its_reads_fails_though_bytes_landed(
    engines: Engines,
) -> None:
    """The same params went to two decode engines. B's READs are in flight when A's load
    completes the lease, prefill frees and reuses the blocks, and then B's READs land: B read
    the reused bytes, and only the proof keeps it from reporting success."""
    prefill = engines(Role.PRODUCER)
    decode_a, decode_b = engines(Role.CONSUMER), engines(Role.CONSUMER, agent=HeldNixl)
    params = prefill.prefill("p-1", 9)
    prefill_ids = prefill.held["p-1"]
    info_b = decode_b.receive("b-1", params, 9)
    run_until([prefill, decode_b], lambda: decode_b.agents[0].num_posted > 0)
    info_a = decode_a.receive("a-1", params, 9)
    run_until(
        [prefill, decode_a, decode_b],
        lambda: "a-1" in decode_a.outcomes and "p-1" in prefill.outcomes,
    )
    assert decode_a.outcomes == {"a-1": None} and "p-1" not in prefill.held  # freed
    reuse_blocks(prefill)
    held_agent = decode_b.agents[0]
    assert isinstance(held_agent, HeldNixl)
    held_agent.land.set()
    run_until([prefill, decode_a, decode_b], lambda: "b-1" in decode_b.outcomes)
    reason = decode_b.outcomes["b-1"]
    assert reason is not None and reason.startswith("lease expired: "), reason
    assert "when this rank's READs completed" in reason
    with pytest.raises(AssertionError, match="decode rank 0: region"):
        assert_bytes_landed(decode_b, "b-1", prefill_ids, 9, 0)  # B holds the reused bytes
    decode_a.finish(info_a)
    decode_b.finish(info_b)
    assert_accounted(prefill, decode_a, decode_b)


def test_a_side_channel_silent_through_every_retry_fails_the_next_checks_at_once() -> None:
    """A dead prefill: the first check waits out its retries; the next ones, for a window,
    fail at once instead of each holding a check thread for the same wait."""
    now = [100.0]
    silence = SilentSideChannels(window_s=10.0, clock=lambda: now[0])
    asks: list[str] = []

    def unanswered() -> bool:
        asks.append("ask")
        raise UNANSWERED_ONCE

    config = ConnectorConfig(handshake_retries=1)
    remote = remote_of()
    with pytest.raises(HandshakeError, match="did not answer"):
        asked_again(config, unanswered, remote, silence)
    assert len(asks) == 2  # the ask and its retry
    now[0] += 5.0
    with pytest.raises(HandshakeError, match="a lease check less than 10.0 s ago"):
        asked_again(config, unanswered, remote, silence)
    assert len(asks) == 2, "asked a side channel known silent"
    now[0] += 6.0  # the window is over: asked again
    assert asked_again(config, lambda: True, remote, silence) is True


# --- host-staged leases: not readable at first, so held after the READs is not enough -----

STAGED_CASES = [
    pytest.param(LeaseStatus((True,)), [True], id="plain-held"),
    pytest.param(LeaseStatus((False,)), [False], id="plain-not-held"),
    pytest.param(
        LeaseStatus((False,), pending=(True,), staged=(True,)), [Staging.PENDING], id="pending"
    ),
    pytest.param(
        LeaseStatus((True,), staged=(True,)), [Staging.HELD_AFTER_COPY], id="ready-after-copy"
    ),
    pytest.param(
        LeaseStatus((True, True, False), pending=(False, True, False), staged=(False, True, False)),
        [True, Staging.PENDING, False],
        id="each-ref-its-own-answer",
    ),
]


@pytest.mark.parametrize(("status", "expected"), STAGED_CASES)
def test_a_staged_leases_answer_per_ref(status: LeaseStatus, expected: list[Any]) -> None:
    assert lease_proof.answers(status) == expected


PROOF_CASES = [
    pytest.param(True, AFTER_READS, False, None, id="plain-held-after-reads-skipped-check"),
    pytest.param(Staging.HELD_AFTER_COPY, BEFORE_READS, False, None, id="ready-before-reads"),
    pytest.param(Staging.HELD_AFTER_COPY, AFTER_READS, True, None, id="ready-after-seen-before"),
    pytest.param(
        Staging.HELD_AFTER_COPY,
        AFTER_READS,
        False,
        r"lease not proven: .*staged copy not proven ready before the READs",
        id="ready-after-reads-never-seen-before",
    ),
    pytest.param(
        Staging.PENDING,
        BEFORE_READS,
        False,
        r"lease not proven: .*copy was not done within 10.0 s before any READ",
        id="pending-past-the-wait",
    ),
    pytest.param(
        Staging.PENDING,
        AFTER_READS,
        True,
        r"lease not proven: .*staged copy not proven ready before the READs",
        id="pending-after-reads",
    ),
]


@pytest.mark.parametrize(("answer", "when", "seen_held", "reason"), PROOF_CASES)
def test_a_staged_lease_proves_a_load_only_if_seen_held_before_its_reads(
    answer: Any, when: str, seen_held: bool, reason: str | None
) -> None:
    failure = lease_failure(remote_of(), answer, when, seen_held=seen_held)
    if reason is None:
        assert failure is None
    else:
        assert failure is not None and re.match(reason, failure.message), failure
        assert failure.kind is FailureKind.LEASE_UNPROVEN
