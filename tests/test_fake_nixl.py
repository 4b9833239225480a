"""FakeNixl's own behaviour: fault injection, fabrics and names (the contract is shared)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from connector.errors import HandshakeError, TransferFailed, UnsupportedConfiguration
from tests.nixl_peer_proc import pattern
from tests.test_nixl_contract import (
    OWNER_BYTES,
    READER_BYTES,
    READER_FILL,
    World,
    descriptors,
    run_read,
)
from worker.fake import CORRUPT_PREFIX, FakeFabric, FakeFaults, FakeNixl
from worker.nixl_api import NixlAgent, TransferState


@pytest.fixture
def fake_world() -> Iterator[tuple[World, FakeFabric]]:
    fabric = FakeFabric()
    reader, owner = FakeNixl("decode-0", fabric), FakeNixl("prefill-0", fabric)
    world = World(
        reader, owner, np.full(READER_BYTES, READER_FILL, np.uint8), pattern(OWNER_BYTES, 3)
    )
    reader.register_regions([(world.reader_base, READER_BYTES)])
    owner.register_regions([(world.owner_base, OWNER_BYTES)])
    reader.add_remote_agent(owner.get_agent_metadata())
    yield world, fabric
    reader.close()
    owner.close()


def small_read(world: World, notif: bytes = b"req:1") -> object:
    return world.reader.make_read(
        world.owner.name,
        descriptors([(0, 1000)], world.reader_base),
        descriptors([(500, 1000)], world.owner_base),
        notif,
    )


def landed(world: World) -> bool:
    return bool(np.array_equal(world.reader_buffer[:1000], world.owner_buffer[500:1500]))


def faults(agent: NixlAgent) -> FakeFaults:
    assert isinstance(agent, FakeNixl)
    return agent.faults


IN_PROGRESS, DONE = TransferState.IN_PROGRESS, TransferState.DONE


def test_fake_failed_transfer_moves_nothing_and_the_next_one_works(
    fake_world: tuple[World, FakeFabric],
) -> None:
    world, _ = fake_world
    faults(world.reader).fail_transfers = 1
    failing = small_read(world)
    assert world.reader.post(failing) is IN_PROGRESS
    with pytest.raises(TransferFailed, match="state 'ERR' \\(injected fault\\)"):
        world.reader.check(failing)
    assert not landed(world)
    assert world.owner.get_new_notifs() == {}

    run_read(world.reader, small_read(world))
    assert landed(world)


def test_fake_stalled_transfer_lands_data_and_notif_only_when_done(
    fake_world: tuple[World, FakeFabric],
) -> None:
    world, _ = fake_world
    faults(world.reader).stall_polls = 2
    transfer = small_read(world)
    states = [world.reader.post(transfer)]
    while states[-1] is IN_PROGRESS:
        assert not landed(world) and world.owner.get_new_notifs() == {}
        states.append(world.reader.check(transfer))
    assert states == [IN_PROGRESS, IN_PROGRESS, IN_PROGRESS, DONE]
    assert landed(world)
    assert world.owner.get_new_notifs() == {"decode-0": [b"req:1"]}


def test_fake_released_mid_transfer_moves_nothing(fake_world: tuple[World, FakeFabric]) -> None:
    world, _ = fake_world
    faults(world.reader).stall_polls = 1
    transfer = small_read(world)
    world.reader.post(transfer)
    world.reader.release(transfer)
    assert not landed(world)
    assert world.owner.get_new_notifs() == {}
    with pytest.raises(TransferFailed, match="it is released"):
        world.reader.check(transfer)


def test_fake_released_mid_transfer_lands_later_when_asked_to(
    fake_world: tuple[World, FakeFabric],
) -> None:
    """land_after_release: as NIXL over UCX, release() does not stop a READ in progress; its
    bytes land after its stall, driven by the reader's later calls, and no notification."""
    world, _ = fake_world
    faults(world.reader).stall_polls = 2
    faults(world.reader).land_after_release = True
    transfer = small_read(world)
    world.reader.post(transfer)
    world.reader.release(transfer)
    landed_after: list[bool] = []
    for _ in range(4):
        world.reader.get_new_notifs()  # the reader's progress
        landed_after.append(landed(world))
    assert landed_after == [False, False, True, True]
    assert world.owner.get_new_notifs() == {}
    with pytest.raises(TransferFailed, match="it is released"):
        world.reader.check(transfer)


def test_fake_peer_vanishing_mid_transfer_fails_it(fake_world: tuple[World, FakeFabric]) -> None:
    world, fabric = fake_world
    faults(world.reader).stall_polls = 1
    transfer = small_read(world)
    world.reader.post(transfer)
    fabric.vanish("prefill-0")

    assert world.reader.check(transfer) is IN_PROGRESS
    with pytest.raises(TransferFailed, match="the remote agent disconnected"):
        world.reader.check(transfer)
    assert not landed(world)
    with pytest.raises(TransferFailed, match="disconnected"):
        world.reader.send_notif("prefill-0", b"req:1")
    with pytest.raises(TransferFailed, match="'prefill-0' is closed"):
        world.owner.get_new_notifs()


NOTIF_FAULTS = {
    "dropped": ("drop_notifs", []),
    "corrupted": ("corrupt_notifs", [CORRUPT_PREFIX + b"req:1"]),
}


@pytest.mark.parametrize(("fault", "first_delivery"), NOTIF_FAULTS.values(), ids=NOTIF_FAULTS)
@pytest.mark.parametrize("via", ["read", "send_notif"])
def test_fake_notification_fault_hits_only_the_next_one(
    fake_world: tuple[World, FakeFabric], fault: str, first_delivery: list[bytes], via: str
) -> None:
    world, _ = fake_world
    setattr(faults(world.reader), fault, 1)
    for message in (b"req:1", b"req:2"):
        if via == "read":
            run_read(world.reader, small_read(world, message))
        else:
            world.reader.send_notif("prefill-0", message)
    assert landed(world) or via == "send_notif"
    assert world.owner.get_new_notifs() == {"decode-0": [*first_delivery, b"req:2"]}


def test_fake_corrupted_notification_is_not_utf8(fake_world: tuple[World, FakeFabric]) -> None:
    world, _ = fake_world
    faults(world.reader).corrupt_notifs = 1
    world.reader.send_notif("prefill-0", b"req:1")
    (message,) = world.owner.get_new_notifs()["decode-0"]
    with pytest.raises(UnicodeDecodeError):
        message.decode()


def test_fake_metadata_from_another_fabric_is_a_handshake_error() -> None:
    stranger = FakeNixl("stranger", FakeFabric())
    local = FakeNixl("local", FakeFabric())
    with pytest.raises(HandshakeError, match="another FakeFabric"):
        local.add_remote_agent(stranger.get_agent_metadata())


def test_fake_duplicate_agent_name_is_refused() -> None:
    fabric = FakeFabric()
    first = FakeNixl("decode-0", fabric)
    with pytest.raises(UnsupportedConfiguration, match="already exists.*fresh names per start"):
        FakeNixl("decode-0", fabric)
    first.close()
    FakeNixl("decode-0", fabric).close()  # the name is free again once closed


def test_fake_reads_from_the_default_fabric_without_passing_one() -> None:
    reader, owner = FakeNixl(f"r-{uuid.uuid4().hex}"), FakeNixl(f"o-{uuid.uuid4().hex}")
    source, target = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8)
    owner.register_regions([(int(source.ctypes.data), 256)])
    reader.register_regions([(int(target.ctypes.data), 256)])
    reader.add_remote_agent(owner.get_agent_metadata())
    run_read(
        reader,
        reader.make_read(
            owner.name,
            descriptors([(0, 256)], int(target.ctypes.data)),
            descriptors([(0, 256)], int(source.ctypes.data)),
        ),
    )
    np.testing.assert_array_equal(target, source)
    reader.close()
    owner.close()
