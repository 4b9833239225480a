"""This rank's prepared descriptor lists on its NIXL agent: prepared at handshake, freed at retire.

Local lists (this rank's memory) are shared by every (peer, remote rank) whose rows are the
same: a rank serving one model prepares one local list per distinct pairing, once. Remote lists
are one per (peer, remote rank) and go before the peer's agents do. What a peer costs: one
strided row per plane read from each remote rank, on each side (worker/plan/prepared_rows.py),
e.g. 64 rows for 32 layers of K and V; NIXL keeps strided rows compressed (measured: a list of
1M entries prepared in 0.05 ms with no RSS growth, against 45 ms and about 55 MB expanded), so
the pool size costs nothing per peer.

Transfer thread only, like every agent call after registration.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from connector.errors import ConnectorError
from connector.memory import Memory
from connector.protocol import WorkerHandshake
from worker.nixl_api import NixlAgent
from worker.plan.prepared_rows import PreparedRows

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
    def num_local_lists(self) -> int:
        return len(self._local)

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
