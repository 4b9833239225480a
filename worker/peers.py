"""One record per remote engine: its handshakes, loaded NIXL agents, planner and state.

A ``Peer`` is one generation of our knowledge of a remote engine: created when a request first
needs it, READY once every remote rank this rank covers has handshaken, or FAILED with the
reason. When a transfer to it fails (peer gone) the record is marked stale; the next request
for that engine starts a fresh handshake, which picks up a restarted peer's new agent names.
A stale record's agents are removed once no posted READ refers to them.

Engine thread only: the table calls the NIXL agent (add/remove remote agents); the handshake
threads behind ``HandshakeClient`` only fetch bytes.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from connector.errors import ConnectorError, HandshakeError, UnsupportedConfiguration
from connector.layout import RankLayout
from connector.metadata import RemoteSource
from connector.protocol import PROTOCOL_VERSION, WorkerHandshake
from worker.compat import Fingerprint, check_compatible
from worker.handshake import HandshakeClient, HandshakeJob, HandshakeResult
from worker.nixl_api import NixlAgent
from worker.planner import TransferPlanner
from worker.topology import head_shapes, notification_duty

logger = logging.getLogger(__name__)


class PeerState(enum.Enum):
    HANDSHAKING = "handshaking"
    READY = "ready"
    FAILED = "failed"


@dataclass(eq=False)
class Peer:
    """One generation of a remote engine as this rank knows it."""

    engine_id: str
    host: str
    port: int
    remote_tp_size: int
    duty: dict[int, int]  # remote rank this rank covers -> readers its free notification counts
    state: PeerState = PeerState.HANDSHAKING
    failure: str | None = None  # why the handshake failed (FAILED only)
    handshakes: dict[int, WorkerHandshake] = field(default_factory=dict)
    agent_names: dict[int, str] = field(default_factory=dict)  # remote rank -> loaded agent
    planner: TransferPlanner | None = None
    stale: bool = False  # superseded: no new requests; agents removed when idle
    num_live_transfers: int = 0  # posted READs not yet released

    def serves(self, source: RemoteSource) -> bool:
        """True if new requests from ``source`` may use (or wait for) this record."""
        return (
            not self.stale
            and self.state is not PeerState.FAILED
            and (self.host, self.port, self.remote_tp_size)
            == (source.host, source.port, source.tp_size)
        )


def validate_handshakes(
    source_engine_id: str, remote_tp_size: int, handshakes: dict[int, WorkerHandshake]
) -> None:
    """Check what the remote ranks sent agrees with the request and with itself."""
    for remote_rank, handshake in sorted(handshakes.items()):
        where = f"remote rank {remote_rank}"
        if handshake.protocol_version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"{where} speaks protocol version {handshake.protocol_version}, we speak "
                f"{PROTOCOL_VERSION}; run the same connector version on both engines"
            )
        if handshake.engine_id != source_engine_id:
            raise HandshakeError(
                f"{where} belongs to engine {handshake.engine_id!r}, but the request's KV is on "
                f"engine {source_engine_id!r}: the prefill engine restarted and its KV is gone"
            )
        ranks = {
            (handshake.tp_rank, handshake.tp_size),
            (handshake.layout.tp_rank, handshake.layout.tp_size),
        }
        if ranks != {(remote_rank, remote_tp_size)}:
            raise HandshakeError(
                f"{where} says it is rank {handshake.tp_rank} of {handshake.tp_size} (its "
                f"layout: {handshake.layout.tp_rank} of {handshake.layout.tp_size}), but the "
                f"request says the prefill engine has tp_size {remote_tp_size}"
            )
        if len(handshake.region_addresses) != len(handshake.layout.region_bytes):
            raise HandshakeError(
                f"{where} sent {len(handshake.region_addresses)} region addresses for a layout "
                f"of {len(handshake.layout.region_bytes)} regions; its handshake is corrupt"
            )


class PeerTable:
    """The current Peer per remote engine id, and the retired ones still draining."""

    def __init__(
        self,
        agent: NixlAgent,
        client: HandshakeClient,
        *,
        tp_rank: int,
        tp_size: int,
        local_layout: RankLayout,
        local_fingerprint: Fingerprint,
        enforce_compat: bool,
    ) -> None:
        self._agent = agent
        self._client = client
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._local_layout = local_layout
        self._local_fingerprint = local_fingerprint
        self._shapes = tuple(sorted(head_shapes(local_layout)))
        self._enforce_compat = enforce_compat
        self._current: dict[str, Peer] = {}  # engine id -> newest generation
        self._pending: dict[HandshakeJob, Peer] = {}  # handshakes in flight
        self._retired: list[Peer] = []  # stale generations whose agents are still loaded
        self._agent_refs: dict[str, int] = {}  # loaded remote agent -> peers using it

    def ensure(self, source: RemoteSource) -> Peer:
        """The peer serving ``source``, starting a handshake if none is usable.

        A TP pairing that cannot work gives a FAILED peer at once, without a handshake.
        """
        peer = self._current.get(source.engine_id)
        if peer is not None and peer.serves(source):
            return peer
        if peer is not None:
            self.retire(peer)
        try:
            duty = notification_duty(self._tp_rank, self._tp_size, source.tp_size, self._shapes)
        except UnsupportedConfiguration as error:
            failed = Peer(source.engine_id, source.host, source.port, source.tp_size, {})
            failed.state, failed.failure = PeerState.FAILED, str(error)
            return failed
        peer = Peer(source.engine_id, source.host, source.port, source.tp_size, duty)
        self._current[source.engine_id] = peer
        job = HandshakeJob(source.engine_id, source.host, source.port, tuple(duty))
        self._pending[job] = peer
        self._client.submit(job)
        return peer

    def poll(self) -> list[Peer]:
        """Peers whose handshake finished since the last call (READY or FAILED)."""
        finished = []
        for result in self._client.poll():
            peer = self._pending.pop(result.job, None)
            if peer is None:
                logger.error("handshake result for unknown job %s dropped", result.job)
                continue
            self._complete(peer, result)
            finished.append(peer)
        self._remove_idle_retired()
        return finished

    def retire(self, peer: Peer) -> None:
        """No new requests use ``peer``; its agents go once its posted READs are released."""
        if peer.stale:
            return
        peer.stale = True
        self._retired.append(peer)
        if self._current.get(peer.engine_id) is peer:
            del self._current[peer.engine_id]

    def close(self) -> None:
        """Remove every loaded remote agent (engine thread, at shutdown)."""
        for name in list(self._agent_refs):
            self._remove_agent(name)
        self._agent_refs.clear()

    def _complete(self, peer: Peer, result: HandshakeResult) -> None:
        if result.error is not None:
            self._fail(peer, result.error)
            return
        if peer.stale:
            self._fail(
                peer, f"handshake with engine {peer.engine_id} was superseded by a newer one"
            )
            return
        try:
            self._load(peer, result.handshakes)
        except ConnectorError as error:
            self._fail(peer, str(error))
            return
        peer.state = PeerState.READY
        logger.info("handshake with engine %s at %s:%d done", peer.engine_id, peer.host, peer.port)
        self._retire_replaced(peer)

    def _load(self, peer: Peer, handshakes: dict[int, WorkerHandshake]) -> None:
        """Validate, build the planner, then load the agents (the step that has side effects)."""
        validate_handshakes(peer.engine_id, peer.remote_tp_size, handshakes)
        for handshake in handshakes.values():
            remote = Fingerprint(handshake.fingerprint, handshake.compat_facts)
            tolerated = check_compatible(self._local_fingerprint, remote, self._enforce_compat)
            if tolerated:
                logger.warning(
                    "engine %s differs from ours (enforce_handshake_compat=false): %s",
                    peer.engine_id,
                    "; ".join(tolerated),
                )
        first = handshakes[min(handshakes)]
        peer.planner = TransferPlanner(self._local_layout, first.layout)
        peer.handshakes = dict(handshakes)
        for remote_rank, handshake in sorted(handshakes.items()):
            peer.agent_names[remote_rank] = self._add_agent(handshake)

    def _add_agent(self, handshake: WorkerHandshake) -> str:
        if handshake.agent_name in self._agent_refs:
            self._agent_refs[handshake.agent_name] += 1
            return handshake.agent_name
        name = self._agent.add_remote_agent(handshake.agent_metadata)
        if name != handshake.agent_name:
            self._agent.remove_remote_agent(name)
            raise HandshakeError(
                f"remote rank {handshake.tp_rank} announced agent {handshake.agent_name!r} but "
                f"its metadata is for agent {name!r}; its handshake is corrupt"
            )
        self._agent_refs[name] = 1
        return name

    def _fail(self, peer: Peer, reason: str) -> None:
        logger.warning(
            "handshake with engine %s at %s:%d failed: %s",
            peer.engine_id, peer.host, peer.port, reason,
        )  # fmt: skip
        peer.state = PeerState.FAILED
        peer.failure = reason
        for name in peer.agent_names.values():
            self._release_agent(name)
        peer.agent_names.clear()
        if self._current.get(peer.engine_id) is peer:
            del self._current[peer.engine_id]

    def _retire_replaced(self, ready: Peer) -> None:
        """Another engine id at the same address is gone: that engine restarted as ``ready``."""
        for peer in list(self._current.values()):
            if peer is not ready and (peer.host, peer.port) == (ready.host, ready.port):
                logger.info("engine %s was replaced by %s", peer.engine_id, ready.engine_id)
                self.retire(peer)

    def _remove_idle_retired(self) -> None:
        draining = []
        for peer in self._retired:
            if peer.num_live_transfers > 0 or peer.state is PeerState.HANDSHAKING:
                draining.append(peer)
                continue
            for name in peer.agent_names.values():
                self._release_agent(name)
            peer.agent_names.clear()
        self._retired = draining

    def _release_agent(self, name: str) -> None:
        refs = self._agent_refs.get(name, 0) - 1
        if refs > 0:
            self._agent_refs[name] = refs
            return
        self._agent_refs.pop(name, None)
        self._remove_agent(name)

    def _remove_agent(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except ConnectorError as error:
            logger.warning("removing remote agent %s failed: %s", name, error)
