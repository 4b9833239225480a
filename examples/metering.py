"""Measure what the connector's NIXL agent does: bytes read, transfer time and handshake time.

``MeteredAgent`` wraps any NixlAgent and records into a ``TransferStats`` shared by an engine's
ranks. The connector never sees the difference: every call is passed through unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from connector.memory import HOST_MEMORY, Memory
from connector.metadata import ConnectorMetadata
from worker.descriptors import expand
from worker.nixl_api import Descriptors, Indices, NixlAgent, StridedRows, TransferState


class StatsSnapshot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    bytes_transferred: int
    num_reads: int
    num_descriptors: int
    transfer_busy_s: float  # union of [post, done] intervals over every READ
    handshake_ms: float | None  # first load of a new remote engine -> its first READ prepared


class TransferStats:
    """Counters for one engine, shared by its ranks' MeteredAgents: each rank's transfer
    thread records into them, so every read and write holds ``lock``."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lock = threading.Lock()  # guards every counter below
        self.bytes_transferred = 0
        self.num_reads = 0
        self.num_descriptors = 0
        self.intervals: list[tuple[float, float]] = []
        self.first_load_s: float | None = None
        self.first_read_s: float | None = None

    def note_loads(self, metadata: ConnectorMetadata) -> None:
        with self.lock:
            if metadata.loads and self.first_load_s is None:
                self.first_load_s = self.clock()

    def snapshot(self) -> StatsSnapshot:
        with self.lock:
            handshake_ms = None
            if self.first_load_s is not None and self.first_read_s is not None:
                handshake_ms = (self.first_read_s - self.first_load_s) * 1e3
            return StatsSnapshot(
                self.bytes_transferred,
                self.num_reads,
                self.num_descriptors,
                _union_s(list(self.intervals)),
                handshake_ms,
            )


def _union_s(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals, in seconds."""
    total_s, covered_until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_until:
            total_s += end - max(start, covered_until)
            covered_until = end
    return total_s


class MeteredAgent:
    """A NixlAgent that records READ sizes and timings into ``stats``; otherwise pass-through."""

    def __init__(self, agent: NixlAgent, stats: TransferStats) -> None:
        self.inner = agent
        self._stats = stats
        self._posted_s: dict[int, float] = {}  # id(transfer) -> post time, until DONE
        self._rows: dict[int, StridedRows] = {}  # id(prepared list) -> its rows, until released

    @property
    def name(self) -> str:
        return self.inner.name

    def register_regions(
        self, regions: Sequence[tuple[int, int]], memory: Memory = HOST_MEMORY
    ) -> Any:
        return self.inner.register_regions(regions, memory)

    def deregister(self, registration: Any) -> None:
        self.inner.deregister(registration)

    def get_agent_metadata(self) -> bytes:
        return self.inner.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        return self.inner.add_remote_agent(metadata)

    def remove_remote_agent(self, agent_name: str) -> None:
        self.inner.remove_remote_agent(agent_name)

    def make_read(
        self,
        remote_agent: str,
        local: Descriptors,
        remote: Descriptors,
        notif: bytes = b"",
        *,
        local_memory: Memory = HOST_MEMORY,
        remote_memory: Memory = HOST_MEMORY,
    ) -> Any:
        transfer = self.inner.make_read(
            remote_agent,
            local,
            remote,
            notif,
            local_memory=local_memory,
            remote_memory=remote_memory,
        )
        self._count_read(local)
        return transfer

    def prepare_list(
        self, owner: str | None, rows: StridedRows, memory: Memory = HOST_MEMORY
    ) -> Any:
        prepared = self.inner.prepare_list(owner, rows, memory)
        self._rows[id(prepared)] = rows
        return prepared

    def make_prepped_read(
        self,
        local_list: Any,
        local_indices: Indices,
        remote_list: Any,
        remote_indices: Indices,
        notif: bytes = b"",
    ) -> Any:
        transfer = self.inner.make_prepped_read(
            local_list, local_indices, remote_list, remote_indices, notif
        )
        self._count_read(expand(self._rows[id(local_list)], local_indices))
        return transfer

    def release_list(self, prepared: Any) -> None:
        self._rows.pop(id(prepared), None)
        self.inner.release_list(prepared)

    def _count_read(self, local: Descriptors) -> None:
        stats = self._stats
        with stats.lock:
            if stats.first_read_s is None:
                stats.first_read_s = stats.clock()
            stats.num_reads += 1
            stats.num_descriptors += int(local.shape[0])
            stats.bytes_transferred += int(local[:, 1].sum()) if local.shape[0] else 0

    def post(self, transfer: Any) -> TransferState:
        self._posted_s[id(transfer)] = self._stats.clock()
        return self._done_if(transfer, self.inner.post(transfer))

    def check(self, transfer: Any) -> TransferState:
        return self._done_if(transfer, self.inner.check(transfer))

    def _done_if(self, transfer: Any, state: TransferState) -> TransferState:
        if state is TransferState.DONE and id(transfer) in self._posted_s:
            interval = (self._posted_s.pop(id(transfer)), self._stats.clock())
            with self._stats.lock:
                self._stats.intervals.append(interval)
        return state

    def release(self, transfer: Any) -> None:
        self._posted_s.pop(id(transfer), None)
        self.inner.release(transfer)

    def send_notif(self, remote_agent: str, message: bytes) -> None:
        self.inner.send_notif(remote_agent, message)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return self.inner.get_new_notifs()

    def close(self) -> None:
        self.inner.close()
