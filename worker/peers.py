"""One record per remote engine address: its handshakes, loaded NIXL agents, planner and state.

A ``Peer`` is one generation of our knowledge of a remote engine at one address, keyed by
(engine id, host, port, TP size) exactly as requests name it, so a request naming a wrong port
gets its own record and its own failure, never another address's. It is created when a request
first needs it, READY once every remote rank this rank covers has handshaken, or FAILED with
the reason. When a transfer to it fails (peer gone) the record is marked stale; the next
request for that key starts a fresh handshake, which picks up a restarted peer's new agent
names. A stale record's agents are removed once no load and no posted READ refers to it.

A failed handshake is remembered per key (a negative cache): later requests for that key fail
at once with the reason instead of waiting for a handshake of their own, and one background
probe (a single attempt) per ``probe_interval_s`` finds a prefill that came back under the same
engine id. A restarted prefill normally has a new engine id: a new key, handshaken at once.

The rank's transfer thread only (worker/transfer_thread.py): the table calls the NIXL agent
(add/remove remote agents); the handshake threads behind ``HandshakeClient`` only fetch bytes.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from connector.errors import ConnectorError, HandshakeError, UnsupportedConfiguration
from connector.layout import RankLayout
from connector.metadata import RemoteSource
from connector.metrics import (
    HANDSHAKE_FAILURES,
    HANDSHAKE_SECONDS,
    MetricsRecorder,
    default_recorder,
    handshake_failure_kind,
)
from connector.protocol import PROTOCOL_VERSION, WorkerHandshake
from worker.compat import Fingerprint, check_compatible
from worker.handshake import HandshakeClient, HandshakeJob, HandshakeResult
from worker.nixl_api import NixlAgent
from worker.planner import TransferPlanner
from worker.prepped import PreparedLists, PreparedReads
from worker.topology import head_shapes, notification_duty

logger = logging.getLogger(__name__)

PeerKey = tuple[str, str, int, int]  # (engine id, host, port, remote TP size)
PROBE_INTERVAL_S = 1.0  # a failed peer key gets at most one background probe per interval
MAX_FAILED_KEYS = 1024  # negative-cache bound; the oldest entry goes first


def peer_key(source: RemoteSource) -> PeerKey:
    return (source.engine_id, source.host, source.port, source.tp_size)


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
    prepared: dict[int, PreparedReads] = field(default_factory=dict)  # remote rank -> lists
    stale: bool = False  # superseded: no new requests; agents removed when idle
    stale_reason: str = "a newer handshake superseded it"  # why, for loads still waiting
    probe: bool = False  # a background re-check of a failed key: no request waits on it
    num_live_transfers: int = 0  # posted READs not yet released
    num_loads: int = 0  # loads that hold this record (LoadTable counts them)
    submitted_s: float = 0.0  # when its handshake was submitted (table's clock), for metrics

    @property
    def key(self) -> PeerKey:
        return (self.engine_id, self.host, self.port, self.remote_tp_size)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class _Failure:
    """A key whose last handshake failed: why, when, and when it may be probed again."""

    reason: str
    failed_s: float
    probe_after_s: float
    probing: bool = False


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
    """The current Peer per key, the failed keys, and the retired peers still draining."""

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
        clock: Callable[[], float],
        probe_interval_s: float = PROBE_INTERVAL_S,
        metrics: MetricsRecorder | None = None,  # None: the process's default_recorder()
    ) -> None:
        self._agent = agent
        self._metrics = metrics or default_recorder()
        self._client = client
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._local_layout = local_layout
        self._local_fingerprint = local_fingerprint
        self._shapes = tuple(sorted(head_shapes(local_layout)))
        self._enforce_compat = enforce_compat
        self._clock = clock
        self._probe_interval_s = probe_interval_s
        self._current: dict[PeerKey, Peer] = {}  # HANDSHAKING or READY, never stale
        self._failures: dict[PeerKey, _Failure] = {}  # the negative cache, oldest first
        self._pending: dict[int, Peer] = {}  # job id -> the peer its handshake is for
        self._job_ids = itertools.count(1)
        self._retired: list[Peer] = []  # stale generations whose agents are still loaded
        self._agent_refs: dict[str, int] = {}  # loaded remote agent -> peers using it
        self._lists: PreparedLists | None = None  # set once this rank's memory is registered

    def use_prepared_lists(self, lists: PreparedLists) -> None:
        """Prepare descriptor lists for every peer that becomes READY from now on."""
        self._lists = lists

    def ensure(self, source: RemoteSource) -> Peer:
        """The peer serving ``source``, starting a handshake if none is usable.

        A TP pairing that cannot work, or a key whose handshake failed recently, gives a
        FAILED peer at once, without a handshake.
        """
        key = peer_key(source)
        peer = self._current.get(key)
        if peer is not None:
            return peer
        try:
            duty = notification_duty(self._tp_rank, self._tp_size, source.tp_size, self._shapes)
        except UnsupportedConfiguration as error:
            return _failed_peer(source, str(error))
        failure = self._failures.get(key)
        if failure is not None:
            return self._fail_fast(source, duty, failure)
        peer = Peer(source.engine_id, source.host, source.port, source.tp_size, duty)
        self._current[key] = peer
        self._submit(peer, retries=None)
        return peer

    def poll(self) -> list[Peer]:
        """Peers whose handshake finished since the last call (READY or FAILED)."""
        finished = []
        for result in self._client.poll():
            peer = self._pending.pop(result.job.job_id, None)
            if peer is None:
                logger.error("handshake result for unknown job %s dropped", result.job)
                continue
            self._complete(peer, result)
            finished.append(peer)
        self._remove_idle_retired()
        return finished

    def retire(self, peer: Peer, reason: str | None = None) -> None:
        """No new requests use ``peer``; its agents go once no load or READ refers to it."""
        if peer.stale:
            return
        peer.stale = True
        if reason is not None:
            peer.stale_reason = reason
        self._retired.append(peer)
        if self._current.get(peer.key) is peer:
            del self._current[peer.key]

    def close(self) -> None:
        """Remove every loaded remote agent (at shutdown, once the transfer thread has stopped)."""
        for peer in [*self._current.values(), *self._retired]:
            self._release_lists(peer)
        for name in list(self._agent_refs):
            self._remove_agent(name)
        self._agent_refs.clear()

    def _submit(self, peer: Peer, *, retries: int | None) -> None:
        job_id = next(self._job_ids)
        self._pending[job_id] = peer
        peer.submitted_s = self._clock()
        job = HandshakeJob(
            peer.engine_id, peer.host, peer.port, tuple(peer.duty), job_id=job_id, retries=retries
        )
        self._client.submit(job)

    def _fail_fast(self, source: RemoteSource, duty: dict[int, int], failure: _Failure) -> Peer:
        """A FAILED peer for a key that failed recently; maybe start its background probe."""
        now_s = self._clock()
        if not failure.probing and now_s >= failure.probe_after_s:
            failure.probing = True
            probe = Peer(source.engine_id, source.host, source.port, source.tp_size, duty)
            probe.probe = True
            self._submit(probe, retries=0)
        return _failed_peer(
            source,
            f"{failure.reason} (that was {now_s - failure.failed_s:.1f} s ago; until a "
            f"background probe, at most one per {self._probe_interval_s} s, reaches it, "
            "requests for it fail at once)",
        )

    def _complete(self, peer: Peer, result: HandshakeResult) -> None:
        if result.error is not None:
            self._fail(peer, result.error)
            return
        if peer.stale:
            self._fail(peer, f"engine {peer.engine_id} at {peer.address}: {peer.stale_reason}")
            return
        try:
            self._load(peer, result.handshakes)
        except ConnectorError as error:
            self._fail(peer, str(error))
            return
        peer.state = PeerState.READY
        self._metrics.observe(HANDSHAKE_SECONDS, self._clock() - peer.submitted_s)
        logger.info("handshake with engine %s at %s done", peer.engine_id, peer.address)
        if peer.probe:
            self._promote(peer)
        self._retire_replaced(peer)

    def _promote(self, probe: Peer) -> None:
        """A probe reached a failed key: it becomes that key's peer; the failure is forgotten."""
        self._failures.pop(probe.key, None)
        probe.probe = False
        if probe.key in self._current:  # cannot happen while the key was failed; be safe
            self.retire(probe)
            return
        self._current[probe.key] = probe

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
        if self._lists is None:
            return
        for remote_rank in peer.planner.read_ranks:
            prepared = self._lists.prepare(
                peer.planner.groups,
                remote_rank,
                peer.agent_names[remote_rank],
                handshakes[remote_rank],
            )
            if prepared is not None:
                peer.prepared[remote_rank] = prepared

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
            "handshake with engine %s at %s failed: %s", peer.engine_id, peer.address, reason
        )
        peer.state = PeerState.FAILED
        peer.failure = reason
        self._metrics.inc(HANDSHAKE_FAILURES, handshake_failure_kind(reason))
        self._release_lists(peer)
        for name in peer.agent_names.values():
            self._release_agent(name)
        peer.agent_names.clear()
        if self._current.get(peer.key) is peer:
            del self._current[peer.key]
        if not peer.stale:
            self._remember_failure(peer.key, reason)

    def _remember_failure(self, key: PeerKey, reason: str) -> None:
        now_s = self._clock()
        self._failures.pop(key, None)  # re-insert: the dict stays ordered oldest first
        while len(self._failures) >= MAX_FAILED_KEYS:
            del self._failures[next(iter(self._failures))]
        self._failures[key] = _Failure(reason, now_s, now_s + self._probe_interval_s)

    def _retire_replaced(self, ready: Peer) -> None:
        """Another engine id at the same address is gone: that engine restarted as ``ready``."""
        for peer in list(self._current.values()):
            same_address = (peer.host, peer.port) == (ready.host, ready.port)
            if same_address and peer.engine_id != ready.engine_id:
                logger.info("engine %s was replaced by %s", peer.engine_id, ready.engine_id)
                self.retire(
                    peer, f"engine {ready.engine_id} now serves that address; its KV is gone"
                )

    def _remove_idle_retired(self) -> None:
        draining = []
        for peer in self._retired:
            busy = peer.num_live_transfers > 0 or peer.num_loads > 0
            if busy or peer.state is PeerState.HANDSHAKING:
                draining.append(peer)
                continue
            self._release_lists(peer)
            for name in peer.agent_names.values():
                self._release_agent(name)
            peer.agent_names.clear()
        self._retired = draining

    def _release_lists(self, peer: Peer) -> None:
        if self._lists is not None:
            for prepared in peer.prepared.values():
                self._lists.release(prepared)
        peer.prepared.clear()

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


def _failed_peer(source: RemoteSource, reason: str) -> Peer:
    """A FAILED record no table keeps: its loads end at once with ``reason``."""
    peer = Peer(source.engine_id, source.host, source.port, source.tp_size, {})
    peer.state, peer.failure = PeerState.FAILED, reason
    return peer
