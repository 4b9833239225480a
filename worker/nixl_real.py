"""The NixlAgent Protocol over real NIXL: one agent on DRAM or VRAM, library errors translated.

Measured on loopback (nixl 1.5.1; benchmarks/README.md, nixl_bandwidth):

- Progress thread. ``nixl_agent`` hard-codes the progress thread's delay to 0 us, and that
  thread then spins a full core per agent. We build the agent with a delay instead (default
  1000 us): idle CPU drops to ~1%, and bandwidth and notification latency do not suffer (the
  thread waits on UCX events); the side that is read from needs no driving.
- With ``progress_delay_us=None`` there is no progress thread at all. Then the side that is
  read from MUST call ``get_new_notifs()`` (or ``check``) regularly, or a READ against it
  stays IN_PROGRESS forever (prefill polls ``get_new_notifs()`` anyway, for free notifications).
- The first agent of a process is slow (the UCX context). Create one agent per worker rank,
  early, with a fresh name per process start: a peer that restarts under the same name is
  refused (nixlNotAllowedError) until removed and re-added.
- Set ``UCX_NET_DEVICES=lo`` for loopback tests, or UCX also opens lanes on other interfaces.

Threading: like every NixlAgent, one thread calls the methods (the progress thread is NIXL's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import nixl._bindings as nixl_bindings
import numpy as np
from nixl._api import (
    nixl_agent,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_xfer_handle,
)

from connector.config import DEFAULT_NIXL_THREADS
from connector.errors import HandshakeError, TransferFailed, UnsupportedConfiguration
from connector.memory import HOST_MEMORY, Memory
from worker.descriptors import (
    check_known_remote,
    checked_indices,
    checked_read_descriptors,
    checked_regions,
    checked_strided_rows,
    list_entries,
)
from worker.nixl_api import Descriptors, Indices, StridedRows, TransferState

DEFAULT_PROGRESS_DELAY_US = 1000

# Every exception class the NIXL binding raises (nixlNotFoundError, nixlRemoteDisconnectError,
# ...). They derive from Exception directly, with no common NIXL base class.
_NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    cls
    for attr, cls in vars(nixl_bindings).items()
    if attr.startswith("nixl") and isinstance(cls, type) and issubclass(cls, Exception)
)

# What each NIXL error means for us, by class name. Anything else: "backend error".
_EXPLANATIONS = {
    "nixlRemoteDisconnectError": (
        "the remote agent disconnected (its process died or closed its agent); bytes that "
        "landed are garbage. Fail the request and handshake again with the restarted peer"
    ),
    "nixlNotFoundError": (
        "NIXL did not find it: a descriptor outside the memory registered on its side, a "
        "registration already removed, or an unknown agent. Check the region addresses and "
        "layout exchanged in the handshake"
    ),
    "nixlInvalidParamError": (
        "the local and remote descriptor lists differ in count or in per-descriptor length"
    ),
    "nixlMismatchError": (
        "the agent metadata is corrupt, truncated or from an incompatible NIXL build. "
        "Fetch it again from the peer's side channel"
    ),
    "nixlNotAllowedError": (
        "an agent with this name is already loaded with different metadata (a peer restarted "
        "under the same name?). Remove it and add it again; give agents fresh names per start"
    ),
}


@contextlib.contextmanager
def _translated(action: str, error_type: type[Exception] = TransferFailed) -> Iterator[None]:
    """Turn any NIXL exception raised inside the block into ``error_type`` naming ``action``."""
    try:
        yield
    except _NIXL_ERRORS as exc:
        name = type(exc).__name__
        explanation = _EXPLANATIONS.get(name, "NIXL backend error; see the NIXL log above")
        raise error_type(f"{action} failed: {explanation} [{name}: {exc}]") from exc


@dataclass(frozen=True)
class RealRead:
    """A prepared READ: the NIXL handle plus what error messages need to name."""

    handle: nixl_xfer_handle
    remote_agent: str
    num_descriptors: int
    num_bytes: int | None  # None: a READ by index (summing its lengths would cost a pass)

    def describe(self) -> str:
        size = "" if self.num_bytes is None else f" ({self.num_bytes} bytes)"
        return f"READ of {self.num_descriptors} descriptors{size} from agent {self.remote_agent!r}"


@dataclass
class RealPreparedList:
    """A prepared descriptor list: the NIXL handle and what checks and messages need."""

    handle: nixl_prepped_dlist_handle
    owner: str  # the agent whose memory it describes
    num_entries: int
    local: bool


class RealNixlAgent:
    """One NIXL agent (UCX on DRAM) implementing worker.nixl_api.NixlAgent.

    ``progress_delay_us``: the progress thread's poll delay, or None for no progress thread
    (then the caller drives progress; see the module docstring).
    ``num_threads``: UCX backend worker threads (0: NIXL's default).
    """

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        num_threads: int = DEFAULT_NIXL_THREADS,
        progress_delay_us: int | None = DEFAULT_PROGRESS_DELAY_US,
    ) -> None:
        if not name:
            raise UnsupportedConfiguration("NIXL agent name is empty; give each agent a name")
        self._name = name
        self._agent: nixl_agent | None = _create_nixl_agent(
            name, tuple(backends), num_threads, progress_delay_us
        )
        self._remote_agents: set[str] = set()

    @property
    def name(self) -> str:
        return self._name

    def register_regions(
        self, regions: Sequence[tuple[int, int]], memory: Memory = HOST_MEMORY
    ) -> Any:
        agent = self._live()
        # vLLM aliases cache groups in one buffer, so the same region can come twice; NIXL
        # registers a repeated row but segfaults unregistering it (nixlUcxEngine::unloadMD).
        rows = _region_rows(list(dict.fromkeys(checked_regions(regions))), memory)
        action = f"registering {len(rows)} regions of {memory.describe()} with agent {self._name!r}"
        with _translated(action):
            return agent.register_memory(rows, memory.kind.nixl_name)

    def deregister(self, registration: Any) -> None:
        agent = self._live()
        with _translated(f"deregistering memory of agent {self._name!r} (twice?)"):
            agent.deregister_memory(registration)

    def get_agent_metadata(self) -> bytes:
        agent = self._live()
        with _translated(f"reading the metadata of agent {self._name!r}"):
            return bytes(agent.get_agent_metadata())

    def add_remote_agent(self, metadata: bytes) -> str:
        agent = self._live()
        if not metadata:
            raise HandshakeError(
                "loading 0 bytes of remote agent metadata failed: the agent metadata is empty; "
                "the peer sent none. Fetch it again"
            )
        action = f"loading {len(metadata)} bytes of remote agent metadata"
        with _translated(action, HandshakeError):
            loaded = agent.add_remote_agent(metadata)
        remote_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._remote_agents.add(remote_name)
        return remote_name

    def remove_remote_agent(self, agent_name: str) -> None:
        agent = self._live()
        with _translated(f"removing remote agent {agent_name!r}"):
            agent.remove_remote_agent(agent_name)
        self._remote_agents.discard(agent_name)

    def make_read(
        self,
        remote_agent: str,
        local: Descriptors,
        remote: Descriptors,
        notif: bytes = b"",
        *,
        local_memory: Memory = HOST_MEMORY,
        remote_memory: Memory = HOST_MEMORY,
    ) -> RealRead:
        agent = self._live()
        check_known_remote(self._name, remote_agent, self._remote_agents)
        local_rows, remote_rows = checked_read_descriptors(local, remote)
        num_bytes = int(local_rows[:, 1].sum())
        action = f"preparing a READ of {len(local_rows)} descriptors from agent {remote_agent!r}"
        with _translated(action):
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local_rows, local_memory.kind.nixl_name),
                agent.get_xfer_descs(remote_rows, remote_memory.kind.nixl_name),
                remote_agent,
                notif,
            )
        return RealRead(handle, remote_agent, len(local_rows), num_bytes)

    def prepare_list(
        self, owner: str | None, rows: StridedRows, memory: Memory = HOST_MEMORY
    ) -> RealPreparedList:
        """NIXL keeps strided rows compressed: preparing costs O(rows), not O(entries)."""
        agent = self._live()
        checked = checked_strided_rows(rows)
        if owner is not None:
            check_known_remote(self._name, owner, self._remote_agents)
        where = "local memory" if owner is None else f"agent {owner!r}"
        action = f"preparing a list of {list_entries(checked)} entries of {where}"
        with _translated(action):
            handle = agent.prep_xfer_dlist(owner or "", checked, memory.kind.nixl_name)
        name = self._name if owner is None else owner
        return RealPreparedList(handle, name, list_entries(checked), owner is None)

    def make_prepped_read(
        self,
        local_list: RealPreparedList,
        local_indices: Indices,
        remote_list: RealPreparedList,
        remote_indices: Indices,
        notif: bytes = b"",
    ) -> RealRead:
        agent = self._live()
        if not local_list.local or remote_list.local:
            raise TransferFailed(
                "cannot READ by index: pass this agent's own prepared list as the local side "
                "and a remote agent's as the remote side"
            )
        check_known_remote(self._name, remote_list.owner, self._remote_agents)
        local_idx, remote_idx = checked_indices(
            local_list.num_entries, local_indices, remote_list.num_entries, remote_indices
        )
        action = f"preparing a READ of {len(local_idx)} entries from agent {remote_list.owner!r}"
        with _translated(action):
            handle = agent.make_prepped_xfer(
                "READ", local_list.handle, local_idx, remote_list.handle, remote_idx, notif
            )
        return RealRead(handle, remote_list.owner, len(local_idx), None)

    def release_list(self, prepared: RealPreparedList) -> None:
        self._live()
        with _translated(f"releasing a prepared list of agent {prepared.owner!r}"):
            prepared.handle.release()

    def post(self, transfer: RealRead) -> TransferState:
        agent = self._live()
        with _translated(f"posting the {transfer.describe()}"):
            return _state(agent.transfer(transfer.handle), transfer)

    def check(self, transfer: RealRead) -> TransferState:
        agent = self._live()
        with _translated(f"the {transfer.describe()}"):
            return _state(agent.check_xfer_state(transfer.handle), transfer)

    def release(self, transfer: RealRead) -> None:
        """Free the handle; an unfinished READ is cancelled (raises if it cannot be)."""
        self._live()
        with _translated(f"releasing the {transfer.describe()}"):
            transfer.handle.release()

    def send_notif(self, remote_agent: str, message: bytes) -> None:
        agent = self._live()
        check_known_remote(self._name, remote_agent, self._remote_agents)
        with _translated(f"sending a notification to agent {remote_agent!r}"):
            agent.send_notif(remote_agent, message)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        agent = self._live()
        with _translated(f"collecting notifications of agent {self._name!r}"):
            notifs = agent.get_new_notifs()
        return {str(sender): [bytes(m) for m in messages] for sender, messages in notifs.items()}

    def close(self) -> None:
        """Drop the agent; NIXL destroys it (and its progress thread) once no READ handle
        refers to it, so release every transfer first. Idempotent."""
        self._agent = None
        self._remote_agents.clear()

    def _live(self) -> nixl_agent:
        if self._agent is None:
            raise TransferFailed(f"NIXL agent {self._name!r} is closed; create a new agent")
        return self._agent


def _create_nixl_agent(
    name: str, backends: tuple[str, ...], num_threads: int, progress_delay_us: int | None
) -> nixl_agent:
    """Build a ``nixl_agent`` whose progress thread sleeps ``progress_delay_us`` between polls.

    ``nixl_agent.__init__`` sets the delay to 0 with no way to change it. So we let it build
    its Python bookkeeping around a bare C++ agent (no backend, no progress thread), swap in a
    C++ agent configured our way, and only then create the backends on it.
    """
    if not backends:
        raise UnsupportedConfiguration("no NIXL backend requested; use backends=('UCX',)")
    wrapper = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = nixl_bindings.nixlAgentConfig()
    config.useProgThread = progress_delay_us is not None
    config.pthrDelay = progress_delay_us or 0
    config.useListenThread = False
    config.syncMode = nixl_bindings.NIXL_THREAD_SYNC_NONE
    config.captureTelemetry = False
    wrapper.agent = nixl_bindings.nixlAgent(name, config)
    available = wrapper.get_plugin_list()
    for backend in backends:
        if backend not in available:
            raise UnsupportedConfiguration(
                f"NIXL backend {backend!r} is not available; installed plugins: {available}"
            )
        init = {"num_threads": str(num_threads)} if backend == "UCX" and num_threads > 0 else {}
        with _translated(f"creating NIXL backend {backend!r} for agent {name!r}"):
            wrapper.create_backend(backend, init)
    return wrapper


def _state(status: str, transfer: RealRead) -> TransferState:
    if status == "DONE":
        return TransferState.DONE
    if status == "PROC":
        return TransferState.IN_PROGRESS
    raise TransferFailed(
        f"the {transfer.describe()} failed: NIXL reported state {status!r}. Treat the landed "
        "bytes as garbage and fail the request"
    )


def _region_rows(regions: Sequence[tuple[int, int]], memory: Memory) -> Descriptors:
    """Checked (address, length_bytes) pairs -> NIXL's (N, 3) rows on ``memory``'s device."""
    pairs = np.asarray(regions, dtype=np.int64).reshape(-1, 2)
    return np.column_stack([pairs, np.full(len(pairs), memory.device, dtype=np.int64)])
