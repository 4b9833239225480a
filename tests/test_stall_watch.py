"""The stall watchdog: a load stuck on one wait is logged once, with the connector's stacks.

The pure part (worker/stall_watch.py ``StallWatch``) is driven with explicit times; then a
decode rank on FakeNixl whose handshake hangs (the side channel's fetch waits on a gate) or
whose transfer thread hangs inside ``add_remote_agent`` must say so, and a load that waited
long for its handshake names the handshake's phases in its failure.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from connector.metadata import ConnectorMetadata
from tests.test_worker_connector import (
    CONFIG,
    PREFILL_PORT,
    LeaseChecks,
    SideChannels,
    load,
    source,
)
from tests.test_worker_parts import BASE, Clock
from worker.connector import WorkerConnector
from worker.fake import FakeFabric, FakeNixl
from worker.stall_watch import StallWatch, Wait

HANDSHAKE = Wait("r1", "handshake", "p", "127.0.0.1:7001")
READS = Wait("r1", "reads", "p", "127.0.0.1:7001")
OTHER = Wait("r2", "proof", "p", "127.0.0.1:7001")


def reported(watch: StallWatch, now_s: float) -> list[tuple[str, str, float]] | None:
    report = watch.due(now_s)
    if report is None:
        return None
    return [(s.wait.request_id, s.wait.kind, s.waited_s) for s in report.stalls]


def test_a_wait_unchanged_past_the_threshold_is_reported_once() -> None:
    watch = StallWatch(stall_after_s=5.0, repeat_after_s=0.0)
    watch.publish([HANDSHAKE], now_s=100.0)
    watch.publish([HANDSHAKE], now_s=103.0)  # no progress: the clock keeps running from 100

    assert reported(watch, 104.9) is None
    assert reported(watch, 105.0) == [("r1", "handshake", 5.0)]
    assert reported(watch, 120.0) is None  # that stall was said once


def test_progress_restarts_the_clock_and_a_new_stall_is_reported_again() -> None:
    watch = StallWatch(stall_after_s=5.0, repeat_after_s=0.0)
    watch.publish([HANDSHAKE], now_s=100.0)
    assert reported(watch, 106.0) == [("r1", "handshake", 6.0)]

    watch.publish([READS], now_s=107.0)  # the handshake came: now it waits on its READs

    assert reported(watch, 111.0) is None
    assert reported(watch, 112.0) == [("r1", "reads", 5.0)]


def test_reports_are_rate_limited_and_an_ended_load_is_forgotten() -> None:
    watch = StallWatch(stall_after_s=5.0, repeat_after_s=30.0)
    watch.publish([HANDSHAKE], now_s=100.0)
    assert reported(watch, 105.0) == [("r1", "handshake", 5.0)]
    watch.publish([HANDSHAKE, OTHER], now_s=106.0)

    assert reported(watch, 120.0) is None  # r2 stalled, but one report per 30 s
    assert reported(watch, 135.0) == [("r2", "proof", 29.0)]  # r1's was said already
    watch.publish([], now_s=136.0)  # both ended
    assert reported(watch, 200.0) is None


def test_a_pass_that_does_not_return_is_a_stall_of_its_own() -> None:
    watch = StallWatch(stall_after_s=5.0, repeat_after_s=0.0)
    watch.publish([], now_s=100.0)
    watch.pass_started(now_s=101.0)

    assert watch.due(105.0) is None
    report = watch.due(107.0)
    assert report is not None and report.pass_running_s == 6.0 and report.stalls == ()
    assert watch.due(130.0) is None  # that pass was reported; a new one would be again
    assert "transfer thread has been in one pass for 6.0 s" in report.describe()


# --- a decode rank on FakeNixl ---------------------------------------------------------------


class HangingNixl(FakeNixl):
    """FakeNixl whose add_remote_agent waits for ``release`` (a NIXL call that does not return)."""

    def __init__(self, name: str, fabric: FakeFabric) -> None:
        super().__init__(name, fabric)
        self.entered = threading.Event()
        self.release = threading.Event()

    def add_remote_agent(self, metadata: bytes) -> str:
        self.entered.set()
        self.release.wait(10.0)
        return super().add_remote_agent(metadata)


class FakeRank:
    """A decode rank on FakeNixl with a prefill agent on the same fabric behind the fetch double."""

    def __init__(self, agent_type: type[FakeNixl] = FakeNixl) -> None:
        fabric = FakeFabric()
        self.clock = Clock()
        self.channels = SideChannels()
        self.channels.serve("p", 1)
        prefill = FakeNixl("p-r0", fabric)
        handshake = self.channels.served[PREFILL_PORT][0]
        self.channels.served[PREFILL_PORT][0] = msgspec.structs.replace(
            handshake, agent_metadata=prefill.get_agent_metadata()
        )
        self.leases = LeaseChecks()
        self.agent = agent_type("decode-r0", fabric)
        self.worker = WorkerConnector(
            CONFIG, engine_id="decode", tp_rank=0, tp_size=1, spec=BASE, agent=self.agent,
            clock=self.clock, fetch=self.channels, lease_check=self.leases,
        )  # fmt: skip
        self.worker.register_kv_caches([0x100_0000, 0x200_0000])
        self.failed: dict[str, str] = {}

    def collect(self) -> None:
        self.worker.flush()
        for request_id, failure in self.worker.get_finished().failed_recving.items():
            self.failed[request_id] = failure.message


@pytest.fixture
def hanging_handshake() -> Iterator[FakeRank]:
    rank = FakeRank()
    rank.channels.gate.clear()  # every fetch hangs until the test opens the gate
    yield rank
    rank.channels.gate.set()
    rank.worker.shutdown()


def stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "stalled:" in r.getMessage()]


def test_a_hanging_handshake_is_logged_once_with_the_handshake_threads_stack(
    hanging_handshake: FakeRank, caplog: pytest.LogCaptureFixture
) -> None:
    rank = hanging_handshake
    caplog.set_level(logging.WARNING, logger="worker.stall_watch")
    rank.worker.start_load_kv(ConnectorMetadata(loads=(load("d1", source()),)))
    rank.collect()
    assert rank.worker.check_stalls() is False  # waiting, but not long yet

    rank.clock.now_s += 6.0
    rank.collect()  # a pass: the load still waits on the same handshake
    rank.worker.check_stalls()
    rank.worker.check_stalls()

    [warning] = stall_warnings(caplog)  # once, whichever thread checked first
    assert "request d1 has waited 6.0 s for the handshake with prefill engine p at " in warning
    assert "127.0.0.1:7001" in warning
    handshake_stack = warning[warning.index("--- thread handshake") :]
    assert "gate.wait" in handshake_stack.split("--- thread", 2)[1]  # where it hangs
    assert "--- thread nixl-pd-transfer-r0" in warning


def test_a_load_that_waited_long_for_its_handshake_names_its_phases_when_it_fails(
    hanging_handshake: FakeRank, caplog: pytest.LogCaptureFixture
) -> None:
    rank = hanging_handshake
    caplog.set_level(logging.WARNING, logger="worker.peers")
    rank.leases.answers["p-req"] = False  # prefill's lease is gone by the time it is asked
    rank.worker.start_load_kv(ConnectorMetadata(loads=(load("d1", source()),)))
    rank.collect()
    rank.clock.now_s += 20.0  # the fetch hangs for 20 s of the rank's clock

    rank.channels.gate.set()
    deadline = threading.Event()
    for _ in range(500):
        rank.collect()
        if "d1" in rank.failed:
            break
        deadline.wait(0.01)

    reason = rank.failed["d1"]
    assert "this load waited 20.0 s for the handshake; handshake phases: queued 0.00 s, " in reason
    assert "fetch rank 0 20.00 s" in reason
    assert "add agents 0.00 s, prepare lists 0.00 s; 20.00 s in all" in reason
    assert reason.endswith("(this rank's load: handshake ready +20.0 s, failed +20.0 s)")
    [slow] = [r.getMessage() for r in caplog.records if r.name == "worker.peers"]
    assert "handshake with engine p at 127.0.0.1:7001 done in 20.00 s (handshake phases: " in slow


def test_a_transfer_thread_stuck_in_a_nixl_call_is_reported_with_its_stack(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rank = FakeRank(HangingNixl)
    agent: Any = rank.agent
    caplog.set_level(logging.WARNING, logger="worker.stall_watch")
    try:
        rank.worker.start_load_kv(ConnectorMetadata(loads=(load("d1", source()),)))
        assert agent.entered.wait(5.0)  # the pass that completes the handshake is stuck
        rank.clock.now_s += 7.0

        rank.worker.check_stalls()

        [warning] = stall_warnings(caplog)
        assert "the transfer thread has been in one pass for 7.0 s" in warning
        transfer_stack = warning[warning.index("--- thread nixl-pd-transfer-r0") :]
        assert "in add_remote_agent" in transfer_stack
    finally:
        agent.release.set()
        rank.worker.shutdown()
