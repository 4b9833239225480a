"""The narrow NIXL interface the worker uses; real NIXL and FakeNixl both implement it.

Descriptors are numpy int64 arrays of shape (N, 3): (address, length_bytes, device_id). On
DRAM the device id is 0; on VRAM it is the CUDA device index. Addresses are absolute (region
base + offset). Which kind of memory a list describes travels beside it as a Memory.

Threading: an agent is not thread-safe. Exactly one thread (the worker's transfer thread)
calls its methods after construction.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from connector.memory import HOST_MEMORY, Memory

Descriptors = npt.NDArray[np.int64]  # shape (N, 3): address, length_bytes, device_id
# shape (M, 5): address, length_bytes, device_id, stride_bytes, count. Row r stands for
# ``count`` entries, entry i at address + i * stride_bytes; indices run row by row.
StridedRows = npt.NDArray[np.int64]
# Entries of a prepared list: int32, which NIXL's make_prepped_xfer takes (int64 is converted).
Indices = npt.NDArray[np.int32] | npt.NDArray[np.int64]


class TransferState(enum.Enum):
    IN_PROGRESS = "PROC"
    DONE = "DONE"


class NixlAgent(Protocol):
    """One NIXL agent: registered memory, known remote agents, transfers and notifications.

    Every method raises connector.errors.TransferFailed (or HandshakeError for metadata)
    instead of the library's own exceptions.
    """

    @property
    def name(self) -> str: ...

    def register_regions(
        self, regions: Sequence[tuple[int, int]], memory: Memory = HOST_MEMORY
    ) -> Any:
        """Register (address, length_bytes) ranges of ``memory`` (DRAM, or VRAM on its device);
        returns a handle for deregister."""

    def deregister(self, registration: Any) -> None: ...

    def get_agent_metadata(self) -> bytes: ...

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name. Raises HandshakeError."""

    def remove_remote_agent(self, agent_name: str) -> None: ...

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
        """Prepare a READ of remote[i] into local[i] for every i (lengths must match).

        Each side's rows are of that side's memory kind (DRAM or VRAM), with its device id in
        the third column."""

    def prepare_list(
        self, owner: str | None, rows: StridedRows, memory: Memory = HOST_MEMORY
    ) -> Any:
        """Prepare a descriptor list for READs by index (at handshake time, not per request).

        ``owner`` None: this agent's own memory (the local side); else a loaded remote agent's
        name (the remote side). Returns a handle for make_prepped_read and release_list."""

    def make_prepped_read(
        self,
        local_list: Any,
        local_indices: Indices,
        remote_list: Any,
        remote_indices: Indices,
        notif: bytes = b"",
    ) -> Any:
        """Prepare a READ of remote entry remote_indices[i] into local entry local_indices[i];
        post, check and release it like make_read's. Adjacent entries may be merged."""

    def release_list(self, prepared: Any) -> None:
        """Free a prepared list (its READs released first)."""

    def post(self, transfer: Any) -> TransferState: ...

    def check(self, transfer: Any) -> TransferState:
        """Poll a posted transfer; raises TransferFailed if it failed."""

    def release(self, transfer: Any) -> None: ...

    def send_notif(self, remote_agent: str, message: bytes) -> None: ...

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent name."""

    def close(self) -> None: ...
