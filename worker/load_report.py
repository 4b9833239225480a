"""A load's outcome as the world sees it: why a handshake failure fails it, its metrics and trace.

Pure wording (``handshake_failure``) and one call into connector/trace.py that never raises
(``record_outcome``): a metrics bug must not cost a request its outcome.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from connector.errors import PeerRestarted
from connector.metadata import RemoteSource
from connector.observability.metrics import MetricsRecorder
from connector.observability.trace import load_ended
from connector.outcomes import FailureKind, LoadFailure
from worker.lease_proof import BEFORE_READS, lease_failure

if TYPE_CHECKING:  # annotations only: no import at run time
    from worker.load_lifecycle import Load
    from worker.peer_lifecycle import Peer

logger = logging.getLogger(__name__)


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
