"""Fleet scale (issue 21 items 3 and 4): costs that must not grow with the fleet, in tests.

- Lease checks go out batched: one LeaseCheck per prefill engine boot per transfer pass, not
  one per load, and each load still gets prefill's answer for its own lease.
- The lease table finds due leases without a scan of every held one, and agrees with the
  naive scan on any history (hypothesis).

benchmarks/many_peers.py measures the same costs at several sizes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.config import ConnectorConfig
from connector.errors import ConnectorError, HandshakeError, PeerRestarted
from connector.geometry import build_rank_layout
from connector.metadata import ConnectorMetadata, LoadSpec, RemoteSource
from connector.protocol import LeaseRef, LeaseStatus
from scheduler.leases import LeaseTable
from scheduler.side_channel import SideChannelServer
from tests.test_worker_parts import make_spec
from worker.connector import WorkerConnector
from worker.fake import FakeFabric, FakeNixl
from worker.lease_proof import AFTER_READS, BEFORE_READS, LeaseProofs

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

    def __call__(self, remotes: Sequence[RemoteSource]) -> list[bool | ConnectorError]:
        self.batches.append([r.remote_request_id for r in remotes])
        if self.fail_batch is not None:
            raise self.fail_batch
        return [self.answers.get(r.remote_request_id, True) for r in remotes]


def answers(proofs: LeaseProofs, tickets: dict[str, int]) -> dict[str, str | None]:
    """Wait (bounded) for every ticket's answer: request id -> failure reason or None."""
    found: dict[str, str | None] = {}
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


def test_each_load_gets_its_own_leases_answer_from_a_shared_message(
    check: tuple[RecordingBatchCheck, LeaseProofs],
) -> None:
    recording, proofs = check
    recording.answers = {"gone": False, "restarted": PeerRestarted("another boot answered")}
    tickets = {rid: proofs.submit(remote(rid)) for rid in ("held", "gone", "restarted")}
    proofs.dispatch()
    found = answers(proofs, tickets)
    assert found["held"] is None
    assert (found["gone"] or "").startswith("lease expired: ") and "'gone'" in (found["gone"] or "")
    assert "restarted since it leased" in (found["restarted"] or "")
    assert len(recording.batches) == 1


def test_a_batch_that_cannot_be_asked_fails_every_load_in_it_unproven(
    check: tuple[RecordingBatchCheck, LeaseProofs],
) -> None:
    recording, proofs = check
    recording.fail_batch = HandshakeError("side channel 127.0.0.1:7001 did not answer within 2 s")
    tickets = {rid: proofs.submit(remote(rid), AFTER_READS) for rid in ("x", "y")}
    proofs.dispatch()
    for reason in answers(proofs, tickets).values():
        assert reason is not None and reason.startswith("lease not proven: ")
        assert "did not answer" in reason


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


@dataclass
class ServedPrefill:
    server: SideChannelServer
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

    server = SideChannelServer(
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
        assert sorted(failed) == ["d5"] and failed["d5"].startswith("lease expired: ")
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
