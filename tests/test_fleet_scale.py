"""Fleet scale (issue 21 items 3 and 4): costs that must not grow with the fleet, in tests.

- Lease checks go out batched: one LeaseCheck per prefill engine boot per transfer pass, not
  one per load, and each load still gets prefill's answer for its own lease.
- The lease table finds due leases without a scan of every held one, and agrees with the
  naive scan on any history (hypothesis).

benchmarks/many_peers.py measures the same costs at several sizes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.config import ConnectorConfig
from connector.errors import ConnectorError, HandshakeError, PeerRestarted, SideChannelTimeout
from connector.geometry import build_rank_layout
from connector.metadata import ConnectorMetadata, FailureKind, LoadFailure, LoadSpec, RemoteSource
from connector.protocol import (
    LeaseRef,
    LeaseStatus,
    WorkerHandshake,
    decode_envelope,
    decode_request_payload,
)
from scheduler.leases import LeaseTable
from scheduler.side_channel import SideChannelServer
from tests.test_worker_parts import make_spec
from worker.connector import WorkerConnector
from worker.fake import FakeFabric, FakeNixl
from worker.handshake import HandshakeClient, HandshakeJob
from worker.lease_proof import LeaseProofs, SilentSideChannels, asked_again
from worker.load_lifecycle import AFTER_READS, BEFORE_READS

HOST = "127.0.0.1"


def remote(request_id: str, *, port: int = 7001, boot_id: str = "b1") -> RemoteSource:
    return RemoteSource(
        "prefill", HOST, port, 1, request_id, ((0,),), boot_id=boot_id, lease_id="L-" + request_id
    )


@dataclass
class RecordingBatchCheck:
    """Prefill's answers per remote request id (held unless named in ``answers``); records
    each batch it is asked."""

    answers: dict[str, bool | ConnectorError] = field(default_factory=dict)
    fail_batch: ConnectorError | None = None
    batches: list[list[str]] = field(default_factory=list)
    patience: list[bool] = field(default_factory=list)  # per batch: asked again while silent?

    def __call__(
        self, remotes: Sequence[RemoteSource], patient: bool
    ) -> list[bool | ConnectorError]:
        self.batches.append([r.remote_request_id for r in remotes])
        self.patience.append(patient)
        if self.fail_batch is not None:
            raise self.fail_batch
        return [self.answers.get(r.remote_request_id, True) for r in remotes]


def answers(proofs: LeaseProofs, tickets: dict[str, int]) -> dict[str, LoadFailure | None]:
    """Wait (bounded) for every ticket's answer: request id -> failure reason or None."""
    found: dict[str, LoadFailure | None] = {}
    deadline = time.monotonic() + 5.0
    while len(found) < len(tickets):
        assert time.monotonic() < deadline, f"answers missing: {set(tickets) - set(found)}"
        for request_id, ticket in tickets.items():
            if request_id not in found:
                answered, reason = proofs.take(ticket)
                if answered:
                    found[request_id] = reason
        threading.Event().wait(0.001)
    return found


@pytest.fixture
def check() -> Iterator[tuple[RecordingBatchCheck, LeaseProofs]]:
    recording = RecordingBatchCheck()
    proofs = LeaseProofs(recording)
    yield recording, proofs
    proofs.close()


def test_one_pass_of_checks_is_one_message_per_prefill_boot(
    check: tuple[RecordingBatchCheck, LeaseProofs],
) -> None:
    recording, proofs = check
    sources = {
        "a1": remote("a1"), "a2": remote("a2"), "a3": remote("a3"),
        "b1": remote("b1", port=7002),  # another side channel
        "c1": remote("c1", boot_id="b2"),  # the same one, asked about another boot
    }  # fmt: skip
    tickets = {rid: proofs.submit(source, BEFORE_READS) for rid, source in sources.items()}
    assert recording.batches == [], "nothing is asked before dispatch"
    proofs.dispatch()
    assert set(answers(proofs, tickets).values()) == {None}
    assert sorted(sorted(batch) for batch in recording.batches) == [
        ["a1", "a2", "a3"], ["b1"], ["c1"]
    ]  # fmt: skip


def test_each_answered_batch_calls_on_answer_after_its_answers_are_ready() -> None:
    """The transfer thread is woken by an answer instead of finding it at its next poll."""
    woken = threading.Event()
    proofs = LeaseProofs(RecordingBatchCheck(), on_answer=woken.set)
    try:
        ticket = proofs.submit(remote("a1"), AFTER_READS)
        proofs.dispatch()
        assert woken.wait(5.0)
        assert proofs.take(ticket) == (True, None)  # already there when the wake came
    finally:
        proofs.close()


def test_checks_before_the_reads_go_apart_from_the_proofs_and_are_not_asked_again(
    check: tuple[RecordingBatchCheck, LeaseProofs],
) -> None:
    """A silent prefill fails a load's check before its READs after one timeout; the proof
    after the READs is asked again (a paused prefill may still prove a lease whose bytes
    landed). So the two kinds travel in separate messages."""
    recording, proofs = check
    tickets = {"before": proofs.submit(remote("before"), BEFORE_READS)}
    tickets["after"] = proofs.submit(remote("after"), AFTER_READS)
    proofs.dispatch()
    answers(proofs, tickets)
    assert sorted(zip(recording.patience, recording.batches, strict=True)) == [
        (False, ["before"]), (True, ["after"])
    ]  # fmt: skip


SILENT = SideChannelTimeout("side channel 127.0.0.1:7001 did not answer within 2.0 s")


@pytest.mark.parametrize(
    ("patient", "num_asks"),
    [pytest.param(False, 1, id="before-the-reads-once"), pytest.param(True, 4, id="proof-retried")],
)
def test_a_silent_side_channel_is_asked_again_only_for_the_proof(
    patient: bool, num_asks: int
) -> None:
    asks: list[int] = []

    def silent() -> bool:
        asks.append(1)
        raise SILENT

    config = ConnectorConfig(handshake_retries=3)
    silence = SilentSideChannels(window_s=10.0, clock=lambda: 0.0)
    with pytest.raises(SideChannelTimeout):
        asked_again(config, silent, remote("r"), silence, patient=patient)
    assert len(asks) == num_asks
    with pytest.raises(HandshakeError, match="a lease check less than 10.0 s ago"):
        asked_again(config, silent, remote("r2"), silence, patient=patient)  # the rest: at once
    assert len(asks) == num_asks


def test_each_load_gets_its_own_leases_answer_from_a_shared_message(
    check: tuple[RecordingBatchCheck, LeaseProofs],
) -> None:
    recording, proofs = check
    recording.answers = {"gone": False, "restarted": PeerRestarted("another boot answered")}
    tickets = {rid: proofs.submit(remote(rid)) for rid in ("held", "gone", "restarted")}
    proofs.dispatch()
    found = answers(proofs, tickets)
    assert found["held"] is None
    gone, restarted = found["gone"], found["restarted"]
    assert gone is not None and gone.kind is FailureKind.LEASE_EXPIRED and "'gone'" in gone.message
    assert restarted is not None and restarted.kind is FailureKind.PREFILL_RESTARTED
    assert "restarted since it leased" in restarted.message
    assert len(recording.batches) == 1


def test_a_batch_that_cannot_be_asked_fails_every_load_in_it_unproven(
    check: tuple[RecordingBatchCheck, LeaseProofs],
) -> None:
    recording, proofs = check
    recording.fail_batch = HandshakeError("side channel 127.0.0.1:7001 did not answer within 2 s")
    tickets = {rid: proofs.submit(remote(rid), AFTER_READS) for rid in ("x", "y")}
    proofs.dispatch()
    for reason in answers(proofs, tickets).values():
        assert reason is not None and reason.kind is FailureKind.LEASE_UNPROVEN
        assert (
            reason.message.startswith("lease not proven: ") and "did not answer" in reason.message
        )


def test_a_check_abandoned_before_dispatch_is_never_asked(
    check: tuple[RecordingBatchCheck, LeaseProofs],
) -> None:
    recording, proofs = check
    kept = proofs.submit(remote("kept"))
    proofs.abandon(proofs.submit(remote("aborted")))
    proofs.dispatch()
    assert answers(proofs, {"kept": kept}) == {"kept": None}
    assert recording.batches == [["kept"]]


# --- a decode rank against a real prefill side channel: messages per burst --------------------

SPEC = make_spec()


class CountingServer(SideChannelServer):
    """A side channel that counts the requests it answers, by kind."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[str] = []

    def _reply(self, frames: list[bytes]) -> Any:  # every request the serving thread answers
        envelope = decode_envelope(frames[0])
        self.requests.append(type(decode_request_payload(envelope.payload)).__name__)
        return super()._reply(frames)


@dataclass
class ServedPrefill:
    server: CountingServer
    rank: WorkerConnector  # holds the registration the READs are checked against
    leases: LeaseTable
    lease_checks: list[int]  # refs per LeaseCheck message served


def serve_prefill(fabric: FakeFabric, buffers: list[np.ndarray]) -> ServedPrefill:
    layout = build_rank_layout(SPEC, 0, 1)
    prefill = WorkerConnector(
        ConnectorConfig(), engine_id="prefill", tp_rank=0, tp_size=1, spec=SPEC,
        agent=FakeNixl("prefill-r0", fabric),
    )  # fmt: skip
    buffers.extend(np.zeros(size, dtype=np.uint8) for size in layout.region_bytes)
    prefill.register_kv_caches([buffer.ctypes.data for buffer in buffers])
    handshake = prefill.get_handshake_metadata()
    leases = LeaseTable(60.0)
    lease_checks: list[int] = []

    def on_check(refs: tuple[LeaseRef, ...]) -> LeaseStatus:
        lease_checks.append(len(refs))
        return leases.check(refs, time.monotonic())

    server = CountingServer(
        HOST, 0, {0: handshake}, engine_id="prefill", on_heartbeat=lambda ids: 0,
        on_release=leases.release, on_lease_check=on_check,
    )  # fmt: skip
    server.start()
    return ServedPrefill(server, prefill, leases, lease_checks)


def test_a_burst_of_loads_from_one_prefill_costs_it_a_few_messages_not_two_per_load() -> None:
    """16 loads in one step: before batching, 32 LeaseChecks (one before and one after each
    load's READs); now one message per pass that has checks, and the one lease prefill no
    longer holds fails only its own load."""
    fabric, buffers = FakeFabric(), []
    prefill = serve_prefill(fabric, buffers)
    layout = build_rank_layout(SPEC, 0, 1)
    decode_buffers = [np.zeros(size, dtype=np.uint8) for size in layout.region_bytes]
    decode = WorkerConnector(
        ConnectorConfig(handshake_retries=0, handshake_timeout_s=5.0), engine_id="decode",
        tp_rank=0, tp_size=1, spec=SPEC, agent=FakeNixl("decode-r0", fabric),
    )  # fmt: skip
    decode.register_kv_caches([buffer.ctypes.data for buffer in decode_buffers])
    try:
        specs = []
        for i in range(16):
            source = RemoteSource(
                "prefill", HOST, prefill.server.port, 1, f"p{i}", ((i,),),
                boot_id=prefill.server.boot_id, lease_id=f"L{i}",
            )  # fmt: skip
            if i != 5:  # p5's lease is not held: its load, and only it, must fail
                prefill.leases.lease(f"p{i}", time.monotonic(), f"L{i}")
            specs.append(LoadSpec(f"d{i}", ((i,),), 4, 0, source))
        decode.start_load_kv(ConnectorMetadata(loads=tuple(specs)))
        finished: list[str] = []
        failed: dict[str, str] = {}
        deadline = time.monotonic() + 20.0
        while len(finished) + len(failed) < 16:
            assert time.monotonic() < deadline, f"ended: {finished} {failed}"
            assert decode.flush()
            report = decode.get_finished()
            finished += report.finished_recving
            failed.update(report.failed_recving)
        assert sorted(failed) == ["d5"] and failed["d5"].kind is FailureKind.LEASE_EXPIRED
        assert len(finished) == 15
        assert sum(prefill.lease_checks) == 16 + 15  # every lease asked about, each load alone
        assert len(prefill.lease_checks) <= 4, prefill.lease_checks
    finally:
        decode.shutdown()
        prefill.server.stop()
        prefill.rank.shutdown()


# --- the lease table: due leases without a scan ------------------------------------------------

# One step of a lease table's history: (what, request index, seconds the clock moves first)
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["lease", "extend", "release", "complete", "expired"]),
        st.integers(0, 5),
        st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(STEPS)
def test_expired_agrees_with_a_scan_of_every_held_lease(
    steps: list[tuple[str, int, float]],
) -> None:
    """The oracle is the scan the table did before: every held lease whose expiry has come."""
    table = LeaseTable(2.0)
    expiry: dict[str, float] = {}  # the oracle: held leases -> expiry
    lease_ids: dict[str, str] = {}
    now, serial = 0.0, 0
    for what, index, dt in steps:
        now += dt
        request_id = f"r{index}"
        if what == "lease":
            serial += 1
            table.lease(request_id, now, f"L{serial}")
            expiry[request_id], lease_ids[request_id] = now + 2.0, f"L{serial}"
        elif what in ("extend", "release") and request_id in expiry:
            name = f"{request_id}@{lease_ids[request_id]}"
            if what == "extend":
                assert table.extend([name], now) == 1
                expiry[request_id] = max(expiry[request_id], now + 2.0)
            else:
                assert table.release([name]) == 1
                del expiry[request_id]
        elif what == "complete":
            assert table.complete(request_id) == (request_id in expiry)
            expiry.pop(request_id, None)
        elif what == "expired":
            due = sorted(rid for rid, at in expiry.items() if at <= now)
            assert sorted(table.expired(now)) == due
            for rid in due:
                del expiry[rid]
        assert len(table) == len(expiry)


# --- failure at fleet scale: a dead or restarted prefill costs one timeout, or one answer -----


@pytest.mark.parametrize(
    ("error", "num_attempts", "restarted"),
    [
        pytest.param(SideChannelTimeout("did not answer within 5 s"), 1, False, id="silent"),
        pytest.param(PeerRestarted("another boot"), 1, True, id="another-boot"),
        pytest.param(HandshakeError("garbage reply"), 4, False, id="other-errors-retried"),
    ],
)
def test_a_silent_or_restarted_side_channel_is_not_asked_again_while_requests_wait(
    error: HandshakeError, num_attempts: int, restarted: bool
) -> None:
    attempts: list[str] = []

    def fetch(host: str, port: int, tp_rank: int, boot_id: str) -> WorkerHandshake:
        attempts.append(boot_id)
        raise error

    client = HandshakeClient(fetch, retries=3, wait=lambda s: None)
    try:
        client.submit(HandshakeJob("p", HOST, 9, (0,), boot_id="boot-a"))
        (result,) = client.poll(wait_s=5.0)
    finally:
        client.close()
    assert attempts == ["boot-a"] * num_attempts, "the params' boot is named in every fetch"
    assert result.error is not None and f"after {num_attempts} attempt(s)" in result.error
    assert result.restarted is restarted


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def decode_rank(fabric: FakeFabric, config: ConnectorConfig, agent: FakeNixl) -> WorkerConnector:
    layout = build_rank_layout(SPEC, 0, 1)
    buffers = [np.zeros(size, dtype=np.uint8) for size in layout.region_bytes]
    rank = WorkerConnector(config, engine_id="decode", tp_rank=0, tp_size=1, spec=SPEC, agent=agent)
    rank.register_kv_caches([buffer.ctypes.data for buffer in buffers])
    rank._test_buffers = buffers  # type: ignore[attr-defined]  # keep the memory alive
    return rank


def outcomes(rank: WorkerConnector, request_ids: set[str]) -> dict[str, str | None]:
    """Flush until every request in ``request_ids`` was reported (bounded)."""
    found: dict[str, str | None] = {}
    deadline = time.monotonic() + 20.0
    while not request_ids <= set(found):
        assert time.monotonic() < deadline, f"reported: {found}"
        assert rank.flush()
        report = rank.get_finished()
        found.update(dict.fromkeys(report.finished_recving))
        found.update({rid: failure.message for rid, failure in report.failed_recving.items()})
    return found


def test_the_first_load_from_a_dead_prefill_fails_after_one_timeout_and_the_next_at_once() -> None:
    """Nothing listens at the prefill's side channel; handshake_retries=3. The first load
    fails after one attempt (one handshake_timeout, not four), the next ones without asking."""
    config = ConnectorConfig(handshake_retries=3, handshake_timeout_s=0.3)
    fabric = FakeFabric()
    rank = decode_rank(fabric, config, FakeNixl("decode-r0", fabric))
    port = free_port()
    try:
        dead = RemoteSource("p", HOST, port, 1, "p0", ((0,),), boot_id="b", lease_id="L")
        rank.start_load_kv(ConnectorMetadata(loads=(LoadSpec("d0", ((0,),), 4, 0, dead),)))
        first = outcomes(rank, {"d0"})["d0"] or ""
        assert f"rank 0 at {HOST}:{port} failed after 1 attempt(s)" in first, first
        assert "did not answer within 0.3 s" in first and "background probe" in first
        later = tuple(
            LoadSpec(
                f"d{i}", ((i,),), 4, 0, msgspec.structs.replace(dead, remote_request_id=f"p{i}")
            )
            for i in range(1, 4)
        )
        rank.start_load_kv(ConnectorMetadata(loads=later))
        assert rank.flush()  # the pass that takes them in fails them: no thread round trip
        failed = rank.get_finished().failed_recving
        assert sorted(failed) == ["d1", "d2", "d3"], failed
        assert all("s ago" in reason.message for reason in failed.values()), failed
    finally:
        rank.shutdown()


def test_params_naming_a_restarted_prefills_old_boot_fail_on_its_first_answer() -> None:
    """Prefill restarted under its engine id and port: params of the old boot get one
    refusal (the handshake names their boot) and fail `lease expired`, and the live boot's
    peer is kept: before, the stale params' handshake succeeded (Hello learned the new boot)
    and retired the live boot's peer, so the next good load handshaked again."""
    fabric, buffers = FakeFabric(), []
    prefill = serve_prefill(fabric, buffers)
    rank = decode_rank(fabric, ConnectorConfig(handshake_retries=3), FakeNixl("decode-r0", fabric))
    port, live_boot = prefill.server.port, prefill.server.boot_id

    def load_of(name: str, boot_id: str) -> LoadSpec:
        prefill.leases.lease(name, time.monotonic(), "L-" + name)
        source = RemoteSource(
            "prefill", HOST, port, 1, name, ((0,),), boot_id=boot_id, lease_id="L-" + name
        )
        return LoadSpec("d-" + name, ((0,),), 4, 0, source)

    try:
        for name, boot_id in (("x", live_boot), ("y", "0" * 32), ("z", live_boot)):
            rank.start_load_kv(ConnectorMetadata(loads=(load_of(name, boot_id),)))
            outcome = outcomes(rank, {"d-" + name})["d-" + name]
            if name == "y":
                assert outcome is not None and outcome.startswith("lease expired: "), outcome
                assert "restarted since it leased" in outcome and "boot" in outcome
            else:
                assert outcome is None, outcome
        handshakes = [kind for kind in prefill.server.requests if kind != "LeaseCheck"]
        assert handshakes == ["HandshakeRequest", "HandshakeRequest"], (
            "one for x, one refused for y, none for z: the live boot's peer was kept"
        )
    finally:
        rank.shutdown()
        prefill.server.stop()
        prefill.rank.shutdown()
