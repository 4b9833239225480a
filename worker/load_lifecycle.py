"""One decode load on a worker rank: its record, its lifecycle as data, and what it owes at its end.

    WAITING ──────────────► READING ──────────► CONFIRMING ──► SUCCEEDED
       │  \\                  │   \\                │  \\
       │   └─► FAILING ◄─────┘    └─► ABORT_READING ◄┘   └─► FAILED
       │         │  \\                    │   ▲   ▲
       │         ▼   └────────────────────┼───┘   │
       ├──────► FAILED ◄── (READING,       ▼       │
       │          ▲        nothing live)  ABORTED  │
       │          └──── QUARANTINED ──────────────┘
       │               (from READING or FAILING, on the transfer timeout)
       └─► ABORT_WAITING ──────────────────► ABORTED

    Chunked pulls: READING ──► CHUNK_READ ──► READING (the next LoadSpec's READs), or
                               CHUNK_READ ──► ABORT_READING (an abort, or a failure: ended
                               with it at once, nothing live)

A load waits for its peer's handshake (WAITING), posts its READs (READING), then, with every
READ landed, waits for prefill's word that the lease still holds (CONFIRMING: the proof,
worker/lease_proof.py) and ends once: SUCCEEDED, FAILED or ABORTED. A failure or an abort
while READs are live waits for them (FAILING, ABORT_READING): decode blocks are never handed
back under a READ. An abort before anything was posted still waits for the handshake
(ABORT_WAITING), to notify prefill.

A READ past the transfer timeout is not released: NIXL's release of an unfinished READ over
UCX returns success without stopping it (a paused peer's bytes still land later). The load
fails but stays QUARANTINED, not reported and its blocks held, until the backend says every
READ ended (DONE, or an error such as the peer's disconnect); only then is it FAILED.

What a lease check's answer means for the load is here too (``lease_failure``: held, or the
failure and its message); the checks themselves are worker/lease_proof.py.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connector.errors import (
    BlocksMismatch,
    ConnectorError,
    PeerRestarted,
    TokensMismatch,
)
from connector.lifecycle import TransitionTable
from connector.metadata import ABORTED_LOAD, FailureKind, LoadFailure, LoadSpec, RemoteSource
from connector.observability.metrics import MetricsRecorder
from connector.observability.trace import LoadTimeline, load_ended
from connector.protocol import DIGEST_PENDING, encode_free_notif
from worker.nixl_api import NixlAgent

if TYPE_CHECKING:
    from worker.peers import Peer

logger = logging.getLogger(__name__)

ReadKey = tuple[int, int]  # (remote rank, part: BY_INDEX or BY_RANGES)
OnMove = Callable[[str, "RankLoadState", "RankLoadState"], None]  # (request id, from, to)


class RankLoadState(enum.Enum):
    WAITING = enum.auto()  # for the peer's handshake
    ABORT_WAITING = enum.auto()  # aborted before posting: waits for the handshake to notify
    READING = enum.auto()  # READs posted and live
    CONFIRMING = enum.auto()  # every READ landed; asking prefill whether the lease held
    FAILING = enum.auto()  # failed (``failure`` says why); READs still live
    ABORT_READING = enum.auto()  # aborted while READs are live
    QUARANTINED = enum.auto()  # timed out; READs the backend has not ended may still land
    CHUNK_READ = enum.auto()  # chunked pulls: every READ so far landed; more LoadSpecs follow
    SUCCEEDED = enum.auto()
    FAILED = enum.auto()
    ABORTED = enum.auto()


_L = RankLoadState
RANK_LOAD_LIFECYCLE = TransitionTable(
    "rank load",
    {
        _L.WAITING: {_L.READING, _L.FAILING, _L.SUCCEEDED, _L.FAILED, _L.ABORT_WAITING},
        _L.ABORT_WAITING: {_L.ABORTED},
        _L.READING: {
            _L.CONFIRMING,
            _L.FAILING,
            _L.FAILED,
            _L.ABORT_READING,
            _L.QUARANTINED,
            _L.CHUNK_READ,
        },
        _L.CHUNK_READ: {_L.READING, _L.ABORT_READING, _L.FAILED},
        _L.CONFIRMING: {_L.SUCCEEDED, _L.FAILED, _L.ABORT_READING},
        _L.FAILING: {_L.FAILED, _L.ABORT_READING, _L.QUARANTINED},
        _L.QUARANTINED: {_L.FAILED, _L.ABORT_READING},
        _L.ABORT_READING: {_L.ABORTED},
        _L.SUCCEEDED: (),
        _L.FAILED: (),
        _L.ABORTED: (),
    },
)
_ABORTING = frozenset({_L.ABORT_WAITING, _L.ABORT_READING})
_TERMINAL = RANK_LOAD_LIFECYCLE.terminal  # a property that builds its set: once here
_POSTED = frozenset({_L.READING, _L.FAILING, _L.ABORT_READING, _L.QUARANTINED})


@dataclass(eq=False)
class Load:
    """One request on this rank. ``spec`` is None for an abort of a request never loaded.

    ``state`` changes only through ``move`` (and the helpers below), along RANK_LOAD_LIFECYCLE.
    """

    request_id: str
    source: RemoteSource
    peer: Peer
    spec: LoadSpec | None
    created_s: float
    on_move: OnMove | None = None  # tests watch every move
    state: RankLoadState = RankLoadState.WAITING
    failure: LoadFailure | None = None  # the first failure; the outcome unless aborted
    posted: dict[ReadKey, Any] = field(default_factory=dict)  # live READ handles
    proof_ticket: int | None = None  # the lease check in flight (WAITING or CONFIRMING)
    prechecked: bool = False  # the check before posting said the lease holds, or was skipped
    seen_held: bool = False  # the check before posting said the lease holds (not skipped)
    notified: set[int] = field(default_factory=set)  # remote ranks told to free
    quarantined_s: float | None = None  # when a READ outlived the transfer timeout
    stuck_logged: bool = False  # the quarantine outlasted its bound and said so once
    internal_error_logged: bool = False  # an unexpected error on its path was logged once
    timeline: LoadTimeline = field(init=False)  # stamped at state changes: metrics, trace
    queued: list[LoadSpec] = field(default_factory=list)  # chunked pulls: next LoadSpecs
    reads_started_s: float | None = None  # chunked pulls: when the last chunk was posted

    def __post_init__(self) -> None:
        self.timeline = LoadTimeline(self.created_s)

    @property
    def ended(self) -> bool:
        return self.state in _TERMINAL

    @property
    def waiting(self) -> bool:
        return self.state in (_L.WAITING, _L.ABORT_WAITING)

    @property
    def aborting(self) -> bool:
        return self.state in _ABORTING

    @property
    def reason(self) -> LoadFailure | None:
        """The outcome of an ended load: None for success."""
        if self.state is _L.ABORTED:
            return ABORTED_LOAD
        return self.failure if self.state is _L.FAILED else None

    def move(self, target: RankLoadState) -> None:
        current = self.state
        if target is current:
            return
        if not RANK_LOAD_LIFECYCLE.allows(current, target):  # name the load only for the error
            RANK_LOAD_LIFECYCLE.move(f"load of request {self.request_id}", current, target)
        self.state = target
        if self.on_move is not None:
            self.on_move(self.request_id, current, target)

    def fail(self, reason: LoadFailure) -> None:
        """Note a failure (the first one is kept); ``settle`` or ``end`` moves the state."""
        if self.failure is None:
            self.failure = reason

    def abort(self) -> None:
        if self.state is _L.WAITING:
            self.move(_L.ABORT_WAITING)
        elif self.state in (_L.READING, _L.FAILING, _L.CONFIRMING, _L.QUARANTINED, _L.CHUNK_READ):
            self.move(_L.ABORT_READING)

    def quarantine(self, reason: LoadFailure, now_s: float) -> bool:
        """A live READ outlived the transfer timeout: fail, but keep the blocks until the
        backend ends it. True the first time (for metrics and the log)."""
        self.fail(reason)
        if self.state in (_L.READING, _L.FAILING):
            self.move(_L.QUARANTINED)
        if self.quarantined_s is not None:
            return False
        self.quarantined_s = now_s
        return True

    def end(self) -> None:
        """End now, nothing live: aborted if it was, else failed or succeeded."""
        if self.aborting:
            self.move(_L.ABORTED)
        else:
            self.move(_L.FAILED if self.failure is not None else _L.SUCCEEDED)

    def settle(self) -> None:
        """After posting or polling: once nothing is live, confirm READs that all landed (the
        lease proof) or end; with READs live, mark a failure."""
        if self.posted:
            if self.failure is not None and self.state in (_L.WAITING, _L.READING):
                self.move(_L.FAILING)
            elif self.state is _L.WAITING:
                self.move(_L.READING)
        elif self.state is _L.READING and self.failure is None:
            chunk = self.spec is not None and self.spec.chunk
            self.move(_L.CHUNK_READ if chunk else _L.CONFIRMING)
        else:
            self.end()

    @property
    def chunk_read(self) -> bool:
        return self.state is _L.CHUNK_READ

    @property
    def confirming(self) -> bool:
        return self.state is _L.CONFIRMING

    @property
    def reading(self) -> bool:
        return self.state in _POSTED


# What a load owes and records when it ends. Every remote rank its rank covers (the peer's
# duty, worker.topology.notification_duty) gets one free notification, read or not, once the
# lease is proven or the load failed: none rides a READ, so this rank's own notification
# cannot end the lease before the proof. Transfer thread only: sending calls the NIXL agent.

# A failed load that waited this long for its peer's handshake names the handshake's phases.
HANDSHAKE_NOTE_S = 1.0


def notify_rest(agent: NixlAgent, load: Load) -> bool:
    """Tell every covered remote rank not yet notified that it may free the lease's blocks
    (best effort, logged); False if the agent could not send to one of them (its process died
    or closed its agent, say)."""
    link = load.peer.link
    if link is None:
        return True
    key = load.source.lease_key
    sent_all = True
    for remote_rank in sorted(set(load.peer.duty) - load.notified):
        agent_name = link.agent_names.get(remote_rank)
        if agent_name is None:
            logger.warning(
                "request %s: no agent for remote rank %d to notify", load.request_id, remote_rank
            )
            continue
        try:
            agent.send_notif(agent_name, encode_free_notif(key, load.peer.duty[remote_rank]))
        except ConnectorError as error:
            logger.warning(
                "request %s: notifying remote rank %d failed: %s",
                load.request_id, remote_rank, error,
            )  # fmt: skip
            sent_all = False
        else:
            load.notified.add(remote_rank)
    return sent_all


def handshake_failure(remote: RemoteSource, peer: Peer) -> LoadFailure:
    """Why a load whose peer's handshake failed fails: a side channel that answered as a later
    boot than the params name says the lease died with the boot that issued it."""
    if peer.restarted:
        restarted = lease_failure(remote, PeerRestarted(peer.failure or ""), BEFORE_READS)
        if restarted is not None:
            return restarted
    return LoadFailure(
        FailureKind.HANDSHAKE,
        f"handshake with prefill engine {peer.engine_id} failed: {peer.failure}",
    )


def record_outcome(
    metrics: MetricsRecorder,
    agent_name: str,
    load: Load,
    reason: LoadFailure | None,
    now_s: float,
) -> None:
    """The load's metrics and trace line (see connector/observability/trace.py); never raises."""
    load.timeline.notified_ranks = set(load.notified)
    ids = (load.request_id, load.source.remote_request_id, load.peer.engine_id, agent_name)
    try:
        load_ended(metrics, load.timeline, ids=ids, reason=reason, now_s=now_s)
    except Exception:  # a metrics bug must not cost the request its outcome
        logger.exception("request %s: recording its metrics failed", load.request_id)


def with_handshake_phases(load: Load, reason: LoadFailure | None) -> LoadFailure | None:
    """A failure of a load that waited long for its peer's handshake says where that time went
    (a lease that expired meanwhile, say)."""
    ready_s = load.timeline.handshake_ready_s
    phases = load.peer.handshake_phases
    if reason is None or not phases or ready_s is None:
        return reason
    waited_s = ready_s - load.created_s
    if waited_s < HANDSHAKE_NOTE_S:
        return reason
    note = f" (this load waited {waited_s:.1f} s for the handshake; {phases})"
    return LoadFailure(reason.kind, reason.message + note)


def with_timeline(load: Load, reason: LoadFailure | None, now_s: float) -> LoadFailure | None:
    """A lease that ended under a load says how long this rank held the load, and where: was
    the lease's time spent here, or before decode scheduled the request?"""
    if reason is None or reason.kind is not FailureKind.LEASE_EXPIRED:
        return reason
    timeline = load.timeline
    stamps = (
        ("handshake ready", timeline.handshake_ready_s),
        ("READs posted", timeline.posted_s),
        ("READs done", timeline.done_s),
        ("failed", now_s),
    )
    steps = ", ".join(
        f"{name} +{when_s - load.created_s:.1f} s" for name, when_s in stamps if when_s is not None
    )
    return LoadFailure(reason.kind, f"{reason.message} (this rank's load: {steps})")


# Why a lease check fails a load (the checks themselves: worker/lease_proof.py).

STAGED_WAIT_S = 10.0  # give up on a staged copy that never ends (the holder stopped stepping)


class Staging(enum.Enum):
    """A holder's answer for a host-staged lease (scheduler/leases.py), besides held or not."""

    PENDING = enum.auto()  # held, but its device->host copy is not done: not readable yet
    HELD_AFTER_COPY = enum.auto()  # held and readable, but it was not readable at first


# Held (True), not held (False), a staged lease's answer, or the error that kept it from being
# asked (TokensMismatch: held, but for other tokens).
Answer = bool | Staging | ConnectorError


# Failure messages start with these words, for people reading logs; code reads the kind.
LEASE_EXPIRED = "lease expired"
LEASE_UNPROVEN = "lease not proven"
PREFILL_RESTARTED = "the prefill engine restarted since it leased"
DIGEST_FAILED = "digest"
TOKENS_MISMATCH = "tokens mismatch"  # the holder's blocks hold other tokens than the prompt
BLOCKS_MISMATCH = "blocks mismatch"  # the READs came from other blocks than the lease holds


def unprovable_reason(remote: RemoteSource) -> LoadFailure | None:
    """Why a load from ``remote`` can never be proven (its params name no lease), or None."""
    if remote.lease_id and remote.boot_id:
        return None
    return LoadFailure(
        FailureKind.LEASE_UNPROVEN,
        f"{LEASE_UNPROVEN}: the kv_transfer_params of prefill request "
        f"{remote.remote_request_id!r} carry no remote_lease_id/remote_boot_id, so decode "
        "cannot show prefill held the blocks while it read them; pass through every key the "
        "prefill engine returned, and run the same nixl-pd-connector on both engines",
    )


BEFORE_READS = "before any READ was posted"
AFTER_READS = "when this rank's READs completed"


def lease_failure(
    remote: RemoteSource,
    held: Answer,
    when: str = AFTER_READS,
    *,
    seen_held: bool = False,
    staged_wait_s: float = STAGED_WAIT_S,
) -> LoadFailure | None:
    """The load's failure for a check's answer, or None when the lease held.

    ``seen_held``: a check before the load's first READ said the lease was held (needed, after
    the READs, for a lease that was not readable at first)."""
    if held is True:
        return None
    if held is Staging.HELD_AFTER_COPY and (when == BEFORE_READS or seen_held):
        return None
    what = (
        f"prefill engine {remote.engine_id!r} request {remote.remote_request_id!r} "
        f"(lease {remote.lease_id})"
    )
    if isinstance(held, Staging):
        return _staged_failure(what, held, when, staged_wait_s)
    if held is False:
        return LoadFailure(
            FailureKind.LEASE_EXPIRED,
            f"{LEASE_EXPIRED}: {what} was no longer held {when} (expired, released, or "
            "ended by another reader); its blocks may hold another request's KV, so nothing "
            "read from them is used",
        )
    if isinstance(held, PeerRestarted):
        return LoadFailure(
            FailureKind.PREFILL_RESTARTED, f"{LEASE_EXPIRED}: {what}: {PREFILL_RESTARTED} ({held})"
        )
    if isinstance(held, TokensMismatch):
        return LoadFailure(
            FailureKind.TOKENS_MISMATCH,
            f"{TOKENS_MISMATCH}: {what} is held for other tokens than this request's prompt "
            f"({held}): the kv_transfer_params were paired with another prompt (a router "
            "bug, a retried request with an edited prompt, an edited history), so nothing "
            "is read from those blocks",
        )
    if isinstance(held, BlocksMismatch):
        return LoadFailure(
            FailureKind.BLOCKS_MISMATCH,
            f"{BLOCKS_MISMATCH}: {what} does not hold the blocks this load reads ({held}): "
            "the kv_transfer_params' remote_block_ids or remote_num_tokens were edited on "
            "the way (a router, a client, another connector), so nothing read from those "
            "blocks is used; pass the params on exactly as the engine returned them",
        )
    return LoadFailure(
        FailureKind.LEASE_UNPROVEN,
        f"{LEASE_UNPROVEN}: asking {what} whether the lease holds failed: {held}",
    )


def _staged_failure(what: str, held: Staging, when: str, staged_wait_s: float) -> LoadFailure:
    if held is Staging.PENDING and when == BEFORE_READS:
        return LoadFailure(
            FailureKind.LEASE_UNPROVEN,
            f"{LEASE_UNPROVEN}: {what} stages its KV through host memory, and its copy was "
            f"not done within {staged_wait_s} s {when}; nothing is read from its blocks",
        )
    return LoadFailure(
        FailureKind.LEASE_UNPROVEN,
        f"{LEASE_UNPROVEN}: {what} was not readable when leased (its KV was still being "
        "copied to the host memory NIXL reads) and this load did not see it held before its "
        "first READ: staged copy not proven ready before the READs, so nothing read is used",
    )


def digest_failure(remote: RemoteSource, verdict: str) -> LoadFailure:
    """The load's failure when verify_kv's claims were not confirmed."""
    if verdict == DIGEST_PENDING:
        verdict = (
            "prefill reported no digests for this lease (is verify_kv on for the prefill "
            "engine too?)"
        )
    return LoadFailure(
        FailureKind.DIGEST,
        f"{DIGEST_FAILED}: prefill engine {remote.engine_id!r} request "
        f"{remote.remote_request_id!r}: {verdict}",
    )
