r"""One record per remote engine address: its handshakes, loaded NIXL agents, PeerPlan and state.

A ``Peer`` is one generation of our knowledge of a remote engine at one address, keyed by
(engine id, host, port, TP size) exactly as requests name it, so a request naming a wrong port
gets its own record and its own failure, never another address's. It is created when a request
first needs it, READY once every remote rank this rank covers has handshaken, or FAILED with
the reason. When a transfer to it fails (peer gone) the record is retired; the next request
for that key starts a fresh handshake, which picks up a restarted peer's new agent names. A
retired record's prepared lists and agents are freed once no load and no posted READ refers to
it. Its states and moves (``PEER_LIFECYCLE``):

    HANDSHAKING ──► READY ──► RETIRED ──► CLOSED      (retired: no new loads; closed once
        │   \                                          idle, its lists and agents freed)
        │    └──► RETIRED_HANDSHAKING ──► FAILED
        └──────────────────────────────► FAILED
    PROBING (a background re-check of a failed key) ──► READY | FAILED

A failed handshake is remembered per key (a negative cache) while the failure is fresh:
requests for that key then fail at once with the reason instead of waiting for a handshake of
their own, and one background probe (a single attempt) per ``PROBE_INTERVAL_S`` looks for a
prefill that came back under the same engine id (a stopped one continued, say). A probe that
has answered decides the next request, even before the transfer thread's next poll. A failure
no attempt has confirmed for ``STALE_AFTER_S`` (no request asked for the key meanwhile, so
nobody probed) is no longer believed: the next request makes one fresh attempt, and it and the
requests after it wait for that attempt instead of failing with a reason that may be stale. A
restarted prefill normally has a new engine id: a new key, handshaken at once.

The rank's transfer thread only (worker/connector.py): the table calls the NIXL agent
(add/remove remote agents); the handshake threads behind ``HandshakeClient`` only fetch bytes.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from connector.errors import ConnectorError, HandshakeError, UnsupportedConfiguration
from connector.layout import RankLayout
from connector.lifecycle import TransitionTable
from connector.metadata import RemoteSource, SideChannelBoot
from connector.observability.metrics import (
    HANDSHAKE_FAILURES,
    HANDSHAKE_SECONDS,
    default_recorder,
    handshake_failure_kind,
)
from connector.protocol import WorkerHandshake
from worker.handshake import (
    Fingerprint,
    HandshakeClient,
    HandshakeJob,
    HandshakeResult,
    Phase,
    check_compatible,
    check_transport,
    describe_phases,
    validate_handshakes,
)
from worker.nixl_api import NixlAgent
from worker.plan.recipe import PeerPlan, peer_plan
from worker.reads import PreparedLists, PreparedReads
from worker.topology import head_shapes, notification_duty

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0  # a failed peer key gets at most one background probe per interval
STALE_AFTER_S = 3.0  # a failure no attempt confirmed for this long: the next request retries
MAX_FAILED_KEYS = 1024  # negative-cache bound; the oldest entry goes first
SLOW_HANDSHAKE_S = 5.0  # a handshake this slow is logged as a warning, with its phases

PeerKey = tuple[SideChannelBoot, int]  # (the side channel, remote TP size)


class PeerState(enum.Enum):
    HANDSHAKING = "handshaking"  # the key's handshake is in flight; loads wait for it
    PROBING = "probing"  # a background re-check of a failed key: no load waits on it
    RETIRED_HANDSHAKING = "retired_handshaking"  # superseded mid-handshake: it will fail
    READY = "ready"  # handshaken: carries its PeerLink
    RETIRED = "retired"  # superseded: no new loads; its agents go once it is idle
    FAILED = "failed"  # the handshake failed (``failure`` says why); terminal
    CLOSED = "closed"  # a retired peer's agents and lists are gone; terminal


_S = PeerState
PEER_LIFECYCLE = TransitionTable(
    "peer",
    {
        _S.HANDSHAKING: {_S.READY, _S.FAILED, _S.RETIRED_HANDSHAKING},
        _S.PROBING: {_S.READY, _S.FAILED},
        _S.RETIRED_HANDSHAKING: {_S.FAILED},
        _S.READY: {_S.RETIRED},
        _S.RETIRED: {_S.CLOSED},
        _S.FAILED: (),
        _S.CLOSED: (),
    },
)
_WAITING = frozenset({_S.HANDSHAKING, _S.PROBING, _S.RETIRED_HANDSHAKING})


@dataclass(frozen=True)
class PeerLink:
    """What a completed handshake gives a peer, all at once: a READY peer always has one."""

    plan: PeerPlan  # pairing, prepared rows (only where lists were prepared), duty
    handshakes: dict[int, WorkerHandshake]  # remote rank -> what it sent
    agent_names: dict[int, str]  # remote rank -> its loaded NIXL agent
    prepared: dict[int, PreparedReads]  # remote rank -> prepared lists (READs by index)


@dataclass(eq=False)
class Peer:
    """One generation of a remote engine as this rank knows it.

    ``state`` moves only through PEER_LIFECYCLE (the methods below, called by PeerTable);
    ``link`` is set by the same call that makes it READY. It carries the count of loads and
    posted READs holding it.
    """

    engine_id: str
    host: str
    port: int
    remote_tp_size: int
    # Remote rank this rank covers -> readers its free notification counts: computed once per
    # peer (worker.topology.notification_duty), used for the handshake, the PeerPlan and loads.
    duty: dict[int, int]
    state: PeerState = PeerState.HANDSHAKING
    failure: str | None = None  # why the handshake failed (FAILED only)
    restarted: bool = False  # FAILED because the side channel is a later boot than the params'
    link: PeerLink | None = None  # set with READY, kept while RETIRED
    stale_reason: str = "a newer handshake superseded it"  # why it retired, for waiting loads
    num_live_transfers: int = 0  # posted READs not yet released (LoadTable counts them)
    num_loads: int = 0  # loads that hold this record (LoadTable counts them)
    submitted_s: float = 0.0  # when its handshake was submitted (table's clock), for metrics
    handshake_phases: str = ""  # where its handshake's time went (worker/handshake.py)
    # The prefill boot the requests' params name ("": params without one). A prefill restarted
    # under the same engine id and address is another peer: its params name another boot.
    boot_id: str = ""

    @property
    def key(self) -> PeerKey:
        side_channel = SideChannelBoot(self.engine_id, self.host, self.port, self.boot_id)
        return (side_channel, self.remote_tp_size)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def waiting(self) -> bool:
        """Its handshake is still in flight."""
        return self.state in _WAITING

    @property
    def retired(self) -> bool:
        return self.state in (_S.RETIRED_HANDSHAKING, _S.RETIRED, _S.CLOSED)

    @property
    def idle(self) -> bool:
        return self.num_live_transfers == 0 and self.num_loads == 0

    def connect(self, link: PeerLink) -> None:
        """The handshake completed: READY, with what it gave."""
        self.state = PEER_LIFECYCLE.move(self._subject, self.state, _S.READY)
        self.link = link

    def fail(self, reason: str, *, restarted: bool = False) -> None:
        self.state = PEER_LIFECYCLE.move(self._subject, self.state, _S.FAILED)
        self.failure = reason
        self.restarted = restarted

    def retire(self, reason: str | None) -> None:
        target = _S.RETIRED if self.state is _S.READY else _S.RETIRED_HANDSHAKING
        self.state = PEER_LIFECYCLE.move(self._subject, self.state, target)
        if reason is not None:
            self.stale_reason = reason

    def close(self) -> None:
        self.state = PEER_LIFECYCLE.move(self._subject, self.state, _S.CLOSED)

    @property
    def _subject(self) -> str:
        return f"peer {self.engine_id} at {self.address}"


@dataclass
class _Failure:
    """A key whose last handshake failed: why, and when (it may be probed PROBE_INTERVAL_S on)."""

    reason: str
    failed_s: float
    probing: bool = False
    restarted: bool = False  # the side channel answered as a later boot than the params name


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
        local_backends: Sequence[str] = ("UCX",),
    ) -> None:
        self._agent = agent
        self._metrics = default_recorder()
        self._client = client
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._local_layout = local_layout
        self._local_fingerprint = local_fingerprint
        self._shapes = tuple(sorted(head_shapes(local_layout)))
        self._enforce_compat = enforce_compat
        self._local_backends = tuple(local_backends)
        self._clock = clock
        self._current: dict[PeerKey, Peer] = {}  # HANDSHAKING or READY
        self._failures: dict[PeerKey, _Failure] = {}  # the negative cache, oldest first
        self._pending: dict[int, Peer] = {}  # job id -> the peer its handshake is for
        self._finished: list[Peer] = []  # handshakes completed since the last poll()
        self._job_ids = itertools.count(1)
        self._retired: list[Peer] = []  # retired generations whose agents are still loaded
        self._agent_refs: dict[str, int] = {}  # loaded remote agent -> peers using it
        self._lists: PreparedLists | None = None  # set once this rank's memory is registered

    def use_prepared_lists(self, lists: PreparedLists) -> None:
        """Prepare descriptor lists for every peer that becomes READY from now on."""
        self._lists = lists

    def ensure(self, source: RemoteSource) -> Peer:
        """The peer serving ``source``, starting a handshake if none is usable.

        A TP pairing that cannot work, or a key whose handshake failed recently (a fresh
        failure, or one a background probe is re-checking), gives a FAILED peer at once,
        without a handshake. A stale failure gets one fresh attempt that the request waits for.
        """
        key: PeerKey = (source.side_channel, source.tp_size)
        failure = self._failures.get(key)
        if failure is not None and failure.probing:
            self._take_results()  # a probe that has answered decides, not the cached failure
            failure = self._failures.get(key)
        peer = self._current.get(key)
        if peer is not None:
            return peer
        try:
            duty = notification_duty(self._tp_rank, self._tp_size, source.tp_size, self._shapes)
        except UnsupportedConfiguration as error:
            return _failed_peer(source, str(error))
        if failure is not None and not self._stale(failure):
            return self._fail_fast(source, duty, failure)
        if failure is not None:  # nobody confirmed it for a while: it may be back; ask once
            del self._failures[key]
        peer = Peer(source.engine_id, source.host, source.port, source.tp_size, duty)
        peer.boot_id = source.boot_id
        self._current[key] = peer
        self._submit(peer, retries=None if failure is None else 0)
        return peer

    def poll(self) -> list[Peer]:
        """Peers whose handshake finished since the last call (READY or FAILED)."""
        self._take_results()
        finished, self._finished = self._finished, []
        self._remove_idle_retired()
        return finished

    def retire(self, peer: Peer, reason: str | None = None) -> None:
        """No new requests use ``peer``; its agents go once no load or READ refers to it."""
        if peer.state not in (PeerState.HANDSHAKING, PeerState.READY):
            return  # already retired, or failed (nothing loaded to drain)
        peer.retire(reason)
        self._retired.append(peer)
        if self._current.get(peer.key) is peer:
            del self._current[peer.key]

    def close(self) -> None:
        """Remove every loaded remote agent (at shutdown, once the transfer thread has stopped)."""
        for peer in [*self._current.values(), *self._retired]:
            self._unlink(peer)
        for name in list(self._agent_refs):  # none left unless a count went wrong: be sure
            self._remove_agent(name)
        self._agent_refs.clear()

    def _submit(self, peer: Peer, *, retries: int | None) -> None:
        job_id = next(self._job_ids)
        self._pending[job_id] = peer
        peer.submitted_s = self._clock()
        job = HandshakeJob(
            peer.engine_id, peer.host, peer.port, tuple(peer.duty), job_id=job_id,
            retries=retries, boot_id=peer.boot_id,
        )  # fmt: skip
        self._client.submit(job)

    def _take_results(self) -> None:
        """Complete the handshakes that finished; poll() reports them."""
        for result in self._client.poll():
            peer = self._pending.pop(result.job.job_id, None)
            if peer is None:
                logger.error("handshake result for unknown job %s dropped", result.job)
                continue
            self._complete(peer, result)
            self._finished.append(peer)

    def _stale(self, failure: _Failure) -> bool:
        """No attempt has confirmed ``failure`` for STALE_AFTER_S, and none is under way."""
        return not failure.probing and self._clock() - failure.failed_s >= STALE_AFTER_S

    def _fail_fast(self, source: RemoteSource, duty: dict[int, int], failure: _Failure) -> Peer:
        """A FAILED peer for a key that failed recently; maybe start its background probe."""
        now_s = self._clock()
        if not failure.probing and now_s >= failure.failed_s + PROBE_INTERVAL_S:
            failure.probing = True
            probe = Peer(
                source.engine_id, source.host, source.port, source.tp_size, duty, PeerState.PROBING
            )
            probe.boot_id = source.boot_id
            self._submit(probe, retries=0)
        return _failed_peer(
            source,
            f"{failure.reason} (that was {now_s - failure.failed_s:.1f} s ago; until a "
            f"background probe, at most one per {PROBE_INTERVAL_S} s, reaches it, "
            "requests for it fail at once)",
            restarted=failure.restarted,
        )

    def _complete(self, peer: Peer, result: HandshakeResult) -> None:
        if result.error is not None:
            self._fail(peer, result.error, restarted=result.restarted)
            return
        if peer.state is PeerState.RETIRED_HANDSHAKING:
            self._fail(peer, f"engine {peer.engine_id} at {peer.address}: {peer.stale_reason}")
            return
        was_probe = peer.state is PeerState.PROBING
        phases = [*result.phases, Phase("collected", self._clock() - result.finished_s)]
        try:
            link = self._link(peer, result.handshakes, phases)
        except ConnectorError as error:
            self._fail(peer, f"{error} ({describe_phases(phases)})")
            return
        peer.handshake_phases = describe_phases(phases)
        peer.connect(link)
        took_s = self._clock() - peer.submitted_s
        self._metrics.observe(HANDSHAKE_SECONDS, took_s)
        # A slow handshake is worth a line even when no load fails for it: where did it wait?
        level = logging.WARNING if took_s >= SLOW_HANDSHAKE_S else logging.INFO
        logger.log(
            level, "handshake with engine %s at %s done in %.2f s (%s)",
            peer.engine_id, peer.address, took_s, peer.handshake_phases,
        )  # fmt: skip
        if was_probe:
            self._promote(peer)
        self._retire_replaced(peer)

    def _promote(self, probe: Peer) -> None:
        """A probe reached a failed key: it becomes that key's peer; the failure is forgotten."""
        self._failures.pop(probe.key, None)
        if probe.key in self._current:  # cannot happen while the key was failed; be safe
            self.retire(probe)
            return
        self._current[probe.key] = probe

    def _link(
        self, peer: Peer, handshakes: dict[int, WorkerHandshake], phases: list[Phase]
    ) -> PeerLink:
        """Validate, build the PeerPlan, then load the agents and prepare lists (the steps with
        side effects, undone if a later one fails); each step's time is appended to ``phases``."""
        started_s = self._clock()
        validate_handshakes(peer.engine_id, peer.remote_tp_size, handshakes)
        for handshake in handshakes.values():
            check_transport(self._local_backends, handshake.backends)
            remote = Fingerprint(handshake.fingerprint, handshake.compat_facts)
            tolerated = check_compatible(self._local_fingerprint, remote, self._enforce_compat)
            if tolerated:
                logger.warning(
                    "engine %s differs from ours (enforce_handshake_compat=false): %s",
                    peer.engine_id,
                    "; ".join(tolerated),
                )
        plan = self._peer_plan(peer, handshakes)
        started_s = _timed(phases, "plan", started_s, self._clock())
        agent_names: dict[int, str] = {}
        try:
            for remote_rank, handshake in sorted(handshakes.items()):
                agent_names[remote_rank] = self._add_agent(handshake)
        except ConnectorError:
            for name in agent_names.values():
                self._release_agent(name)
            raise
        started_s = _timed(phases, "add agents", started_s, self._clock())
        prepared = self._prepare(plan, agent_names, handshakes)
        _timed(phases, "prepare lists", started_s, self._clock())
        plan = plan.without_rows([rank for rank in plan.rows if rank not in prepared])
        return PeerLink(plan, dict(handshakes), agent_names, prepared)

    def _peer_plan(self, peer: Peer, handshakes: dict[int, WorkerHandshake]) -> PeerPlan:
        """The pairing with the first rank's layout; prepared rows only where lists can be
        prepared (this rank's memory is registered)."""
        first = handshakes[min(handshakes)]
        if self._lists is None:
            return peer_plan(self._local_layout, first.layout, duty=peer.duty)
        remote = {rank: (h.region_addresses, h.memory.device) for rank, h in handshakes.items()}
        return peer_plan(
            self._local_layout, first.layout, duty=peer.duty,
            local_addresses=self._lists.local_addresses, local_device=self._lists.local_device,
            remote_addresses=remote,
        )  # fmt: skip

    def _prepare(
        self,
        plan: PeerPlan,
        agent_names: dict[int, str],
        handshakes: dict[int, WorkerHandshake],
    ) -> dict[int, PreparedReads]:
        """Prepare the lists of every rank the plan has rows for; a rank NIXL refused is left
        out (its requests use byte ranges)."""
        if self._lists is None:
            return {}
        prepared = {}
        for remote_rank, rows in plan.rows.items():
            found = self._lists.prepare(rows, agent_names[remote_rank], handshakes[remote_rank])
            if found is not None:
                prepared[remote_rank] = found
        return prepared

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

    def _fail(self, peer: Peer, reason: str, *, restarted: bool = False) -> None:
        logger.warning(
            "handshake with engine %s at %s failed: %s", peer.engine_id, peer.address, reason
        )
        retired = peer.retired
        peer.fail(reason, restarted=restarted)
        self._metrics.inc(HANDSHAKE_FAILURES, handshake_failure_kind(reason))
        if self._current.get(peer.key) is peer:
            del self._current[peer.key]
        if not retired:
            self._remember_failure(peer.key, reason, restarted)

    def _remember_failure(self, key: PeerKey, reason: str, restarted: bool) -> None:
        self._failures.pop(key, None)  # re-insert: the dict stays ordered oldest first
        while len(self._failures) >= MAX_FAILED_KEYS:
            del self._failures[next(iter(self._failures))]
        self._failures[key] = _Failure(reason, self._clock(), restarted=restarted)

    def _retire_replaced(self, ready: Peer) -> None:
        """Another engine id, or another boot of the same one, at the same address is gone:
        that engine restarted as ``ready``."""
        for peer in list(self._current.values()):
            same_address = (peer.host, peer.port) == (ready.host, ready.port)
            other_boot = bool(peer.boot_id and ready.boot_id) and peer.boot_id != ready.boot_id
            if same_address and peer.engine_id != ready.engine_id:
                logger.info("engine %s was replaced by %s", peer.engine_id, ready.engine_id)
                self.retire(
                    peer, f"engine {ready.engine_id} now serves that address; its KV is gone"
                )
            elif same_address and other_boot:
                logger.info("engine %s restarted (boot %s)", ready.engine_id, ready.boot_id)
                self.retire(peer, f"engine {ready.engine_id} restarted; that boot's KV is gone")

    def _remove_idle_retired(self) -> None:
        draining = []
        for peer in self._retired:
            if peer.waiting or not peer.idle:
                draining.append(peer)
            elif peer.state is PeerState.RETIRED:
                self._unlink(peer)
                peer.close()
        self._retired = draining

    def _unlink(self, peer: Peer) -> None:
        """Free a peer's prepared lists, then its agents (the lists refer to them)."""
        link = peer.link
        if link is None:
            return
        if self._lists is not None:
            for prepared in link.prepared.values():
                self._lists.release(prepared)
        for name in link.agent_names.values():
            self._release_agent(name)

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


def _timed(phases: list[Phase], name: str, started_s: float, now_s: float) -> float:
    """Append the step that ran from ``started_s`` to ``now_s``; the next step starts now."""
    phases.append(Phase(name, now_s - started_s))
    return now_s


def _failed_peer(source: RemoteSource, reason: str, *, restarted: bool = False) -> Peer:
    """A FAILED record no table keeps: its loads end at once with ``reason``."""
    peer = Peer(
        source.engine_id, source.host, source.port, source.tp_size, {}, PeerState.FAILED, reason
    )
    peer.boot_id = source.boot_id
    peer.restarted = restarted
    return peer
