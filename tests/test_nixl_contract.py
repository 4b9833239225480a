"""The NixlAgent contract, held by FakeNixl and real NIXL alike, and real NIXL across processes.

Real-NIXL agents are created sparingly (the first in a process costs ~0.43 s): one reader and
one owner per module, plus a fresh agent only where a test must close or forget one.
FakeNixl's own features (fault injection) are tested in test_fake_nixl.py.
"""

from __future__ import annotations

import gc
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from connector.errors import HandshakeError, TransferFailed
from tests.nixl_peer_proc import PeerProcess, pattern
from worker.fake import FakeFabric, FakeNixl
from worker.nixl_api import Descriptors, NixlAgent, TransferState

OWNER_BYTES = 64 * 1024  # the owner's (prefill's) registered pattern
READER_BYTES = 32 * 1024  # the reader's (decode's) registered buffer
READER_FILL = 0xAB  # what the reader's buffer holds where no READ wrote
TIMEOUT_S = 5.0

AgentFactory = Callable[[str], NixlAgent]


def descriptors(rows: list[tuple[int, int]], base: int) -> Descriptors:
    """(offset_bytes, length_bytes) rows -> (N, 3) descriptors at ``base`` on device 0."""
    return np.array([(base + offset, length, 0) for offset, length in rows], dtype=np.int64)


def run_read(agent: NixlAgent, transfer: object) -> None:
    """Post a READ and poll it to completion (bounded)."""
    deadline = time.monotonic() + TIMEOUT_S
    state = agent.post(transfer)
    while state is TransferState.IN_PROGRESS:
        assert time.monotonic() < deadline, f"READ still in progress after {TIMEOUT_S} s"
        state = agent.check(transfer)


def wait_notifs(agent: NixlAgent) -> dict[str, list[bytes]]:
    """The first non-empty batch of notifications (bounded)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        notifs = agent.get_new_notifs()
        if notifs:
            return notifs
        time.sleep(0.001)  # real NIXL: let its progress thread run on this 2-core box
    raise AssertionError(f"no notification within {TIMEOUT_S} s")


@pytest.fixture(scope="module", params=["fake", pytest.param("real", marks=pytest.mark.real_nixl)])
def new_agent(request: pytest.FixtureRequest) -> Iterator[AgentFactory]:
    """Makes agents of one implementation with fresh names; closes them all at the end."""
    fabric = FakeFabric()
    created: list[NixlAgent] = []

    def make(role: str) -> NixlAgent:
        name = f"{role}-{uuid.uuid4().hex[:8]}"
        if request.param == "fake":
            agent: NixlAgent = FakeNixl(name, fabric)
        else:
            from worker.nixl_real import RealNixlAgent

            agent = RealNixlAgent(name)
        created.append(agent)
        return agent

    yield make
    for agent in created:
        agent.close()


@dataclass
class World:
    """A reader that has loaded the owner's metadata, each with one registered buffer."""

    reader: NixlAgent
    owner: NixlAgent
    reader_buffer: np.ndarray
    owner_buffer: np.ndarray

    @property
    def reader_base(self) -> int:
        return int(self.reader_buffer.ctypes.data)

    @property
    def owner_base(self) -> int:
        return int(self.owner_buffer.ctypes.data)


@pytest.fixture(scope="module")
def module_world(new_agent: AgentFactory) -> Iterator[World]:
    """Registered once per module: real NIXL never forgets a peer region it has loaded (a
    deregistered one stays readable), so per-test buffers would pile up stale regions."""
    reader, owner = new_agent("reader"), new_agent("owner")
    world = World(reader, owner, np.empty(READER_BYTES, np.uint8), np.empty(OWNER_BYTES, np.uint8))
    reader_registration = reader.register_regions([(world.reader_base, READER_BYTES)])
    owner_registration = owner.register_regions([(world.owner_base, OWNER_BYTES)])
    # Metadata exported after registering: a reader only knows regions its metadata described.
    reader.add_remote_agent(owner.get_agent_metadata())
    yield world
    reader.deregister(reader_registration)
    owner.deregister(owner_registration)


@pytest.fixture
def world(module_world: World) -> World:
    module_world.reader_buffer[:] = READER_FILL
    module_world.owner_buffer[:] = pattern(OWNER_BYTES, 7)
    module_world.reader.get_new_notifs()
    module_world.owner.get_new_notifs()
    return module_world


# (remote offset_bytes, local offset_bytes, length_bytes) per descriptor
READ_PATTERNS = {
    "one descriptor": [(0, 0, 4096)],
    "scattered, out of order": [(40000, 0, 1000), (0, 5000, 512), (8192, 20000, 3000)],
    "adjacent runs": [(4096, 0, 4096), (8192, 4096, 4096), (12288, 8192, 100)],
    "64 tiny descriptors": [(i * 1000, i * 16, 16) for i in range(64)],
    "last byte of both regions": [(OWNER_BYTES - 1, READER_BYTES - 1, 1)],
}


@pytest.mark.parametrize("rows", READ_PATTERNS.values(), ids=READ_PATTERNS.keys())
def test_read_lands_exactly_the_described_bytes(
    world: World, rows: list[tuple[int, int, int]]
) -> None:
    expected = world.reader_buffer.copy()
    for remote_offset, local_offset, length in rows:
        source = world.owner_buffer[remote_offset : remote_offset + length]
        expected[local_offset : local_offset + length] = source
    owner_before = world.owner_buffer.copy()

    transfer = world.reader.make_read(
        world.owner.name,
        descriptors([(local, length) for _, local, length in rows], world.reader_base),
        descriptors([(remote, length) for remote, _, length in rows], world.owner_base),
    )
    run_read(world.reader, transfer)
    world.reader.release(transfer)

    np.testing.assert_array_equal(world.reader_buffer, expected)
    np.testing.assert_array_equal(world.owner_buffer, owner_before)


def test_read_notification_arrives_after_the_data_with_exact_bytes(world: World) -> None:
    message = b"prefill-req-\x00\xff:2"
    transfer = world.reader.make_read(
        world.owner.name,
        descriptors([(0, 2048)], world.reader_base),
        descriptors([(1024, 2048)], world.owner_base),
        notif=message,
    )
    state = world.reader.post(transfer)
    deadline = time.monotonic() + TIMEOUT_S
    while not (notifs := world.owner.get_new_notifs()):
        assert time.monotonic() < deadline, "no notification for the READ"
        if state is TransferState.IN_PROGRESS:
            state = world.reader.check(transfer)
    # The owner heard of the READ: its bytes must already be in the reader's memory.
    np.testing.assert_array_equal(world.reader_buffer[:2048], world.owner_buffer[1024:3072])
    assert notifs == {world.reader.name: [message]}
    while state is TransferState.IN_PROGRESS:
        state = world.reader.check(transfer)
    world.reader.release(transfer)


def test_send_notif_alone_delivers_exact_bytes_once(world: World) -> None:
    world.reader.send_notif(world.owner.name, b"req-1:1")
    world.reader.send_notif(world.owner.name, b"req-2:3")

    received: list[bytes] = []
    while len(received) < 2:
        received += wait_notifs(world.owner)[world.reader.name]

    assert received == [b"req-1:1", b"req-2:3"]
    assert world.owner.get_new_notifs() == {}


# Each case: (remote agent or None for the owner, local rows, remote rows) as (offset, length).
BAD_READS = {
    "remote descriptor past the owner's region": (
        None, [(0, 200)], [(OWNER_BYTES - 100, 200)], "outside the memory registered",
    ),
    "local descriptor past the reader's region": (
        None, [(READER_BYTES - 100, 200)], [(0, 200)], "outside the memory registered",
    ),
    "unknown remote agent": (
        "nobody", [(0, 10)], [(0, 10)], "unknown remote agent 'nobody'.*Handshake first",
    ),
    "length mismatch": (
        None, [(0, 10), (10, 20)], [(0, 10), (10, 30)],
        "length mismatch at index 1: local 20 bytes vs remote 30 bytes",
    ),
    "count mismatch": (
        None, [(0, 10), (10, 10)], [(0, 10)], "count mismatch: 2 local vs 1 remote",
    ),
    "no descriptors": (None, [], [], "empty local descriptor list.*use send_notif"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("remote_agent", "local_rows", "remote_rows", "message"),
    BAD_READS.values(),
    ids=BAD_READS.keys(),
)
def test_bad_read_is_rejected_with_a_clear_message(
    world: World,
    remote_agent: str | None,
    local_rows: list[tuple[int, int]],
    remote_rows: list[tuple[int, int]],
    message: str,
) -> None:
    with pytest.raises(TransferFailed, match=message):
        world.reader.make_read(
            remote_agent or world.owner.name,
            descriptors(local_rows, world.reader_base).reshape(-1, 3),
            descriptors(remote_rows, world.owner_base).reshape(-1, 3),
        )
    np.testing.assert_array_equal(world.reader_buffer, READER_FILL)


# Prepared lists: strided rows (offset_bytes, length_bytes, stride_bytes, count) on each side.
LOCAL_ROWS = [(0, 256, 1024, 16), (512, 128, 256, 8)]  # entries 0-15, then 16-23
REMOTE_ROWS = [(4096, 256, 512, 64), (100, 128, 1000, 10)]  # entries 0-63, then 64-73


def strided(rows: list[tuple[int, int, int, int]], base: int) -> np.ndarray:
    return np.array([(base + o, n, 0, s, c) for o, n, s, c in rows], dtype=np.int64)


def entry(rows: list[tuple[int, int, int, int]], index: int) -> tuple[int, int]:
    """(offset_bytes, length_bytes) of entry ``index`` of a prepared list."""
    for offset, length, stride, count in rows:
        if index < count:
            return offset + index * stride, length
        index -= count
    raise IndexError(index)


PREPPED_READS = {
    "one entry": ([3], [10]),
    "adjacent entries, merged by NIXL or not": ([0, 1, 2], [5, 6, 7]),
    "scattered, out of order, both rows": ([15, 16, 2, 23], [63, 64, 0, 73]),
}


@pytest.mark.parametrize(("local", "remote"), PREPPED_READS.values(), ids=PREPPED_READS.keys())
def test_read_by_index_lands_exactly_the_indexed_entries(
    world: World, local: list[int], remote: list[int]
) -> None:
    expected = world.reader_buffer.copy()
    for local_index, remote_index in zip(local, remote, strict=True):
        local_offset, length = entry(LOCAL_ROWS, local_index)
        remote_offset, _ = entry(REMOTE_ROWS, remote_index)
        expected[local_offset : local_offset + length] = world.owner_buffer[
            remote_offset : remote_offset + length
        ]
    local_list = world.reader.prepare_list(None, strided(LOCAL_ROWS, world.reader_base))
    remote_list = world.reader.prepare_list(
        world.owner.name, strided(REMOTE_ROWS, world.owner_base)
    )
    transfer = world.reader.make_prepped_read(
        local_list, np.array(local), remote_list, np.array(remote), b"req:1"
    )
    run_read(world.reader, transfer)
    world.reader.release(transfer)
    world.reader.release_list(local_list)
    world.reader.release_list(remote_list)

    np.testing.assert_array_equal(world.reader_buffer, expected)
    assert wait_notifs(world.owner) == {world.reader.name: [b"req:1"]}


BAD_PREPPED = {
    "local index past the list": ([24], [0], "local index 24 is outside the prepared list of 24"),
    "negative remote index": ([0], [-1], "remote index -1 is outside the prepared list of 74"),
    "count mismatch": ([0, 1], [0], "as many local as remote indices.*2 local and 1 remote"),
    "no indices": ([], [], "at least one: got 0 local and 0 remote"),
}


@pytest.mark.parametrize(
    ("local", "remote", "message"), BAD_PREPPED.values(), ids=BAD_PREPPED.keys()
)
def test_bad_read_by_index_is_rejected_with_a_clear_message(
    world: World, local: list[int], remote: list[int], message: str
) -> None:
    local_list = world.reader.prepare_list(None, strided(LOCAL_ROWS, world.reader_base))
    remote_list = world.reader.prepare_list(
        world.owner.name, strided(REMOTE_ROWS, world.owner_base)
    )
    with pytest.raises(TransferFailed, match=message):
        world.reader.make_prepped_read(
            local_list,
            np.array(local, dtype=np.int64),
            remote_list,
            np.array(remote, dtype=np.int64),
        )
    with pytest.raises(TransferFailed, match="local side and a remote agent's|wrong side"):
        world.reader.make_prepped_read(local_list, np.array([0]), local_list, np.array([0]))
    world.reader.release_list(local_list)
    world.reader.release_list(remote_list)
    np.testing.assert_array_equal(world.reader_buffer, READER_FILL)


@pytest.mark.parametrize(
    ("owner", "rows", "message"),
    [
        ("nobody", [(0, 8, 8, 1)], "unknown remote agent 'nobody'"),
        (None, [(0, 0, 8, 1)], "positive length_bytes, stride_bytes and count"),
        (None, [], r"expected \(M, 5\) rows"),
    ],
    ids=["unknown owner", "zero length", "no rows"],
)
def test_bad_prepared_list_is_rejected(
    world: World, owner: str | None, rows: list[tuple[int, int, int, int]], message: str
) -> None:
    with pytest.raises(TransferFailed, match=message):
        world.reader.prepare_list(owner, strided(rows, world.reader_base).reshape(-1, 5))


def test_prepared_entries_outside_registered_memory_are_refused_typed(world: World) -> None:
    """Real NIXL refuses such a list when preparing it, FakeNixl when a READ uses the entry;
    either way a TransferFailed, and no byte moves."""
    past_the_end = [(OWNER_BYTES - 256, 256, 256, 4)]  # entries 1-3 lie past the owner's region
    local_list = world.reader.prepare_list(None, strided(LOCAL_ROWS, world.reader_base))
    with pytest.raises(TransferFailed, match="outside the memory registered|NIXL did not find"):
        remote_list = world.reader.prepare_list(
            world.owner.name, strided(past_the_end, world.owner_base)
        )
        world.reader.make_prepped_read(local_list, np.array([0]), remote_list, np.array([2]))
    world.reader.release_list(local_list)
    np.testing.assert_array_equal(world.reader_buffer, READER_FILL)


def test_send_notif_to_unknown_agent_is_rejected(world: World) -> None:
    with pytest.raises(TransferFailed, match="unknown remote agent 'nobody'"):
        world.reader.send_notif("nobody", b"x:1")


@pytest.mark.parametrize(
    "make_metadata",
    [
        lambda good: b"garbage",
        lambda good: good[: len(good) // 2],
        lambda good: b"\x00" * 64,
        lambda good: b"",
    ],
    ids=["garbage", "truncated", "zeros", "empty"],
)
def test_bad_metadata_is_a_handshake_error(
    new_agent: AgentFactory, world: World, make_metadata: Callable[[bytes], bytes]
) -> None:
    # A stranger's metadata: truncated metadata can poison the name it carries.
    stranger = new_agent("stranger")
    bad_metadata = make_metadata(stranger.get_agent_metadata())
    stranger.close()
    with pytest.raises(HandshakeError, match="remote agent metadata failed: the agent metadata"):
        world.reader.add_remote_agent(bad_metadata)


def test_adding_the_same_metadata_twice_is_harmless(world: World) -> None:
    metadata = world.owner.get_agent_metadata()
    assert world.reader.add_remote_agent(metadata) == world.owner.name
    assert world.reader.add_remote_agent(metadata) == world.owner.name


def test_metadata_exported_before_registering_does_not_cover_the_region(
    new_agent: AgentFactory, world: World
) -> None:
    late = new_agent("late")
    world.reader.add_remote_agent(late.get_agent_metadata())
    region = np.arange(4096, dtype=np.int64).astype(np.uint8)
    late.register_regions([(int(region.ctypes.data), region.nbytes)])
    local = descriptors([(0, 4096)], world.reader_base)
    remote = descriptors([(0, 4096)], int(region.ctypes.data))

    with pytest.raises(TransferFailed, match="outside the memory registered"):
        world.reader.make_read(late.name, local, remote)
    world.reader.add_remote_agent(late.get_agent_metadata())  # loads add up
    run_read(world.reader, world.reader.make_read(late.name, local, remote))
    np.testing.assert_array_equal(world.reader_buffer[:4096], region)
    world.reader.remove_remote_agent(late.name)


def test_read_into_deregistered_memory_is_rejected(world: World) -> None:
    scratch = np.zeros(4096, np.uint8)
    registration = world.reader.register_regions([(int(scratch.ctypes.data), scratch.nbytes)])
    world.reader.deregister(registration)

    with pytest.raises(TransferFailed, match="outside the memory registered"):
        world.reader.make_read(
            world.owner.name,
            descriptors([(0, 100)], int(scratch.ctypes.data)),
            descriptors([(0, 100)], world.owner_base),
        )
    with pytest.raises(TransferFailed, match="deregistering memory"):
        world.reader.deregister(registration)


@pytest.mark.parametrize(
    ("regions", "message"),
    [([], "no memory regions"), ([(0, 100)], "address=0"), ([(4096, 0)], "length_bytes=0")],
    ids=["no regions", "null address", "zero length"],
)
def test_bad_registration_is_rejected(
    world: World, regions: list[tuple[int, int]], message: str
) -> None:
    with pytest.raises(TransferFailed, match=message):
        world.reader.register_regions(regions)


def test_removed_remote_agent_is_unknown(new_agent: AgentFactory, world: World) -> None:
    reader = new_agent("forgetful")
    reader.add_remote_agent(world.owner.get_agent_metadata())
    reader.remove_remote_agent(world.owner.name)
    with pytest.raises(TransferFailed, match="unknown remote agent"):
        reader.send_notif(world.owner.name, b"x:1")


def test_closed_agent_rejects_every_call(new_agent: AgentFactory) -> None:
    agent = new_agent("closing")
    agent.close()
    agent.close()  # idempotent
    with pytest.raises(TransferFailed, match="is closed; create a new agent"):
        agent.get_agent_metadata()
    with pytest.raises(TransferFailed, match="is closed"):
        agent.get_new_notifs()


def test_read_from_a_closed_peer_fails_instead_of_hanging(
    new_agent: AgentFactory, world: World
) -> None:
    peer = new_agent("doomed")
    region = np.ones(4096, np.uint8)
    peer.register_regions([(int(region.ctypes.data), region.nbytes)])
    world.reader.add_remote_agent(peer.get_agent_metadata())
    local = descriptors([(0, 4096)], world.reader_base)
    remote = descriptors([(0, 4096)], int(region.ctypes.data))
    run_read(world.reader, world.reader.make_read(peer.name, local, remote))

    peer.close()
    gc.collect()  # real NIXL: destroy the C++ agent now
    with pytest.raises(TransferFailed, match="disconnected"):
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:  # UCX may need a moment to notice
            transfer = world.reader.make_read(peer.name, local, remote)
            run_read(world.reader, transfer)
            world.reader.release(transfer)
    world.reader.remove_remote_agent(peer.name)


# ---- real NIXL across two processes --------------------------------------------------------

PEER_BYTES = 1 << 20
PEER_SEED = 11


@pytest.fixture(scope="module")
def real_reader() -> Iterator[tuple[NixlAgent, np.ndarray]]:
    from worker.nixl_real import RealNixlAgent

    agent = RealNixlAgent(f"parent-{uuid.uuid4().hex[:8]}")
    buffer = np.zeros(PEER_BYTES, np.uint8)
    registration = agent.register_regions([(int(buffer.ctypes.data), PEER_BYTES)])
    yield agent, buffer
    agent.deregister(registration)
    agent.close()


@pytest.mark.real_nixl
def test_real_two_process_read_lands_pattern_and_notifies_the_peer(
    real_reader: tuple[NixlAgent, np.ndarray],
) -> None:
    reader, buffer = real_reader
    buffer[:] = READER_FILL
    # (remote offset, local offset, length): scattered 64 KiB blocks, one short tail
    rows = [(7 << 16, 0, 1 << 16), (0, 3 << 16, 1 << 16), (PEER_BYTES - 300, 1 << 16, 300)]
    with PeerProcess(num_bytes=PEER_BYTES, seed=PEER_SEED) as peer:
        address, _, name, metadata = peer.wait_ready(timeout_s=20)
        assert reader.add_remote_agent(metadata) == name
        transfer = reader.make_read(
            name,
            descriptors([(local, length) for _, local, length in rows], int(buffer.ctypes.data)),
            descriptors([(remote, length) for remote, _, length in rows], address),
            notif=b"prefill-req-9:1",
        )
        run_read(reader, transfer)
        reader.release(transfer)
        assert peer.wait_notif(timeout_s=TIMEOUT_S) == (reader.name, b"prefill-req-9:1")
        reader.remove_remote_agent(name)

    expected = np.full(PEER_BYTES, READER_FILL, np.uint8)
    source = pattern(PEER_BYTES, PEER_SEED)
    for remote_offset, local_offset, length in rows:
        expected[local_offset : local_offset + length] = source[
            remote_offset : remote_offset + length
        ]
    np.testing.assert_array_equal(buffer, expected)


@pytest.mark.real_nixl
def test_real_read_from_a_killed_peer_process_fails_fast(
    real_reader: tuple[NixlAgent, np.ndarray],
) -> None:
    reader, buffer = real_reader
    with PeerProcess(num_bytes=PEER_BYTES, seed=PEER_SEED) as peer:
        address, _, name, metadata = peer.wait_ready(timeout_s=20)
        reader.add_remote_agent(metadata)
        local = descriptors([(0, PEER_BYTES)], int(buffer.ctypes.data))
        remote = descriptors([(0, PEER_BYTES)], address)
        run_read(reader, reader.make_read(name, local, remote))
        peer.kill()

    started = time.monotonic()
    with pytest.raises(TransferFailed, match="disconnected.*handshake again"):
        while time.monotonic() - started < TIMEOUT_S:  # UCX may need a moment to notice
            transfer = reader.make_read(name, local, remote)
            run_read(reader, transfer)
            reader.release(transfer)
    reader.remove_remote_agent(name)


def _cpu_ticks(thread_ids: set[str]) -> int:
    """User + system clock ticks used so far by these threads of this process."""
    ticks = 0
    for tid in thread_ids:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks


@pytest.mark.real_nixl
def test_real_idle_agent_threads_do_not_spin() -> None:
    from worker.nixl_real import RealNixlAgent

    threads_before = set(os.listdir("/proc/self/task"))
    agent = RealNixlAgent(f"idle-{uuid.uuid4().hex[:8]}")
    agent_threads = set(os.listdir("/proc/self/task")) - threads_before
    ticks_before = _cpu_ticks(agent_threads)
    time.sleep(0.5)  # measuring idleness: there is nothing to wait for
    idle_ticks = _cpu_ticks(agent_threads) - ticks_before
    agent.close()
    # A spinning progress thread (nixl_agent's default delay of 0) burns ~50 ticks here.
    assert agent_threads and idle_ticks <= 3


@pytest.mark.real_nixl
def test_real_agents_without_progress_thread_work_when_both_sides_are_driven() -> None:
    from worker.nixl_real import RealNixlAgent

    reader = RealNixlAgent(f"manual-r-{uuid.uuid4().hex[:8]}", progress_delay_us=None)
    owner = RealNixlAgent(f"manual-o-{uuid.uuid4().hex[:8]}", progress_delay_us=None)
    source, target = pattern(8192, 5), np.zeros(8192, np.uint8)
    owner.register_regions([(int(source.ctypes.data), 8192)])
    reader.register_regions([(int(target.ctypes.data), 8192)])
    reader.add_remote_agent(owner.get_agent_metadata())
    transfer = reader.make_read(
        owner.name,
        descriptors([(0, 8192)], int(target.ctypes.data)),
        descriptors([(0, 8192)], int(source.ctypes.data)),
        notif=b"req:1",
    )
    state = reader.post(transfer)
    notifs: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while state is TransferState.IN_PROGRESS or not notifs:
        assert time.monotonic() < deadline, "READ or notification stuck"
        notifs |= owner.get_new_notifs()  # the served side must be driven
        if state is TransferState.IN_PROGRESS:
            state = reader.check(transfer)
    reader.release(transfer)
    np.testing.assert_array_equal(target, source)
    assert notifs == {reader.name: [b"req:1"]}
    reader.close()
    owner.close()
