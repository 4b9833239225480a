"""Decode side: what a load owes and records when it ends.

The free notifications it owes the remote ranks its rank covers: who is covered, and the count
each notification carries, is the peer's duty (computed once per peer,
worker.topology.notification_duty; the PeerPlan holds it too). Every covered rank gets one,
read or not, once the lease is proven or the load failed: none rides a READ, so this rank's
own notification cannot end the lease before the proof. Prefill counts them in
worker/notifications.py.

Its outcome as the world sees it: why a handshake failure fails it (pure wording,
``handshake_failure``; where a failed load's time went, ``with_handshake_phases`` and
``with_timeline``) and one call into connector/observability/trace.py that never raises
(``record_outcome``): a metrics bug must not cost a request its outcome.

Transfer thread only: sending calls the NIXL agent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from connector.errors import ConnectorError, PeerRestarted
from connector.metadata import RemoteSource
from connector.observability.metrics import MetricsRecorder
from connector.observability.trace import load_ended
from connector.outcomes import FailureKind, LoadFailure
from connector.protocol import encode_free_notif, lease_key
from worker.lease_proof import BEFORE_READS, lease_failure
from worker.nixl_api import NixlAgent

if TYPE_CHECKING:  # annotations only: no import at run time
    from worker.load_lifecycle import Load
    from worker.peer_lifecycle import Peer

logger = logging.getLogger(__name__)

# A failed load that waited this long for its peer's handshake names the handshake's phases.
HANDSHAKE_NOTE_S = 1.0


def free_notif(load: Load, remote_rank: int) -> bytes:
    """The free notification for ``remote_rank``, naming the lease (``lease_key``); its count
    is the peer's duty, the one source (every rank read or notified is one this rank covers)."""
    source = load.source
    key = lease_key(source.remote_request_id, source.lease_id)
    return encode_free_notif(key, load.peer.duty[remote_rank])


def notify(agent: NixlAgent, load: Load, remote_rank: int) -> bool:
    """Tell ``remote_rank`` it may free the request's blocks (best effort, logged); False if
    the agent could not send to it (its process died or closed its agent, say)."""
    link = load.peer.link
    agent_name = None if link is None else link.agent_names.get(remote_rank)
    if agent_name is None:
        logger.warning(
            "request %s: no agent for remote rank %d to notify", load.request_id, remote_rank
        )
        return True
    try:
        agent.send_notif(agent_name, free_notif(load, remote_rank))
    except ConnectorError as error:
        logger.warning(
            "request %s: notifying remote rank %d failed: %s", load.request_id, remote_rank, error
        )
        return False
    load.notified.add(remote_rank)
    return True


def notify_rest(agent: NixlAgent, load: Load) -> bool:
    """Tell every covered remote rank not yet notified that its blocks may be freed; False if
    sending to one of them failed."""
    if load.peer.link is None:
        return True
    sent = [notify(agent, load, rank) for rank in sorted(set(load.peer.duty) - load.notified)]
    return all(sent)


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
