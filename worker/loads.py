"""Decode side: one record per in-flight request, from its LoadSpec to its one outcome.

A ``Load`` waits for its peer's handshake, then plans and posts one READ per remote rank it
reads (each carrying that rank's free notification) and sends notification-only messages to
the ranks it covers but does not read. It ends once, with success or a reason, and only when
no posted READ is live: decode blocks are never handed back under a READ.

An abort (ReleaseSpec) drops a not-yet-posted load, notifies every covered remote rank so
prefill frees its blocks, and ends with reason "aborted"; an abort during a READ waits for it.
A failed load also notifies the covered ranks it had not notified (best effort), so prefill
does not hold its blocks until the lease expires.

Transfer thread only (worker/transfer_thread.py): this module calls the NIXL agent.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from connector.errors import ConnectorError
from connector.memory import HOST_MEMORY, Memory
from connector.metadata import LoadSpec, RemoteSource
from connector.metrics import MetricsRecorder, default_recorder
from connector.protocol import encode_free_notif
from connector.trace import LoadTimeline, load_ended
from worker.nixl_api import Descriptors, NixlAgent, TransferState
from worker.peers import Peer, PeerState
from worker.planner import RankReads
from worker.planner_prepped import PreparedRows, RankPlan, plan_rank

logger = logging.getLogger(__name__)

ABORTED = "aborted"
MAX_RECENT_IDS = 4096  # ended request ids remembered so a late abort is not reported twice

Outcome = tuple[str, str | None]  # (request id, failure reason or None for success)
BY_INDEX, BY_RANGES = 0, 1  # the parts of a remote rank's reads (worker/planner_prepped.py)
ReadKey = tuple[int, int]  # (remote rank, part)


def build_descriptors(
    region_addresses: Sequence[int],
    regions: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    device: int = 0,
) -> Descriptors:
    """NIXL descriptors (address, length_bytes, device) for byte ranges within regions.

    Written into one (N, 3) array: column_stack plus astype made three more N-row copies
    (131k rows: 0.5 ms instead of 1.6). The rest of issue 10's "5.4 ms here vs 1.3 ms alone"
    was page faults on freshly mapped arrays, fixed by keep_plan_memory_mapped
    (worker/transfer_thread.py).
    """
    bases = np.asarray(region_addresses, dtype=np.int64)
    descriptors = np.empty((len(lengths), 3), dtype=np.int64)
    np.add(bases[regions], offsets, out=descriptors[:, 0])
    descriptors[:, 1] = lengths
    descriptors[:, 2] = device
    return descriptors


@dataclass(eq=False)
class Load:
    """One request on this rank. ``spec`` is None for an abort of a request never loaded."""

    request_id: str
    remote: RemoteSource
    peer: Peer
    spec: LoadSpec | None
    created_s: float
    aborted: bool = False
    failure: str | None = None  # the first failure; the outcome once nothing is live
    started: bool = False  # the plan was posted, or given up on
    posted: dict[ReadKey, Any] = field(default_factory=dict)  # live READ handles
    riding: set[int] = field(default_factory=set)  # ranks whose notification rides a READ
    counts: dict[int, int] = field(default_factory=dict)  # remote rank -> notification count
    notified: set[int] = field(default_factory=set)  # remote ranks told to free
    timeline: LoadTimeline = field(init=False)  # stamped at state changes: metrics, trace

    def __post_init__(self) -> None:
        self.timeline = LoadTimeline(self.created_s)

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason


def _rows(peer: Peer, remote_rank: int) -> PreparedRows | None:
    prepared = peer.prepared.get(remote_rank)
    return None if prepared is None else prepared.rows


class LoadTable:
    """The loads in flight on one rank, keyed by (decode) request id."""

    def __init__(
        self,
        agent: NixlAgent,
        *,
        local_region_addresses: Sequence[int],
        local_memory: Memory = HOST_MEMORY,
        clock: Callable[[], float],
        transfer_timeout_s: float,  # a request's READs are given up after this long on this rank
        handshake_wait_s: float,  # a load waits at most this long for its peer's handshake
        on_peer_failure: Callable[[Peer], None],
        metrics: MetricsRecorder | None = None,  # None: the process's default_recorder()
    ) -> None:
        self._agent = agent
        self._metrics = metrics or default_recorder()
        self._local_addresses = tuple(local_region_addresses)
        self._local_memory = local_memory
        self._clock = clock
        self._transfer_timeout_s = transfer_timeout_s
        self._handshake_wait_s = handshake_wait_s
        self._on_peer_failure = on_peer_failure
        self._loads: dict[str, Load] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()  # ended ids, to spot late aborts

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._loads

    def __len__(self) -> int:
        return len(self._loads)

    def add(self, spec: LoadSpec, peer: Peer) -> None:
        if spec.request_id in self._loads:
            logger.warning(
                "request %s is already loading; duplicate LoadSpec ignored", spec.request_id
            )
            return
        self._recent.pop(spec.request_id, None)
        self._loads[spec.request_id] = self._new_load(spec.request_id, spec.remote, peer, spec)

    def abort(self, request_id: str, remote: RemoteSource, peer: Peer) -> None:
        """Abort a request; one never loaded here gets a record only to notify prefill.

        A request this rank already reported is left alone: it was reported once, and its
        free notifications already went out.
        """
        load = self._loads.get(request_id)
        if load is None and request_id in self._recent:
            logger.info("request %s aborted after this rank reported it; nothing to do", request_id)
            return
        if load is None:
            load = self._loads[request_id] = self._new_load(request_id, remote, peer, None)
        load.aborted = True

    def _new_load(
        self, request_id: str, remote: RemoteSource, peer: Peer, spec: LoadSpec | None
    ) -> Load:
        peer.num_loads += 1  # the peer's agents stay loaded until this load ends
        return Load(request_id, remote, peer, spec, self._clock())

    def advance(self) -> list[Outcome]:
        """Move every load as far as it can go; returns the loads that ended."""
        outcomes: list[Outcome] = []
        for load in list(self._loads.values()):
            try:
                self._step(load)
            except Exception as error:  # one request's bug must not stop the engine
                logger.exception("request %s: unexpected error", load.request_id)
                load.fail(f"internal error: {error!r}")
                load.started = True
                self._drop_handles(load)  # else the same error would recur every step
            if load.started and not load.posted:
                outcomes.append(self._finish(load))
        return outcomes

    def abandon_all(self) -> None:
        """Shutdown: release every live READ handle (best effort) and drop the records."""
        for load in self._loads.values():
            self._drop_handles(load)
            load.peer.num_loads -= 1
        self._loads.clear()

    def _drop_handles(self, load: Load) -> None:
        for key in list(load.posted):
            try:
                self._release(load, key)
            except Exception:  # the agent is in an unknown state: forget the handle anyway
                logger.exception("request %s: dropping READ handle", load.request_id)
                del load.posted[key]
                load.peer.num_live_transfers -= 1

    def _step(self, load: Load) -> None:
        if not load.started:
            self._start(load)
        elif load.posted:
            self._poll(load)

    def _start(self, load: Load) -> None:
        peer = load.peer
        if peer.state is PeerState.HANDSHAKING:
            # Handshakes are bounded by their own timeouts; this bounds the wait for any other
            # reason (a queue of handshakes to dead peers ahead of this one, a lost result).
            if self._clock() - load.created_s > self._handshake_wait_s:
                load.started = True
                load.fail(
                    f"handshake with prefill engine {peer.engine_id} at {peer.address} did not "
                    f"finish within {self._handshake_wait_s} s"
                )
            return
        load.started = True
        if peer.state is PeerState.READY:
            load.timeline.handshake_ready_s = self._clock()
        if peer.state is PeerState.FAILED:
            load.fail(f"handshake with prefill engine {peer.engine_id} failed: {peer.failure}")
        elif load.aborted or load.spec is None:
            load.fail(ABORTED)
        else:
            self._post(load, load.spec, peer)

    def _post(self, load: Load, spec: LoadSpec, peer: Peer) -> None:
        planner = peer.planner
        if planner is None:
            raise RuntimeError(f"peer {peer.engine_id} is READY without a planner")
        try:
            segments = planner.segments(
                spec.local_block_ids,
                spec.remote.remote_block_ids,
                num_tokens=spec.num_tokens,
                num_cached_tokens=spec.num_cached_tokens,
            )
            plans = [
                found
                for rank in planner.read_ranks
                if (found := plan_rank(planner, segments, rank, _rows(peer, rank))) is not None
            ]
        except ConnectorError as error:
            load.fail(f"cannot plan the transfer: {error}")
            return
        unknown = sorted({plan.remote_rank for plan in plans} - set(peer.agent_names))
        if unknown:
            load.fail(f"the plan reads remote ranks {unknown} this rank did not handshake with")
            return
        load.timeline.planned(
            self._clock(), ((p.remote_rank, lengths) for p in plans for lengths in p.lengths())
        )
        load.counts = planner.consumers
        for plan in plans:
            if not self._post_rank(load, peer, plan):
                return
        load.timeline.posted_s = self._clock()
        read_ranks = {plan.remote_rank for plan in plans}
        for remote_rank in sorted(set(load.counts) - read_ranks):
            self._notify(load, remote_rank)

    def _post_rank(self, load: Load, peer: Peer, plan: RankPlan) -> bool:
        """Post the one or two READs of a remote rank. A single READ carries the rank's free
        notification; with two, it is sent once both are done (neither may free early)."""
        remote_rank = plan.remote_rank
        notif = b""
        if plan.num_reads == 1:
            notif = encode_free_notif(load.remote.remote_request_id, self._count(load, remote_rank))
            load.riding.add(remote_rank)
        if plan.by_index is not None:
            prepared = peer.prepared[remote_rank]
            make = functools.partial(
                self._agent.make_prepped_read,
                prepared.local_list,
                plan.by_index.local_indices,
                prepared.remote_list,
                plan.by_index.remote_indices,
                notif,
            )
            if not self._post_read(load, (remote_rank, BY_INDEX), make):
                return False
        if plan.ranges is not None:
            make = functools.partial(self._make_range_read, peer, plan.ranges, notif)
            if not self._post_read(load, (remote_rank, BY_RANGES), make):
                return False
        return True

    def _make_range_read(self, peer: Peer, reads: RankReads, notif: bytes) -> Any:
        handshake = peer.handshakes[reads.remote_rank]
        local = build_descriptors(
            self._local_addresses,
            reads.local_regions,
            reads.local_offsets,
            reads.lengths,
            self._local_memory.device,
        )
        remote = build_descriptors(
            handshake.region_addresses,
            reads.remote_regions,
            reads.remote_offsets,
            reads.lengths,
            handshake.memory.device,
        )
        return self._agent.make_read(
            peer.agent_names[reads.remote_rank],
            local,
            remote,
            notif,
            local_memory=self._local_memory,
            remote_memory=handshake.memory,
        )

    def _post_read(self, load: Load, key: ReadKey, make: Callable[[], Any]) -> bool:
        try:
            handle = make()
        except ConnectorError as error:
            self._transfer_failed(load, key[0], error)
            return False
        load.posted[key] = handle
        load.peer.num_live_transfers += 1
        try:
            self._agent.post(handle)
        except ConnectorError as error:
            self._transfer_failed(load, key[0], error)
            self._release(load, key)
            return False
        return True

    def _poll(self, load: Load) -> None:
        for key, handle in list(load.posted.items()):
            remote_rank = key[0]
            try:
                state = self._agent.check(handle)
            except ConnectorError as error:
                self._transfer_failed(load, remote_rank, error)
                self._release(load, key)
                continue
            if state is TransferState.DONE:
                load.timeline.done_s = self._clock()
                self._release(load, key)
                if not any(k[0] == remote_rank for k in load.posted):
                    self._rank_done(load, remote_rank)
            elif self._clock() - load.created_s > self._transfer_timeout_s:
                load.fail(
                    f"READ from prefill engine {load.peer.engine_id} rank {remote_rank} did not "
                    f"finish within {self._transfer_timeout_s} s"
                )
                # A READ the backend cannot cancel stays live: keep waiting for it.
                self._release(load, key, keep_if_live=True)

    def _rank_done(self, load: Load, remote_rank: int) -> None:
        """Every READ from ``remote_rank`` landed: its free notification rode on the READ, or
        goes now (a request read in two parts, unless one of them failed)."""
        if remote_rank in load.riding:
            load.notified.add(remote_rank)
        elif load.failure is None:
            self._notify(load, remote_rank)

    def _finish(self, load: Load) -> Outcome:
        del self._loads[load.request_id]
        load.peer.num_loads -= 1
        self._recent[load.request_id] = None
        if len(self._recent) > MAX_RECENT_IDS:
            self._recent.popitem(last=False)
        if load.failure is not None or load.aborted:
            self._notify_rest(load)
        reason = ABORTED if load.aborted else load.failure
        if reason is not None and reason != ABORTED:
            logger.warning("request %s failed: %s", load.request_id, reason)
        self._record(load, reason)
        return load.request_id, reason

    def _record(self, load: Load, reason: str | None) -> None:
        """The load's metrics and trace line (see connector/trace.py); never raises."""
        load.timeline.notified_ranks = set(load.notified)
        ids = (
            load.request_id,
            load.remote.remote_request_id,
            load.peer.engine_id,
            self._agent.name,
        )
        try:
            load_ended(self._metrics, load.timeline, ids=ids, reason=reason, now_s=self._clock())
        except Exception:  # a metrics bug must not cost the request its outcome
            logger.exception("request %s: recording its metrics failed", load.request_id)

    def _notify_rest(self, load: Load) -> None:
        """Tell every covered remote rank not yet notified that its blocks may be freed."""
        if load.peer.state is not PeerState.READY:
            return
        ranks = set(load.peer.duty) | set(load.counts)
        for remote_rank in sorted(ranks - load.notified):
            self._notify(load, remote_rank)

    def _notify(self, load: Load, remote_rank: int) -> None:
        agent_name = load.peer.agent_names.get(remote_rank)
        if agent_name is None:
            logger.warning(
                "request %s: no agent for remote rank %d to notify", load.request_id, remote_rank
            )
            return
        message = encode_free_notif(load.remote.remote_request_id, self._count(load, remote_rank))
        try:
            self._agent.send_notif(agent_name, message)
        except ConnectorError as error:
            logger.warning(
                "request %s: notifying remote rank %d failed: %s",
                load.request_id,
                remote_rank,
                error,
            )
            return
        load.notified.add(remote_rank)

    def _count(self, load: Load, remote_rank: int) -> int:
        count = load.counts.get(remote_rank) or load.peer.duty.get(remote_rank)
        return count if count else 1

    def _transfer_failed(self, load: Load, remote_rank: int, error: ConnectorError) -> None:
        load.fail(
            f"READ from prefill engine {load.peer.engine_id} rank {remote_rank} failed: {error}"
        )
        self._on_peer_failure(load.peer)

    def _release(self, load: Load, key: ReadKey, *, keep_if_live: bool = False) -> None:
        """Release a READ handle; with ``keep_if_live`` a handle that will not release stays."""
        try:
            self._agent.release(load.posted[key])
        except ConnectorError as error:
            logger.warning("request %s: releasing READ handle failed: %s", load.request_id, error)
            if keep_if_live:
                return
        del load.posted[key]
        load.peer.num_live_transfers -= 1
