"""No transfer outlives its blocks, over real NIXL (UCX over TCP on loopback).

Issue 30 item 5: NIXL's release of an unfinished READ returns success over UCX, and the READ
still lands when its peer answers. Here a prefill peer (its own process, tests/nixl_peer_proc.py)
is paused with SIGSTOP while a 64 MiB READ from it is in flight, past a short transfer timeout.
The decode LoadTable (with a real NIXL agent) must not report the load while that READ may
still write its blocks; once the peer is resumed (SIGCONT) or killed, the load is reported
failed, and no byte changes in its blocks after the report.

UCX_TLS=tcp on both sides: with shared-memory transports (CMA) decode would read the paused
process's memory without its help and the READ would finish regardless.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from connector.geometry import build_rank_layout
from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec, MemoryLayout
from connector.metadata import FailureKind, LoadSpec
from connector.observability.metrics import QUARANTINED_LOADS, MetricsRecorder
from tests.nixl_peer_proc import PeerProcess, pattern
from tests.test_worker_connector import remote_handshake, source
from tests.test_worker_lifecycles import ScriptedProofs
from worker.loads import LoadTable, Outcome
from worker.nixl_real import RealNixlAgent
from worker.peers import Peer, PeerLink
from worker.plan.recipe import peer_plan

pytestmark = pytest.mark.real_nixl

BLOCK_SIZE = 16
NUM_BLOCKS = 512  # 2 regions (K, V) of 32 MiB: a 64 MiB READ
TRANSFER_TIMEOUT_S = 0.5
PAUSED_S = 4 * TRANSFER_TIMEOUT_S  # how long the peer stays paused past posting
REPORT_BOUND_S = 30.0  # resumed or killed, the READ ends well within this


def _spec() -> KVCacheSpec:
    layers = tuple(LayerSpec(f"l{i}", 8, 128, 2, 2) for i in range(2))
    group = GroupSpec(GroupKind.FULL, BLOCK_SIZE, BLOCK_SIZE, NUM_BLOCKS, layers)
    return KVCacheSpec("quarantine", "bfloat16", "bfloat16", (group,), MemoryLayout.NHD)


SPEC = _spec()
LAYOUT = build_rank_layout(SPEC, 0, 1)
TOTAL_BYTES = sum(LAYOUT.region_bytes)


def _region_addresses(base: int) -> tuple[int, ...]:
    offsets = np.cumsum((0, *LAYOUT.region_bytes[:-1]))
    return tuple(base + int(offset) for offset in offsets)


class Decode:
    """One decode rank: a real NIXL agent, its KV memory and a LoadTable over them."""

    def __init__(self, peer_address: int, peer_metadata: bytes) -> None:
        self.agent = RealNixlAgent(f"decode-{uuid.uuid4().hex[:8]}")
        self.memory = np.zeros(TOTAL_BYTES, dtype=np.uint8)
        self.registration = self.agent.register_regions([(self.memory.ctypes.data, TOTAL_BYTES)])
        peer_name = self.agent.add_remote_agent(peer_metadata)
        handshake = msgspec.structs.replace(
            remote_handshake("p", 0, 1, SPEC, agent_name=peer_name),
            region_addresses=_region_addresses(peer_address),
        )
        self.peer = Peer("p", "127.0.0.1", 7001, 1, {0: 1})
        plan = peer_plan(LAYOUT, handshake.layout, duty=self.peer.duty)
        self.peer.connect(PeerLink(plan, {0: handshake}, {0: peer_name}, {}))
        self.metrics = MetricsRecorder()
        self.proofs = ScriptedProofs()
        self.table = LoadTable(
            self.agent, local_region_addresses=_region_addresses(self.memory.ctypes.data),
            clock=time.monotonic, transfer_timeout_s=TRANSFER_TIMEOUT_S, handshake_wait_s=10.0,
            on_peer_failure=lambda peer: None,
            proofs=self.proofs,  # type: ignore[arg-type]  # the same interface, scripted
            metrics=self.metrics,
        )  # fmt: skip

    def start_load(self) -> None:
        """Add the load of every block and post its READ (the lease check answered held)."""
        ids = tuple(range(NUM_BLOCKS))
        remote = source("p-req", block_ids=(ids,))
        self.table.add(LoadSpec("d-req", (ids,), NUM_BLOCKS * BLOCK_SIZE, 0, remote), self.peer)
        self.proofs.answer_all(True)

    def advance_for(self, duration_s: float) -> list[Outcome]:
        outcomes: list[Outcome] = []
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            outcomes += self.table.advance()
            time.sleep(0.005)
        return outcomes

    def advance_until_reported(self, bound_s: float) -> tuple[Outcome, np.ndarray]:
        """The load's outcome and the bytes of its blocks at the moment it was reported."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            outcomes = self.table.advance()
            if outcomes:
                return outcomes[0], self.memory.copy()
            time.sleep(0.005)
        raise TimeoutError(f"the load was not reported within {bound_s} s")

    def close(self) -> None:
        self.table.abandon_all()
        self.agent.deregister(self.registration)
        self.agent.close()


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both processes on UCX's TCP transport (the peer inherits this environment)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@pytest.fixture
def peer(tcp_only: None) -> Iterator[PeerProcess]:
    with PeerProcess(num_bytes=TOTAL_BYTES, seed=5, lifetime_s=90.0) as process:
        yield process


@pytest.mark.parametrize("end_of_pause", ["resume", "kill"])
def test_a_read_from_a_paused_peer_is_reported_only_once_it_can_no_longer_land(
    peer: PeerProcess, end_of_pause: str
) -> None:
    address, num_bytes, _, metadata = peer.wait_ready(timeout_s=60.0)
    assert num_bytes == TOTAL_BYTES
    decode = Decode(address, metadata)
    try:
        peer.pause()  # before posting: the READ is in flight and cannot finish while paused
        decode.start_load()
        assert decode.advance_for(PAUSED_S) == [], "reported while its READ may still land"
        assert "d-req" in decode.table
        assert decode.metrics.snapshot().counters[QUARANTINED_LOADS.name] == {"": 1}
        if end_of_pause == "resume":
            peer.resume()
        else:
            peer.kill()
        (request_id, reason), at_report = decode.advance_until_reported(REPORT_BOUND_S)
        assert request_id == "d-req"
        assert reason is not None and reason.kind is FailureKind.TRANSFER_TIMEOUT
        assert "did not finish within" in reason.message
        if end_of_pause == "resume":  # the READ ended DONE: every byte landed before the report
            assert np.array_equal(at_report, pattern(TOTAL_BYTES, 5))
        decode.advance_for(1.0)
        time.sleep(0.5)
        assert np.array_equal(decode.memory, at_report), "a byte landed after the report"
    finally:
        peer.resume()
        decode.close()
