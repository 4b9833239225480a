"""FakeNixl: the NixlAgent Protocol inside one process, really copying bytes, with fault injection.

Agents meet on a FakeFabric (default: one per process). A READ copies bytes with
ctypes.memmove between memory registered by two agents of the same fabric, and its
notification reaches the remote only after the bytes landed. Errors mirror real NIXL: unknown
agents, descriptors outside registered memory, count/length mismatches and vanished peers all
raise TransferFailed; garbage metadata raises HandshakeError.

Like real NIXL, a reader knows the remote memory its loaded metadata described: metadata
exported before the peer registered its memory does not cover it (load it again; loads add
up). Unlike real NIXL, which never learns of a peer's deregistration, the fake also refuses to
read memory the peer has deregistered since: that memory may be freed.

Fault injection (set the fields of ``agent.faults`` between steps):

    agent.faults.fail_transfers = 2   # the next 2 READs it posts end in ERR: check() raises
    agent.faults.stall_polls = 3      # each READ it posts stays IN_PROGRESS for 3 checks
    agent.faults.drop_notifs = 1      # the next notification it sends is lost
    agent.faults.corrupt_notifs = 1   # the next one arrives as non-UTF-8 garbage
    agent.faults.land_after_release = True  # release() of a READ in progress does not stop it
    fabric.vanish("prefill-0")        # that agent's process "dies": peers see disconnects

``land_after_release`` models real NIXL over UCX, whose release of an unfinished READ returns
success while the READ goes on: the released READ keeps counting down its stalled polls, one
per later call of this agent's check, post or get_new_notifs (UCX's progress), and then its
bytes land (its notification is dropped).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np

from connector.errors import HandshakeError, TransferFailed, UnsupportedConfiguration
from connector.memory import HOST_MEMORY, Memory
from worker.descriptors import (
    check_known_remote,
    checked_indices,
    checked_read_descriptors,
    checked_regions,
    checked_strided_rows,
    expand,
    list_entries,
)
from worker.nixl_api import Descriptors, Indices, StridedRows, TransferState

CORRUPT_PREFIX = b"\xff\xfe"  # prepended to corrupted notifications: never valid UTF-8


class _FakeMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fabric_id: str
    agent_name: str
    regions: tuple[tuple[int, int], ...]  # (address, length_bytes) registered at export time


_decode_metadata = msgspec.msgpack.Decoder(_FakeMetadata)


@dataclass
class FakeFaults:
    """Faults an agent injects into what it does next. Counts go down as they fire."""

    fail_transfers: int = 0
    stall_polls: int = 0
    drop_notifs: int = 0
    corrupt_notifs: int = 0
    land_after_release: bool = False  # release() leaves a READ in progress running


@dataclass(frozen=True)
class FakeRegistration:
    registration_id: int
    regions: tuple[tuple[int, int], ...]  # (address, length_bytes)
    memory: Memory = HOST_MEMORY


@dataclass
class FakePreparedList:
    """A prepared list: strided rows of ``owner``'s memory (this agent's for the local side)."""

    owner: str
    rows: StridedRows
    num_entries: int
    memory: Memory
    local: bool
    released: bool = False


@dataclass
class FakeRead:
    """A READ of remote[i] into local[i]; once posted, ``polls_left`` checks say IN_PROGRESS."""

    remote_agent: str
    local: Descriptors
    remote: Descriptors
    notif: bytes
    phase: Literal["prepared", "posted", "done", "failed", "released"] = "prepared"
    polls_left: int = 0
    fails: bool = False

    def describe(self) -> str:
        return f"READ of {len(self.local)} descriptors from agent {self.remote_agent!r}"


class FakeFabric:
    """The in-process "network": FakeNixl agents by name.

    ``lock`` guards every member agent's registrations and inbox: agents driven by different
    threads (a prefill rank and a decode rank in one test) read and write each other's.
    """

    def __init__(self) -> None:
        self.fabric_id = uuid.uuid4().hex
        self.lock = threading.Lock()
        self._agents: dict[str, FakeNixl] = {}

    def join(self, agent: FakeNixl) -> None:
        with self.lock:
            if agent.name in self._agents:
                raise UnsupportedConfiguration(
                    f"a FakeNixl agent named {agent.name!r} already exists on this fabric; "
                    "give agents fresh names per start (or close the old one)"
                )
            self._agents[agent.name] = agent

    def find(self, agent_name: str) -> FakeNixl | None:
        """The live agent with that name; call with ``lock`` held."""
        return self._agents.get(agent_name)

    def leave(self, agent_name: str) -> None:
        with self.lock:
            self._agents.pop(agent_name, None)

    def vanish(self, agent_name: str) -> None:
        """Simulate the agent's process dying: it leaves the fabric and its own methods raise;
        peers' reads and notifications aimed at it fail like nixlRemoteDisconnectError."""
        with self.lock:
            agent = self._agents.pop(agent_name, None)
        if agent is not None:
            agent.close()


DEFAULT_FABRIC = FakeFabric()


class FakeNixl:
    """An in-process NIXL agent implementing worker.nixl_api.NixlAgent."""

    def __init__(self, name: str, fabric: FakeFabric | None = None) -> None:
        if not name:
            raise UnsupportedConfiguration("NIXL agent name is empty; give each agent a name")
        self._name = name
        self._fabric = fabric if fabric is not None else DEFAULT_FABRIC
        self.faults = FakeFaults()
        self._registrations: dict[int, FakeRegistration] = {}  # guarded by fabric.lock
        self._inbox: dict[str, list[bytes]] = {}  # sender -> messages; guarded by fabric.lock
        self._registration_ids = itertools.count()
        # remote agent -> the regions its loaded metadata described (every load adds)
        self._remote_agents: dict[str, frozenset[tuple[int, int]]] = {}
        self._closed = False
        self._released_live: list[FakeRead] = []  # released in progress, still landing
        self._fabric.join(self)

    @property
    def name(self) -> str:
        return self._name

    def register_regions(
        self, regions: Sequence[tuple[int, int]], memory: Memory = HOST_MEMORY
    ) -> FakeRegistration:
        """Any memory kind is accepted: tests stand CPU tensors in for GPU caches, so the
        bytes are always host bytes here; the kind is kept for tests to check."""
        self._live()
        registration = FakeRegistration(
            next(self._registration_ids), checked_regions(regions), memory
        )
        with self._fabric.lock:
            self._registrations[registration.registration_id] = registration
        return registration

    def deregister(self, registration: FakeRegistration) -> None:
        self._live()
        with self._fabric.lock:
            removed = self._registrations.pop(registration.registration_id, None)
        if removed is None:
            raise TransferFailed(
                f"deregistering memory of agent {self._name!r} failed: registration "
                f"{registration.registration_id} not found (deregistered twice?)"
            )

    def get_agent_metadata(self) -> bytes:
        self._live()
        with self._fabric.lock:
            regions = tuple(self._live_regions())
        return msgspec.msgpack.encode(_FakeMetadata(self._fabric.fabric_id, self._name, regions))

    def add_remote_agent(self, metadata: bytes) -> str:
        self._live()
        try:
            remote = _decode_metadata.decode(metadata)
        except msgspec.DecodeError as exc:
            raise HandshakeError(
                f"loading {len(metadata)} bytes of remote agent metadata failed: the agent "
                f"metadata is corrupt or not FakeNixl metadata ({exc}). Fetch it again"
            ) from exc
        if remote.fabric_id != self._fabric.fabric_id:
            raise HandshakeError(
                f"remote agent {remote.agent_name!r} lives on another FakeFabric; FakeNixl "
                "agents only reach agents of the same fabric (pass the same fabric to both)"
            )
        known = self._remote_agents.get(remote.agent_name, frozenset())
        self._remote_agents[remote.agent_name] = known | set(remote.regions)
        return remote.agent_name

    def remove_remote_agent(self, agent_name: str) -> None:
        self._live()
        self._remote_agents.pop(agent_name, None)

    def make_read(
        self,
        remote_agent: str,
        local: Descriptors,
        remote: Descriptors,
        notif: bytes = b"",
        *,
        local_memory: Memory = HOST_MEMORY,
        remote_memory: Memory = HOST_MEMORY,
    ) -> FakeRead:
        self._live()
        check_known_remote(self._name, remote_agent, self._remote_agents)
        local_rows, remote_rows = checked_read_descriptors(local, remote)
        transfer = FakeRead(remote_agent, local_rows, remote_rows, bytes(notif))
        with self._fabric.lock:
            self._check_ranges(transfer)
        return transfer

    def prepare_list(
        self, owner: str | None, rows: StridedRows, memory: Memory = HOST_MEMORY
    ) -> FakePreparedList:
        """Entries are checked against registered memory when a READ uses them, like make_read."""
        self._live()
        checked = checked_strided_rows(rows)
        if owner is not None:
            check_known_remote(self._name, owner, self._remote_agents)
        name = self._name if owner is None else owner
        return FakePreparedList(name, checked, list_entries(checked), memory, owner is None)

    def make_prepped_read(
        self,
        local_list: FakePreparedList,
        local_indices: Indices,
        remote_list: FakePreparedList,
        remote_indices: Indices,
        notif: bytes = b"",
    ) -> FakeRead:
        self._live()
        for side, prepared, local in (("local", local_list, True), ("remote", remote_list, False)):
            if prepared.released or prepared.local != local:
                state = "released" if prepared.released else "of the wrong side"
                raise TransferFailed(
                    f"cannot READ by index: the {side} prepared list is {state}; prepare it "
                    "again (local lists with owner None, remote ones with the peer's name)"
                )
        local_idx, remote_idx = checked_indices(
            local_list.num_entries, local_indices, remote_list.num_entries, remote_indices
        )
        return self.make_read(
            remote_list.owner,
            expand(local_list.rows, local_idx),
            expand(remote_list.rows, remote_idx),
            notif,
            local_memory=local_list.memory,
            remote_memory=remote_list.memory,
        )

    def release_list(self, prepared: FakePreparedList) -> None:
        prepared.released = True

    def post(self, transfer: FakeRead) -> TransferState:
        self._live()
        self._progress_released()
        if transfer.phase != "prepared":
            raise TransferFailed(f"cannot post the {transfer.describe()}: it is {transfer.phase}")
        transfer.phase = "posted"
        transfer.polls_left = self.faults.stall_polls
        if self.faults.fail_transfers > 0:
            self.faults.fail_transfers -= 1
            transfer.fails = True
        if transfer.fails or transfer.polls_left > 0:
            return TransferState.IN_PROGRESS
        return self._advance(transfer)

    def check(self, transfer: FakeRead) -> TransferState:
        self._live()
        self._progress_released()
        if transfer.phase == "done":
            return TransferState.DONE
        if transfer.phase != "posted":
            raise TransferFailed(f"cannot check the {transfer.describe()}: it is {transfer.phase}")
        return self._advance(transfer)

    def release(self, transfer: FakeRead) -> None:
        """Free the READ; one still in progress is cancelled (no bytes, no notification),
        unless ``faults.land_after_release``: then it goes on and lands later."""
        if transfer.phase == "posted" and self.faults.land_after_release:
            self._released_live.append(transfer)
        transfer.phase = "released"

    def send_notif(self, remote_agent: str, message: bytes) -> None:
        self._live()
        check_known_remote(self._name, remote_agent, self._remote_agents)
        with self._fabric.lock:
            self._deliver(self._peer(remote_agent, "sending a notification"), bytes(message))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self._live()
        self._progress_released()
        with self._fabric.lock:
            notifs, self._inbox = self._inbox, {}
        return notifs

    def close(self) -> None:
        """Leave the fabric: peers now see this agent as disconnected. Idempotent."""
        if not self._closed:
            self._closed = True
            self._fabric.leave(self._name)

    def _advance(self, transfer: FakeRead) -> TransferState:
        """One poll of a posted READ: stall, fail, or copy the bytes and notify."""
        if transfer.polls_left > 0:
            transfer.polls_left -= 1
            return TransferState.IN_PROGRESS
        transfer.phase = "failed"  # until the bytes have moved
        if transfer.fails:
            raise TransferFailed(
                f"the {transfer.describe()} failed: NIXL reported state 'ERR' (injected "
                "fault). Treat the landed bytes as garbage and fail the request"
            )
        with self._fabric.lock:
            peer = self._check_ranges(transfer)
            for (dst, _, _), (src, num_bytes, _) in zip(
                transfer.local.tolist(), transfer.remote.tolist(), strict=True
            ):
                ctypes.memmove(dst, src, num_bytes)
            if transfer.notif:
                self._deliver(peer, transfer.notif)
        transfer.phase = "done"
        return TransferState.DONE

    def _progress_released(self) -> None:
        """One poll of every released READ still in progress: the bytes land when its stall
        runs out (or it fails, as it would have, silently: nobody holds its handle)."""
        for transfer in list(self._released_live):
            if transfer.polls_left > 0:
                transfer.polls_left -= 1
                continue
            self._released_live.remove(transfer)
            transfer.notif = b""
            transfer.phase = "posted"
            with contextlib.suppress(TransferFailed):  # nobody holds its handle to hear it
                self._advance(transfer)
            transfer.phase = "released"

    def _check_ranges(self, transfer: FakeRead) -> FakeNixl:
        """Both sides' descriptors inside their agent's registered memory; call under lock.

        Checked again when the bytes move: memory deregistered since then may be freed.
        """
        # Not removed since make_read:
        check_known_remote(self._name, transfer.remote_agent, self._remote_agents)
        peer = self._peer(transfer.remote_agent, f"the {transfer.describe()}")
        loaded = self._remote_agents[peer.name]
        sides = (
            ("local", transfer.local, self, [self._live_regions()]),
            ("remote", transfer.remote, peer, [peer._live_regions(), loaded]),
        )
        for side, rows, owner, region_sets in sides:
            outside = [_first_outside(rows, regions) for regions in region_sets]
            index = min((i for i in outside if i is not None), default=None)
            if index is not None:
                address, num_bytes, device_id = rows[index].tolist()
                raise TransferFailed(
                    f"the {transfer.describe()} failed: {side} descriptor {index} (address="
                    f"{address:#x}, length_bytes={num_bytes}, device_id={device_id}) is outside "
                    f"the memory registered by agent {owner.name!r}. Check the region "
                    "addresses and layout exchanged in the handshake"
                )
        return peer

    def _live_regions(self) -> list[tuple[int, int]]:
        """Regions registered now; call with the fabric lock held."""
        return [r for reg in self._registrations.values() for r in reg.regions]

    def _peer(self, agent_name: str, action: str) -> FakeNixl:
        peer = self._fabric.find(agent_name)
        if peer is None:
            raise TransferFailed(
                f"{action} failed: the remote agent disconnected (its process died or closed "
                "its agent); bytes that landed are garbage. Fail the request and handshake "
                "again with the restarted peer"
            )
        return peer

    def _deliver(self, peer: FakeNixl, message: bytes) -> None:
        """Put a notification in the peer's inbox, unless a fault drops or corrupts it."""
        if self.faults.drop_notifs > 0:
            self.faults.drop_notifs -= 1
            return
        if self.faults.corrupt_notifs > 0:
            self.faults.corrupt_notifs -= 1
            message = CORRUPT_PREFIX + message
        peer._inbox.setdefault(self._name, []).append(message)

    def _live(self) -> None:
        if self._closed:
            raise TransferFailed(f"NIXL agent {self._name!r} is closed; create a new agent")


def _first_outside(rows: Descriptors, regions: Collection[tuple[int, int]]) -> int | None:
    """Index of the first descriptor not inside one of ``regions`` on device 0, or None."""
    if not regions:
        return 0
    region_starts, region_lengths = np.array(list(regions), dtype=np.int64).T
    starts, ends = rows[:, 0:1], rows[:, 0:1] + rows[:, 1:2]
    within = (starts >= region_starts) & (ends <= region_starts + region_lengths)
    outside = np.flatnonzero(~within.any(axis=1) | (rows[:, 2] != 0))
    return int(outside[0]) if len(outside) else None
