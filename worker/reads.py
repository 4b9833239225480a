"""A peer's plan on this rank's NIXL agent: the lists prepared at handshake, the READs made from them.

Prepared lists (``PreparedLists``, at handshake, freed when the peer retires): local lists
(this rank's memory) are shared by every (peer, remote rank) whose rows are the same, so a
rank serving one model prepares one local list per distinct pairing, once. Remote lists are
one per (peer, remote rank) and go before the peer's agents do. What a peer costs: one
strided row per plane read from each remote rank, on each side (worker/plan/whole_blocks.py),
e.g. 64 rows for 32 layers of K and V; NIXL keeps strided rows compressed (benchmarks/README.md,
prepped_bench), so the pool size costs nothing per peer.

READs: a remote rank's part of a request is one or two READs (worker/plan/recipe.py RankPlan):
by index into the prepared lists, and/or byte ranges, whose descriptors are built here. None
carries a notification: the free notifications go once the lease is proven
(worker/load_lifecycle.py).

Transfer thread only (worker/connector.py), like every agent call after registration. The
plans' arrays stay mapped between requests (``keep_plan_memory_mapped``, at the end).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from connector.errors import ConnectorError
from connector.memory import Memory
from connector.protocol import WorkerHandshake
from worker.nixl_api import Descriptors, NixlAgent
from worker.plan.exact_runs import ByteRuns
from worker.plan.whole_blocks import PreparedRows

if TYPE_CHECKING:
    from worker.peers import PeerLink
    from worker.plan.recipe import RankPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedReads:
    """One (peer, remote rank)'s prepared lists: READs by index use these two handles."""

    rows: PreparedRows
    local_list: Any
    remote_list: Any
    local_key: bytes  # the shared local list's key in PreparedLists


@dataclass
class _Shared:
    handle: Any
    users: int  # PreparedReads holding it


class PreparedLists:
    """Prepares and frees the lists of one rank's agent."""

    def __init__(
        self, agent: NixlAgent, local_addresses: Sequence[int], local_memory: Memory
    ) -> None:
        self._agent = agent
        self._local_addresses = tuple(local_addresses)
        self._local_memory = local_memory
        self._local: dict[bytes, _Shared] = {}  # rows bytes -> shared local list

    @property
    def local_addresses(self) -> tuple[int, ...]:
        return self._local_addresses

    @property
    def local_device(self) -> int:
        return self._local_memory.device

    def prepare(
        self, rows: PreparedRows, agent_name: str, handshake: WorkerHandshake
    ) -> PreparedReads | None:
        """The lists of ``rows`` (a PeerPlan's, for one remote rank), or None if NIXL refused:
        that rank's requests then use byte ranges only."""
        remote_rank = rows.remote_rank
        key = rows.local_rows.tobytes()
        try:
            local = self._local_list(key, rows)
            remote = self._agent.prepare_list(agent_name, rows.remote_rows, handshake.memory)
        except ConnectorError as error:
            logger.warning(
                "preparing descriptor lists for remote rank %d failed; its requests use byte "
                "ranges: %s",
                remote_rank,
                error,
            )
            self._drop_local(key)
            return None
        return PreparedReads(rows, local, remote, key)

    def release(self, reads: PreparedReads) -> None:
        """Free a (peer, remote rank)'s lists, before its remote agent goes; never raises."""
        try:
            self._agent.release_list(reads.remote_list)
        except ConnectorError as error:
            logger.warning("releasing a prepared remote list failed: %s", error)
        self._drop_local(reads.local_key)

    def _local_list(self, key: bytes, rows: PreparedRows) -> Any:
        shared = self._local.get(key)
        if shared is None:
            handle = self._agent.prepare_list(None, rows.local_rows, self._local_memory)
            shared = self._local[key] = _Shared(handle, 0)
        shared.users += 1
        return shared.handle

    def _drop_local(self, key: bytes) -> None:
        shared = self._local.get(key)
        if shared is None:
            return
        shared.users -= 1
        if shared.users > 0:
            return
        del self._local[key]
        try:
            self._agent.release_list(shared.handle)
        except ConnectorError as error:
            logger.warning("releasing a prepared local list failed: %s", error)


BY_INDEX, BY_RANGES = 0, 1  # the parts of a remote rank's reads (worker/load_lifecycle.py ReadKey)
MakeRead = Callable[[], Any]  # makes one READ handle; raises ConnectorError


def build_descriptors(
    region_addresses: Sequence[int],
    regions: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    device: int = 0,
) -> Descriptors:
    """NIXL descriptors (address, length_bytes, device) for byte ranges within regions.

    Written into one (N, 3) array, with no intermediate N-row copies. Page faults on freshly
    mapped arrays cost more still: keep_plan_memory_mapped (below).
    """
    bases = np.asarray(region_addresses, dtype=np.int64)
    descriptors = np.empty((len(lengths), 3), dtype=np.int64)
    np.add(bases[regions], offsets, out=descriptors[:, 0])
    descriptors[:, 1] = lengths
    descriptors[:, 2] = device
    return descriptors


def make_range_read(
    agent: NixlAgent,
    link: PeerLink,
    remote_rank: int,
    runs: ByteRuns,
    *,
    local_addresses: Sequence[int],
    local_memory: Memory,
) -> Any:
    """Prepare the READ of ``runs`` from ``remote_rank``."""
    handshake = link.handshakes[remote_rank]
    local = build_descriptors(
        local_addresses, runs.local_regions, runs.local_offsets, runs.lengths, local_memory.device
    )
    remote = build_descriptors(
        handshake.region_addresses,
        runs.remote_regions,
        runs.remote_offsets,
        runs.lengths,
        handshake.memory.device,
    )
    return agent.make_read(
        link.agent_names[remote_rank],
        local,
        remote,
        local_memory=local_memory,
        remote_memory=handshake.memory,
    )


def read_makers(
    agent: NixlAgent,
    link: PeerLink,
    plan: RankPlan,
    *,
    local_addresses: Sequence[int],
    local_memory: Memory,
) -> list[tuple[tuple[int, int], MakeRead]]:
    """(read key, maker) of each READ of ``plan``: by index first, then byte ranges. They
    carry no notification."""
    rank = plan.remote_rank
    makers: list[tuple[tuple[int, int], MakeRead]] = []
    if plan.by_index is not None:
        prepared = link.prepared[rank]
        makers.append(((rank, BY_INDEX), functools.partial(
            agent.make_prepped_read, prepared.local_list, plan.by_index.local_indices,
            prepared.remote_list, plan.by_index.remote_indices,
        )))  # fmt: skip
    if plan.ranges is not None:
        makers.append(((rank, BY_RANGES), functools.partial(
            make_range_read, agent, link, rank, plan.ranges,
            local_addresses=local_addresses, local_memory=local_memory,
        )))  # fmt: skip
    return makers


# glibc mallopt parameters (malloc.h) and the values keep_plan_memory_mapped sets.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # numpy arrays below this come from the heap, not mmap
TRIM_THRESHOLD_BYTES = 64 << 20  # at most this much freed heap stays mapped for reuse


def keep_plan_memory_mapped() -> bool:
    """Stop glibc from returning a plan's freed arrays to the kernel after every request.

    A 32k-token request with fragmented ids plans 131k descriptors: a few MB of numpy arrays
    per request. With glibc's defaults the freed heap top is trimmed (or the arrays are
    mmap'd) each time, so every request page-faults its arrays in again (benchmarks/README.md,
    the 32k-fragmented outlier). Process-wide and bounded: at most 64 MiB of freed heap stays
    mapped. Returns False where there is no glibc (nothing changes).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
