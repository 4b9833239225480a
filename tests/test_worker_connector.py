"""Worker-side connector against doubles: handshakes, per-request failures, aborts, notifications.

The NIXL agent here is a recording double (no bytes move; tests decide each READ's fate), so
every path can be driven step by step; prefill's answer to the lease check is a double too
(held unless a test says otherwise). Bytes landing for real is tests/test_lifecycle.py's job,
the lease proof's own cases are tests/test_lease_proof.py's.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from connector.config import ConnectorConfig
from connector.errors import (
    HandshakeError,
    PeerRestarted,
    TransferFailed,
    UnsupportedConfiguration,
)
from connector.geometry import build_rank_layout
from connector.layout import GroupKind, KVCacheSpec
from connector.memory import HOST_MEMORY, Memory
from connector.metadata import (
    ConnectorMetadata,
    FailureKind,
    LoadSpec,
    ReleaseSpec,
    RemoteSource,
    WorkerReport,
)
from connector.protocol import PROTOCOL_VERSION, LeaseRef, WorkerHandshake
from scheduler.leases import LeaseTable
from tests.test_worker_parts import BASE, FP8, Clock, make_spec
from worker import lease_proof
from worker.connector import TransferThread, WorkerConnector
from worker.handshake import fingerprint
from worker.lease_proof import answers
from worker.load_lifecycle import Staging
from worker.nixl_api import TransferState
from worker.reads import keep_plan_memory_mapped

# --- a recording NIXL agent double -----------------------------------------------------------


@dataclass
class Read:
    remote_agent: str
    local: Any
    remote: Any
    notif: bytes
    state: TransferState = TransferState.IN_PROGRESS
    error: str | None = None
    released: bool = False
    by_index: bool = False


@dataclass
class PreparedList:
    owner: str
    rows: Any
    released: bool = False


@dataclass
class RecordingAgent:
    """Implements NixlAgent; records every call and the thread that made it."""

    name: str
    threads: set[int] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (method, thread name)
    regions: list[tuple[int, int]] = field(default_factory=list)
    remotes: set[str] = field(default_factory=set)
    reads: list[Read] = field(default_factory=list)
    lists: list[PreparedList] = field(default_factory=list)
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    inbox: dict[str, list[bytes]] = field(default_factory=dict)
    broken_metadata: bool = False
    dead: set[str] = field(default_factory=set)  # remote agents whose process died

    def _call(self) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append((sys._getframe(1).f_code.co_name, threading.current_thread().name))

    def register_regions(self, regions: Any, memory: Memory = HOST_MEMORY) -> Any:
        self._call()
        self.regions = list(regions)
        return "registration"

    def deregister(self, registration: Any) -> None:
        self._call()

    def get_agent_metadata(self) -> bytes:
        self._call()
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        self._call()
        if self.broken_metadata:
            raise HandshakeError("nixlMismatchError: corrupt metadata")
        self.remotes.add(metadata.decode())
        return metadata.decode()

    def remove_remote_agent(self, agent_name: str) -> None:
        self._call()
        self.remotes.discard(agent_name)

    def make_read(
        self, remote_agent: str, local: Any, remote: Any, notif: bytes = b"", **memory: Memory
    ) -> Any:
        self._call()
        if remote_agent not in self.remotes:
            raise TransferFailed(f"unknown agent {remote_agent}")
        self.reads.append(Read(remote_agent, local, remote, notif))
        return self.reads[-1]

    def prepare_list(self, owner: str | None, rows: Any, memory: Memory = HOST_MEMORY) -> Any:
        self._call()
        if owner is not None and owner not in self.remotes:
            raise TransferFailed(f"unknown agent {owner}")
        self.lists.append(PreparedList(owner or self.name, rows))
        return self.lists[-1]

    def make_prepped_read(
        self, local_list: Any, local: Any, remote_list: Any, remote: Any, notif: bytes = b""
    ) -> Any:
        self._call()
        if local_list.released or remote_list.released:
            raise TransferFailed("prepared list released")
        self.reads.append(Read(remote_list.owner, local, remote, notif, by_index=True))
        return self.reads[-1]

    def release_list(self, prepared: Any) -> None:
        self._call()
        prepared.released = True

    def post(self, transfer: Read) -> TransferState:
        self._call()
        if transfer.remote_agent in self.dead:  # as real NIXL: "remote agent disconnected"
            raise TransferFailed(f"posting a READ from agent {transfer.remote_agent!r} failed")
        return transfer.state

    def check(self, transfer: Read) -> TransferState:
        self._call()
        if transfer.error is not None:
            raise TransferFailed(transfer.error)
        return transfer.state

    def release(self, transfer: Read) -> None:
        self._call()
        transfer.released = True

    def send_notif(self, remote_agent: str, message: bytes) -> None:
        self._call()
        if remote_agent in self.dead:
            raise TransferFailed(f"sending a notification to agent {remote_agent!r} failed")
        self.sent.append((remote_agent, message))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self._call()
        inbox, self.inbox = self.inbox, {}
        return inbox

    def close(self) -> None:
        self._call()


# --- worker connector against doubles --------------------------------------------------------

CONFIG = ConnectorConfig(handshake_retries=0, kv_lease_duration_s=30.0, heartbeat_interval_s=5.0)
PREFILL_PORT = 7001
LEASE_ID = "l1"  # every source() names this lease of its request: notifications say "<id>@l1"
BOOT_ID = "b1"


def remote_handshake(
    engine_id: str, tp_rank: int, tp_size: int, spec: KVCacheSpec = BASE, agent_name: str = "",
    backends: tuple[str, ...] = ("UCX",),
) -> WorkerHandshake:  # fmt: skip
    layout = build_rank_layout(spec, tp_rank, tp_size)
    name = agent_name or f"{engine_id}-r{tp_rank}"
    digest, facts = fingerprint(spec)
    addresses = tuple(0x1000_0000 * (i + 1) for i in range(len(layout.region_bytes)))
    return WorkerHandshake(
        PROTOCOL_VERSION, engine_id, tp_rank, tp_size, name, name.encode(), addresses, layout,
        digest, dict(facts), backends=backends,
    )  # fmt: skip


class SideChannels:
    """The fetch double: port -> {remote rank: handshake}; records calls and their threads."""

    def __init__(self) -> None:
        self.served: dict[int, dict[int, WorkerHandshake]] = {}
        self.calls: list[tuple[int, int]] = []
        self.threads: set[int] = set()
        self.gate = threading.Event()  # fetches wait for it; tests clear it to stall them
        self.gate.set()

    def serve(self, engine_id: str, tp_size: int, port: int = PREFILL_PORT, **kwargs: Any) -> None:
        self.served[port] = {
            rank: remote_handshake(engine_id, rank, tp_size, **kwargs) for rank in range(tp_size)
        }

    def __call__(self, host: str, port: int, tp_rank: int) -> WorkerHandshake:
        self.gate.wait(5.0)
        self.calls.append((port, tp_rank))
        self.threads.add(threading.get_ident())
        if port not in self.served:
            raise HandshakeError(f"side channel {host}:{port} did not answer (connection refused)")
        return self.served[port][tp_rank]


class LeaseChecks:
    """The lease-check double: prefill's answer per remote request id (held unless set in
    ``answers``: False, or an exception to raise); records each check and its thread."""

    def __init__(self) -> None:
        # an answer, or a callable asked for it at each check (e.g. a real LeaseTable's)
        self.answers: dict[str, bool | Staging | Exception | Callable[[], Any]] = {}
        self.checked: list[tuple[str, str, str]] = []  # (remote request id, lease id, boot id)
        self.threads: set[str] = set()
        self.gate = threading.Event()  # checks wait for it; tests clear it to stall them
        self.gate.set()

    def __call__(self, remote: RemoteSource) -> bool | Staging:
        self.gate.wait(5.0)
        self.checked.append((remote.remote_request_id, remote.lease_id, remote.boot_id))
        self.threads.add(threading.current_thread().name)
        answer = self.answers.get(remote.remote_request_id, True)
        if callable(answer):
            answer = answer()
        if isinstance(answer, Exception):
            raise answer
        return answer


def source(
    request_id: str = "p-req", *, engine_id: str = "p", tp_size: int = 1, port: int = PREFILL_PORT,
    block_ids: tuple[tuple[int, ...], ...] = ((2, 3),), lease_id: str = LEASE_ID,
    boot_id: str = BOOT_ID,
) -> RemoteSource:  # fmt: skip
    return RemoteSource(
        engine_id, "127.0.0.1", port, tp_size, request_id, block_ids, boot_id=boot_id,
        lease_id=lease_id,
    )  # fmt: skip


def load(request_id: str, remote: RemoteSource, local_ids: tuple[int, ...] = (0, 1)) -> LoadSpec:
    return LoadSpec(request_id, (local_ids,), num_tokens=8, num_cached_tokens=0, source=remote)


class Rig:
    """One decode rank with a recording agent and the side-channel double."""

    def __init__(
        self,
        *,
        spec: KVCacheSpec = BASE,
        tp_rank: int = 0,
        tp_size: int = 1,
        config: ConnectorConfig = CONFIG,
    ) -> None:
        self.clock = Clock()
        self.channels = SideChannels()
        self.leases = LeaseChecks()
        self.agent = RecordingAgent(f"decode-r{tp_rank}")
        self.worker = WorkerConnector(
            config, engine_id="decode", tp_rank=tp_rank, tp_size=tp_size, spec=spec,
            agent=self.agent, clock=self.clock, fetch=self.channels, lease_check=self.leases,
        )  # fmt: skip
        num_regions = len(build_rank_layout(spec, tp_rank, tp_size).region_bytes)
        self.worker.register_kv_caches([0x100_0000 * (i + 1) for i in range(num_regions)])
        self.finished: list[str] = []
        self.failed: dict[str, str] = {}  # request id -> the failure's message
        self.failed_kinds: dict[str, FailureKind] = {}  # request id -> its kind

    def step(self, **metadata: Any) -> None:
        self.worker.start_load_kv(ConnectorMetadata(**metadata))
        assert self.worker.flush()  # the pass that applies it, as the engine step would see
        self.collect()

    def collect(self) -> WorkerReport:
        assert self.worker.flush()  # one more pass of the transfer thread, then its report
        report = self.worker.get_finished()
        for request_id in [*report.finished_recving, *report.failed_recving]:
            assert request_id not in self.finished and request_id not in self.failed, request_id
        self.finished.extend(report.finished_recving)
        for request_id, failure in report.failed_recving.items():
            self.failed[request_id] = failure.message
            self.failed_kinds[request_id] = failure.kind
        return report

    def until(self, condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
        """Collect reports until ``condition`` holds (handshakes run on a real thread)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "condition not reached"
            self.collect()
            threading.Event().wait(0.002)

    def reported(self, request_id: str) -> bool:
        return request_id in self.finished or request_id in self.failed

    def finish_reads(self) -> None:
        for read in self.agent.reads:
            read.state = TransferState.DONE

    def close(self) -> None:
        self.worker.shutdown()


@pytest.fixture
def rig() -> Any:
    rig = Rig()
    yield rig
    rig.close()


def test_register_rejects_wrong_region_count() -> None:
    worker = WorkerConnector(
        CONFIG, engine_id="d", tp_rank=0, tp_size=1, spec=BASE, agent=RecordingAgent("a"),
        fetch=SideChannels(), lease_check=LeaseChecks(),
    )  # fmt: skip
    try:
        with pytest.raises(UnsupportedConfiguration, match="call register_kv_caches first"):
            worker.get_handshake_metadata()
        with pytest.raises(UnsupportedConfiguration, match="got 1 region addresses, but .* has 2"):
            worker.register_kv_caches([0x1000])
    finally:
        worker.shutdown()


def test_handshake_metadata_describes_registered_memory(rig: Rig) -> None:
    handshake = rig.worker.get_handshake_metadata()
    assert handshake.agent_name == "decode-r0" and handshake.agent_metadata == b"decode-r0"
    assert rig.agent.regions == list(
        zip(handshake.region_addresses, handshake.layout.region_bytes, strict=True)
    )
    assert (handshake.fingerprint, handshake.compat_facts) == tuple(fingerprint(BASE))


def test_one_handshake_per_engine_shared_by_its_requests(rig: Rig) -> None:
    rig.channels.serve("p", 1)
    rig.channels.serve("q", 1, port=PREFILL_PORT + 1)
    other = source("q-req", engine_id="q", port=PREFILL_PORT + 1)
    rig.step(loads=(load("a", source("pa")), load("b", source("pb")), load("c", other)))
    rig.until(lambda: len(rig.agent.reads) == 3)
    assert sorted(rig.channels.calls) == [(PREFILL_PORT, 0), (PREFILL_PORT + 1, 0)]
    assert [read.notif for read in rig.agent.reads] == [b""] * 3  # none rides a READ
    assert rig.finished == [] and rig.agent.sent == []
    checked = [("pa", "l1", "b1"), ("pb", "l1", "b1"), ("q-req", "l1", "b1")]
    assert sorted(rig.leases.checked) == checked  # each lease held before its READs
    rig.finish_reads()
    rig.until(lambda: len(rig.finished) == 3)
    assert sorted(rig.finished) == ["a", "b", "c"] and rig.failed == {}
    assert all(read.released for read in rig.agent.reads)
    assert sorted(rig.leases.checked) == sorted(checked * 2)  # and after them: the proof
    assert sorted(rig.agent.sent) == [
        ("p-r0", b"pa@l1:1"), ("p-r0", b"pb@l1:1"), ("q-r0", b"q-req@l1:1"),
    ]  # fmt: skip


def test_the_engine_thread_never_calls_nixl_between_registration_and_shutdown(rig: Rig) -> None:
    """Threading contract (worker/connector.py): after register_kv_caches, only the rank's
    transfer thread calls the agent; start_load_kv and get_finished only hand work over."""
    engine = threading.current_thread().name
    rig.channels.serve("p", 1)
    rig.step(loads=(load("a", source()),), sends=("s",))
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.until(lambda: rig.reported("a"))
    calls = list(rig.agent.calls)
    first_transfer_call = next(i for i, (_, name) in enumerate(calls) if name != engine)
    assert [method for method, _ in calls[:first_transfer_call]] == [
        "register_regions",
        "get_agent_metadata",
    ]
    hot_path = calls[first_transfer_call:]
    assert {name for _, name in hot_path} == {"nixl-pd-transfer-r0"}
    by_index = {"prepare_list", "make_prepped_read"}  # an 8-token request of whole blocks
    assert {"add_remote_agent", *by_index, "post", "check", "release", "get_new_notifs"} <= {
        method for method, _ in hot_path
    }
    assert rig.channels.threads and threading.get_ident() not in rig.channels.threads
    assert rig.leases.threads and all(name.startswith("lease") for name in rig.leases.threads)
    rig.close()
    assert not any(t.name == "nixl-pd-transfer-r0" for t in threading.enumerate())
    assert {name for _, name in rig.agent.calls[len(calls) :]} <= {engine}


def break_metadata(rig: Rig) -> None:
    rig.agent.broken_metadata = True
    rig.channels.serve("p", 1)


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        pytest.param(lambda r: None, r"handshake with prefill engine p failed: .*connection refused", id="nobody-listening"),
        pytest.param(lambda r: r.channels.serve("p", 1, spec=make_spec(model="other")), r"not compatible: model: local 'tiny', remote 'other'", id="compat-mismatch"),
        pytest.param(lambda r: r.channels.serve("p-restarted", 1), r"belongs to engine 'p-restarted'.*restarted", id="peer-restarted-new-engine-id"),
        pytest.param(break_metadata, r"corrupt metadata", id="corrupt-agent-metadata"),
        pytest.param(lambda r: r.channels.serve("p", 1, backends=("LIBFABRIC",)), r"no NIXL backend in common: this rank has \['UCX'\], the peer \['LIBFABRIC'\]", id="no-common-backend"),
    ],
)  # fmt: skip
def test_handshake_problems_fail_every_request_of_that_peer(
    rig: Rig, setup: Callable[[Rig], None], match: str
) -> None:
    setup(rig)
    rig.step(loads=(load("a", source("pa")), load("b", source("pb"))))
    rig.until(lambda: rig.reported("a") and rig.reported("b"))
    assert rig.finished == [] and sorted(rig.failed) == ["a", "b"]
    for reason in rig.failed.values():
        assert re.search(match, reason), reason
    assert rig.agent.reads == []


def test_unpairable_tp_fails_without_handshake(rig: Rig) -> None:
    rig.step(loads=(load("a", source(tp_size=3)),))
    assert list(rig.failed) == ["a"]
    assert "4 KV heads cannot be split over tensor-parallel size 3" in rig.failed["a"]
    assert rig.channels.calls == []


@pytest.mark.parametrize(
    ("make_failure", "match"),
    [
        pytest.param("bad-block-ids", r"cannot plan the transfer: group 0: .* needs 2 blocks", id="plan-error"),
        pytest.param("read-error", r"READ from prefill engine p rank 0 failed: peer gone", id="read-error"),
        pytest.param("read-timeout", r"rank 0 did not finish within 30.0 s", id="read-timeout"),
    ],
)  # fmt: skip
def test_transfer_problems_fail_only_their_request(rig: Rig, make_failure: str, match: str) -> None:
    rig.channels.serve("p", 1)
    bad_ids = (0, 1, 2) if make_failure == "bad-block-ids" else (0, 1)
    rig.step(loads=(load("bad", source("p-bad"), bad_ids), load("good", source("p-good"), (4, 5))))
    num_reads = 1 if make_failure == "bad-block-ids" else 2  # loads post in order: bad, good
    rig.until(lambda: len(rig.agent.reads) == num_reads)
    bad_read = rig.agent.reads[0] if num_reads == 2 else None
    good_read = rig.agent.reads[-1]
    good_read.state = TransferState.DONE
    if make_failure == "read-error":
        assert bad_read is not None
        bad_read.error = "peer gone"
    if make_failure == "read-timeout":
        rig.clock.now_s += 31.0
        rig.until(lambda: rig.reported("good"))
        for _ in range(3):  # quarantined: not reported while its READ may still land
            rig.step()
        assert not rig.reported("bad") and bad_read is not None and not bad_read.released
        bad_read.state = TransferState.DONE  # the backend says it ended: now it is reported
    rig.until(lambda: rig.reported("good") and rig.reported("bad"))
    assert rig.finished == ["good"] and list(rig.failed) == ["bad"]
    assert re.search(match, rig.failed["bad"]), rig.failed["bad"]
    # Checked before the READs; after them, only the load whose READs all landed.
    checked = sorted(checked[0] for checked in rig.leases.checked)
    assert checked == ["p-bad", "p-good", "p-good"]
    # Both prefill requests hear they may free their blocks: the failed one too.
    assert sorted(rig.agent.sent) == [("p-r0", b"p-bad@l1:1"), ("p-r0", b"p-good@l1:1")]


def test_agent_bug_fails_only_that_request_once_its_read_cannot_land(rig: Rig) -> None:
    rig.channels.serve("p", 1)
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.agent.reads[0].error = None
    rig.agent.check = None  # type: ignore[assignment, method-assign]  # calling it: TypeError
    # The READ's state cannot be known: its blocks stay held, the load unreported (reporting
    # it would hand decode's blocks back under a READ that may still land).
    with pytest.raises(AssertionError, match="condition not reached"):
        rig.until(lambda: rig.reported("a"), timeout_s=0.5)
    del rig.agent.check  # the agent answers again: the READ is still running, then ends
    rig.finish_reads()
    # reported once its READ ended and the lease check posted alongside it answered (a thread
    # of its own: under load, after more than one pass); collect() asserts "once"
    rig.until(lambda: rig.reported("a"))
    rig.collect()
    assert list(rig.failed) == ["a"] and rig.failed["a"].startswith("internal error: TypeError")
    rig.step(loads=(load("b", source("pb")),))  # the engine keeps serving the next request
    rig.until(lambda: len(rig.agent.reads) == 2)  # posted once its lease check answered
    rig.finish_reads()
    rig.until(lambda: rig.reported("b"))
    assert rig.finished == ["b"]


def test_peer_restart_under_same_engine_id_rehandshakes(rig: Rig) -> None:
    rig.channels.serve("p", 1)
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.agent.reads[0].error = "remote disconnected"
    rig.collect()
    assert "remote disconnected" in rig.failed["a"]
    rig.channels.serve("p", 1, agent_name="p-r0-restarted")
    rig.step(loads=(load("b", source("pb")),))
    rig.until(lambda: len(rig.agent.reads) == 2)
    assert rig.agent.reads[1].remote_agent == "p-r0-restarted"
    assert rig.agent.remotes == {"p-r0-restarted"}  # the dead peer's agent was removed
    rig.finish_reads()
    rig.until(lambda: rig.reported("b"))
    assert rig.finished == ["b"] and rig.channels.calls == [(PREFILL_PORT, 0)] * 2


def test_a_failed_notification_to_a_restarted_peer_rehandshakes() -> None:
    """Prefill restarted under the same engine id and port (issue 25), and decode checks every
    lease before its READs (lease_precheck_skip 0): a load naming the old boot fails at its
    lease check before any READ, and its free notification cannot reach the old agent; like a
    failed READ, that retires the peer, so the next load (the new boot's params) handshakes
    anew instead of reading from the dead agent."""
    rig = Rig(config=msgspec.structs.replace(CONFIG, lease_precheck_skip_s=0.0))
    try:
        _restart_prefill_after_load_a(rig)
        rig.step(loads=(load("b", source("pb")),))
        rig.until(lambda: rig.reported("b"))
        assert rig.failed["b"].startswith("lease expired") and len(rig.agent.reads) == 1
        _load_c_reads_from_the_new_boot(rig, read_index=1)
    finally:
        rig.close()


def test_a_read_from_a_restarted_peer_fails_and_rehandshakes(rig: Rig) -> None:
    """The same restart with the default lease_precheck_skip: prefill's side channel answered
    a check moments ago, so load b posts its READs at once; the old boot's agent is gone and
    the READ fails (as real NIXL fails it: the remote agent disconnected), which retires the
    peer, so load c handshakes anew and reads from the new boot."""
    _restart_prefill_after_load_a(rig)
    rig.step(loads=(load("b", source("pb")),))
    rig.until(lambda: rig.reported("b"))
    assert re.match(r"READ from prefill engine p rank 0 failed: posting a READ", rig.failed["b"])
    assert len(rig.agent.reads) == 2 and rig.agent.reads[1].remote_agent == "p-r0"
    _load_c_reads_from_the_new_boot(rig, read_index=2)


def _restart_prefill_after_load_a(rig: Rig) -> None:
    rig.channels.serve("p", 1)
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.until(lambda: rig.reported("a"))
    rig.agent.dead.add("p-r0")  # the old boot died; the new one serves the same address
    rig.channels.serve("p", 1, agent_name="p-r0-restarted")
    rig.leases.answers["pb"] = PeerRestarted("side channel 127.0.0.1:7001 is boot b2")


def _load_c_reads_from_the_new_boot(rig: Rig, read_index: int) -> None:
    rig.step(loads=(load("c", source("pc", boot_id="b2")),))
    rig.until(lambda: len(rig.agent.reads) == read_index + 1)
    assert rig.agent.reads[read_index].remote_agent == "p-r0-restarted"
    rig.finish_reads()
    rig.until(lambda: rig.reported("c"))
    assert rig.finished == ["a", "c"] and rig.channels.calls == [(PREFILL_PORT, 0)] * 2


def _load_a_proven(rig: Rig) -> None:
    """Load a, checked before and after its READs: prefill's side channel was just heard."""
    rig.channels.serve("p", 1)
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.until(lambda: rig.reported("a"))
    assert [checked[0] for checked in rig.leases.checked] == ["pa", "pa"]


def test_a_load_to_a_side_channel_heard_recently_posts_its_reads_before_any_check(
    rig: Rig,
) -> None:
    _load_a_proven(rig)
    rig.leases.gate.clear()  # a check now would stall: b must not need one to post
    rig.step(loads=(load("b", source("pb")),))
    rig.until(lambda: len(rig.agent.reads) == 2)
    assert [checked[0] for checked in rig.leases.checked] == ["pa", "pa"]
    rig.finish_reads()
    rig.leases.gate.set()
    rig.until(lambda: rig.reported("b"))
    assert rig.finished == ["a", "b"]
    assert [checked[0] for checked in rig.leases.checked] == ["pa", "pa", "pb"]  # b's proof


def test_a_load_that_skipped_the_first_check_still_fails_when_the_lease_is_gone(
    rig: Rig,
) -> None:
    """Skipping the check before the READs changes when a dead lease is noticed, not what is
    reported: the check after them fails the load, and its READs were posted for nothing."""
    _load_a_proven(rig)
    rig.leases.answers["pb"] = False
    rig.step(loads=(load("b", source("pb")),))
    rig.until(lambda: len(rig.agent.reads) == 2)
    rig.finish_reads()
    rig.until(lambda: rig.reported("b"))
    assert rig.finished == ["a"]
    assert re.match(r"lease expired: .* no longer held when this rank's READs", rig.failed["b"])


def _staged_lease(request_id: str) -> tuple[LeaseTable, Callable[[], Any]]:
    """A holder's real lease table with ``request_id`` leased under host staging (not
    readable until copy_done), and the answer its side channel gives this rig's checks."""
    table = LeaseTable(60.0)
    table.lease(request_id, 0.0, LEASE_ID, 60.0)
    table.await_copy(request_id)
    return table, lambda: answers(table.check([LeaseRef(request_id, LEASE_ID)], 1.0))[0]


def test_a_load_that_skipped_the_first_check_fails_on_a_staged_lease_ready_after_its_reads(
    rig: Rig,
) -> None:
    """The proof after the READs is not enough for a lease that was not readable at first
    (a host-staged hold): load b skipped the check before its READs (prefill was heard
    moments ago), READ while the holder's copy was still pending, and the lease became
    readable before the proof. Held after the READs, yet b fails: nothing showed the copy
    was done before the first READ."""
    _load_a_proven(rig)
    table, answer = _staged_lease("pb")
    rig.leases.answers["pb"] = answer
    rig.step(loads=(load("b", source("pb")),))
    rig.until(lambda: len(rig.agent.reads) == 2)  # posted at once: no check before
    assert [checked[0] for checked in rig.leases.checked] == ["pa", "pa"]
    table.copy_done("pb", LEASE_ID)  # the holder's copy ends only now
    rig.finish_reads()
    rig.until(lambda: rig.reported("b"))
    assert rig.finished == ["a"]
    assert "staged copy not proven ready before the READs" in rig.failed["b"]
    assert rig.failed["b"].startswith("lease not proven")


def test_a_check_before_the_reads_waits_while_a_staged_copy_is_pending(rig: Rig) -> None:
    """A host-staged lease answers pending until its holder's copy is done: the check
    before the READs asks again (bounded) and posts nothing meanwhile; once readable the
    load reads and is proven. That side channel is then always checked before the READs."""
    rig.channels.serve("p", 1)
    table, answer = _staged_lease("pa")
    rig.leases.answers["pa"] = answer
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: len(rig.leases.checked) >= 3)  # asked again while pending
    rig.collect()
    assert rig.agent.reads == []
    table.copy_done("pa", LEASE_ID)
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.until(lambda: rig.reported("a"))
    assert rig.finished == ["a"], rig.failed
    num_checks = len(rig.leases.checked)
    rig.leases.answers["pb"] = _staged_lease("pb")[1]  # pending, and never copied
    rig.leases.gate.clear()  # b's check stalls: if b skipped it, its READs would go out
    rig.step(loads=(load("b", source("pb")),))  # a pass: a skipping load posts in it
    assert len(rig.agent.reads) == 1, "b posted READs without checking a staging holder"
    rig.leases.gate.set()
    rig.until(lambda: len(rig.leases.checked) > num_checks)
    rig.worker.start_load_kv(ConnectorMetadata(releases=(ReleaseSpec("b", source("pb")),)))
    rig.until(lambda: rig.reported("b"), timeout_s=15.0)


def test_a_staged_copy_pending_past_its_bound_fails_the_load_before_any_read(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease_proof, "STAGED_WAIT_S", 0.05)
    rig.channels.serve("p", 1)
    rig.leases.answers["pa"] = _staged_lease("pa")[1]
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: rig.reported("a"))
    assert rig.agent.reads == []
    assert re.match(r"lease not proven: .* copy was not done within 0.05 s", rig.failed["a"])


def test_a_side_channel_not_heard_within_the_window_is_checked_before_the_reads(
    rig: Rig,
) -> None:
    _load_a_proven(rig)
    rig.clock.now_s += CONFIG.lease_precheck_skip_s + 0.1
    rig.leases.answers["pb"] = False
    rig.step(loads=(load("b", source("pb")),))
    rig.until(lambda: rig.reported("b"))
    assert len(rig.agent.reads) == 1  # refused before any READ
    assert re.match(r"lease expired: .* no longer held before any READ", rig.failed["b"])


def test_a_side_channel_that_did_not_answer_is_not_heard(rig: Rig) -> None:
    """Only an answer counts: after a check that failed (silent side channel), the next load
    to that prefill is checked before its READs."""
    rig.channels.serve("p", 1)
    rig.leases.answers["pa"] = HandshakeError("side channel 127.0.0.1:7001 did not answer")
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: rig.reported("a"))
    rig.leases.answers["pb"] = False
    rig.step(loads=(load("b", source("pb")),))
    rig.until(lambda: rig.reported("b"))
    assert rig.agent.reads == [] and "before any READ" in rig.failed["b"]


def test_another_boot_of_a_side_channel_heard_recently_is_checked_first(rig: Rig) -> None:
    _load_a_proven(rig)
    rig.leases.answers["pb"] = PeerRestarted("side channel 127.0.0.1:7001 is boot b1")
    rig.step(loads=(load("b", source("pb", boot_id="b0")),))  # params of an older boot
    rig.until(lambda: rig.reported("b"))
    assert len(rig.agent.reads) == 1 and "restarted since it leased" in rig.failed["b"]


def test_peer_restart_with_new_engine_id_replaces_the_old_peer(rig: Rig) -> None:
    rig.channels.serve("p", 1)
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.channels.serve("p-v2", 1)  # same address, new engine id and agent name
    rig.step(loads=(load("b", source("pb", engine_id="p-v2")),))
    rig.until(lambda: len(rig.agent.reads) == 2)
    # The old engine's agent goes once nothing holds it: a's READ landed and its lease proven.
    rig.until(lambda: rig.agent.remotes == {"p-v2-r0"})
    assert rig.agent.reads[1].remote_agent == "p-v2-r0"
    rig.finish_reads()
    rig.until(lambda: rig.reported("b"))
    assert rig.finished == ["a", "b"]


def test_compat_mismatch_tolerated_when_not_enforced() -> None:
    config = ConnectorConfig(handshake_retries=0, enforce_handshake_compat=False)
    rig = Rig(config=config)
    try:
        rig.channels.serve("p", 1, spec=make_spec(model="other"))
        rig.step(loads=(load("a", source()),))
        rig.until(lambda: bool(rig.agent.reads))
        rig.finish_reads()
        rig.until(lambda: rig.reported("a"))
        assert rig.finished == ["a"]
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("prefill_spec", "match"),
    [
        pytest.param(make_spec(), r"cache_dtype: local 'fp8', remote 'bfloat16'", id="cache-dtype"),
        pytest.param(make_spec(cache_dtype="fp8", kv_scales=((0.5, 1.0), (0.5, 0.25))), r"group0.k_scale: local '1.0,0.5', remote '0.5'", id="k-scale"),
    ],
)  # fmt: skip
def test_fp8_peer_with_other_dtype_or_scales_never_loads(
    prefill_spec: KVCacheSpec, match: str
) -> None:
    """Two ranks whose cache bytes mean different values: refused at handshake with both
    values, even with enforce_handshake_compat off, and nothing is read."""
    config = ConnectorConfig(handshake_retries=0, enforce_handshake_compat=False)
    rig = Rig(spec=FP8, config=config)
    try:
        rig.channels.serve("p", 1, spec=prefill_spec)
        rig.step(loads=(load("a", source()),))
        rig.until(lambda: rig.reported("a"))
        assert rig.finished == [] and re.search(match, rig.failed["a"]), rig.failed
        assert rig.agent.reads == []
    finally:
        rig.close()


def test_abort_while_handshaking_notifies_and_reports_aborted(rig: Rig) -> None:
    rig.channels.serve("p", 1)
    rig.channels.gate.clear()  # hold the handshake mid-flight
    rig.step(loads=(load("a", source("pa")),))
    rig.step(releases=(ReleaseSpec("a", source("pa")),))
    assert not rig.reported("a")
    rig.channels.gate.set()
    rig.until(lambda: rig.reported("a"))
    assert rig.failed == {"a": "aborted"} and rig.agent.reads == []
    assert rig.agent.sent == [("p-r0", b"pa@l1:1")]
    assert len(rig.leases.checked) <= 1  # at most the check begun with the load, never a proof


@pytest.mark.parametrize("read_outcome", ["done", "error"], ids=["read-completes", "read-fails"])
def test_abort_mid_transfer_waits_for_the_read_then_notifies_without_a_proof(
    rig: Rig, read_outcome: str
) -> None:
    rig.channels.serve("p", 1)
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.step(releases=(ReleaseSpec("a", source("pa")),))
    rig.step()
    assert not rig.reported("a") and rig.agent.sent == []  # blocks stay held under the READ
    if read_outcome == "done":
        rig.finish_reads()
    else:
        rig.agent.reads[0].error = "gone"
    rig.collect()
    assert rig.failed == {"a": "aborted"} and rig.agent.sent == [("p-r0", b"pa@l1:1")]
    assert rig.leases.checked == [("pa", "l1", "b1")]  # before the READs; no proof when aborted


def test_abort_before_load_and_after_report(rig: Rig) -> None:
    rig.channels.serve("p", 1)
    rig.step(releases=(ReleaseSpec("never-loaded", source("p1")),))
    rig.until(lambda: rig.reported("never-loaded"))
    assert rig.failed == {"never-loaded": "aborted"} and rig.agent.sent == [("p-r0", b"p1@l1:1")]
    rig.step(loads=(load("done", source("p2")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.until(lambda: rig.reported("done"))
    rig.step(releases=(ReleaseSpec("done", source("p2")),))
    rig.collect()
    assert rig.finished == ["done"] and list(rig.failed) == ["never-loaded"]


def test_mla_reads_one_rank_and_notifies_the_other_with_prefill_id() -> None:
    mla = make_spec(kind=GroupKind.MLA, num_kv_heads=1)
    rig = Rig(spec=mla)
    try:
        rig.channels.serve("p", 2, spec=mla)
        rig.step(loads=(load("decode-id", source("prefill-id", tp_size=2)),))
        rig.until(lambda: bool(rig.agent.reads))
        assert [(r.remote_agent, r.notif) for r in rig.agent.reads] == [("p-r0", b"")]
        assert rig.agent.sent == []  # neither rank hears before the lease is proven
        rig.finish_reads()
        rig.until(lambda: rig.reported("decode-id"))
        assert rig.finished == ["decode-id"]
        assert rig.agent.sent == [("p-r0", b"prefill-id@l1:1"), ("p-r1", b"prefill-id@l1:1")]
    finally:
        rig.close()


def test_prefill_rank_reports_sends_once_and_shrugs_off_bad_notifications(rig: Rig) -> None:
    rig.step(sends=("p1", "p2"))
    rig.agent.inbox = {"d0": [b"p1:2", b"p1:2", b"junk", b"ghost:1"], "d1": [b"p1:2", b"p2:1"]}
    assert sorted(rig.collect().finished_sending) == ["p1", "p2"]
    rig.agent.inbox = {"d2": [b"p1:2"]}
    assert rig.collect().finished_sending == ()
    rig.step(sends=("p3",), forgotten=("p3",))
    rig.agent.inbox = {"d0": [b"p3:1"]}
    assert rig.collect().finished_sending == ()


def test_transfer_thread_survives_a_failing_pass_and_stops() -> None:
    passes: list[list[int]] = []

    def step(items: list[int]) -> None:
        passes.append(items)
        if items == [1]:
            raise RuntimeError("a bug in one pass")

    thread = TransferThread("nixl-pd-transfer-test", step, busy=lambda: False)
    thread.start()
    thread.submit(1)
    assert thread.flush(5.0)
    thread.submit(2)
    assert thread.flush(5.0) and [2] in passes and thread.alive
    assert thread.stop(5.0) and not thread.alive and not thread.flush(0.1)


def test_wake_runs_a_pass_without_waiting_for_the_poll() -> None:
    passes: list[list[int]] = []
    ran = threading.Event()

    def step(items: list[int]) -> None:
        passes.append(items)
        ran.set()

    # Polls far apart: only wake() (or submit) can start the second pass within the test.
    thread = TransferThread("nixl-pd-transfer-test", step, busy=lambda: True,
                            busy_poll_s=60.0, idle_poll_s=60.0)  # fmt: skip
    thread.start()
    try:
        assert ran.wait(5.0)  # the first pass runs at start
        ran.clear()
        thread.wake()
        assert ran.wait(5.0) and passes == [[], []]
    finally:
        assert thread.stop(5.0)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_plan_memory_stays_mapped_on_glibc() -> None:
    assert keep_plan_memory_mapped()


# --- reads by index from prepared lists (worker/plan/whole_blocks.py, worker/reads.py) --------------------------

FRAGMENTED = make_spec(num_layers=8, num_blocks=256)  # 16 planes: many ranges when fragmented


def _fragmented_load(request_id: str, remote_id: str, *, num_tokens: int) -> LoadSpec:
    num_blocks = -(-num_tokens // 4)
    local_ids = tuple(range(0, 2 * num_blocks, 2))  # every other block: no two runs join
    remote_ids = tuple(range(255, 255 - 3 * num_blocks, -3))
    remote = source(remote_id, block_ids=(remote_ids,))
    return LoadSpec(request_id, (local_ids,), num_tokens, 0, remote)


def test_fragmented_whole_blocks_go_in_one_read_by_index_and_the_notification_after() -> None:
    rig = Rig(spec=FRAGMENTED)
    rig.channels.serve("p", 1, spec=FRAGMENTED)
    rig.step(loads=(_fragmented_load("a", "pa", num_tokens=4 * 64),))
    rig.until(lambda: bool(rig.agent.reads))
    [read] = rig.agent.reads
    assert read.by_index and read.notif == b"" and len(read.local) == 16 * 64
    rig.finish_reads()
    rig.until(lambda: rig.reported("a"))
    assert rig.finished == ["a"] and rig.agent.sent == [("p-r0", b"pa@l1:1")]
    rig.close()


def test_a_partial_block_is_a_second_read_and_the_notification_waits_for_both() -> None:
    rig = Rig(spec=FRAGMENTED)
    rig.channels.serve("p", 1, spec=FRAGMENTED)
    rig.step(loads=(_fragmented_load("a", "pa", num_tokens=4 * 64 + 2),))
    rig.until(lambda: len(rig.agent.reads) == 2)
    by_index, by_ranges = rig.agent.reads
    assert by_index.by_index and not by_ranges.by_index
    assert by_index.notif == by_ranges.notif == b""  # neither READ may free prefill's blocks
    by_index.state = TransferState.DONE
    rig.step()
    assert rig.agent.sent == [] and not rig.reported("a")
    by_ranges.state = TransferState.DONE
    rig.until(lambda: rig.reported("a"))
    assert rig.finished == ["a"] and rig.agent.sent == [("p-r0", b"pa@l1:1")]
    rig.close()


def test_a_failed_part_fails_the_request_and_still_frees_prefill_once() -> None:
    rig = Rig(spec=FRAGMENTED)
    rig.channels.serve("p", 1, spec=FRAGMENTED)
    rig.step(loads=(_fragmented_load("a", "pa", num_tokens=4 * 64 + 2),))
    rig.until(lambda: len(rig.agent.reads) == 2)
    rig.agent.reads[0].error = "remote disconnected"
    rig.agent.reads[1].state = TransferState.DONE
    rig.until(lambda: rig.reported("a"))
    assert "remote disconnected" in rig.failed["a"]
    assert rig.agent.sent == [("p-r0", b"pa@l1:1")]
    assert all(read.released for read in rig.agent.reads)
    rig.close()


def test_prepared_lists_are_made_once_per_peer_and_freed_at_shutdown() -> None:
    rig = Rig(spec=FRAGMENTED)
    rig.channels.serve("p", 1, spec=FRAGMENTED)
    rig.step(loads=(_fragmented_load("a", "pa", num_tokens=4 * 64),))
    rig.step(loads=(_fragmented_load("b", "pb", num_tokens=4 * 64),))
    rig.until(lambda: len(rig.agent.reads) == 2)
    assert [prepared.owner for prepared in rig.agent.lists] == ["decode-r0", "p-r0"]
    rig.finish_reads()
    rig.until(lambda: rig.reported("a") and rig.reported("b"))
    rig.close()
    assert all(prepared.released for prepared in rig.agent.lists)


def test_a_retired_peers_lists_are_freed_once_it_is_idle_and_a_new_peer_prepares_again() -> None:
    rig = Rig(spec=FRAGMENTED)
    rig.channels.serve("p", 1, spec=FRAGMENTED)
    rig.step(loads=(_fragmented_load("a", "pa", num_tokens=4 * 64),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.agent.reads[0].error = "remote disconnected"  # the peer retires; its lists drain
    rig.until(lambda: rig.reported("a"))
    rig.collect()
    assert [(p.owner, p.released) for p in rig.agent.lists] == [
        ("decode-r0", True),
        ("p-r0", True),
    ]
    rig.step(loads=(_fragmented_load("b", "pb", num_tokens=4 * 64),))  # a fresh handshake
    rig.until(lambda: len(rig.agent.reads) == 2)
    assert [p.released for p in rig.agent.lists] == [True, True, False, False]
    rig.finish_reads()
    rig.until(lambda: rig.reported("b"))
    assert rig.finished == ["b"]
    rig.close()
