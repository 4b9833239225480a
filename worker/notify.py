"""Decode side: the free notifications a load owes the remote ranks its rank covers.

Who is covered, and the count each notification carries, is the peer's duty (computed once
per peer, worker.topology.notification_duty; the PeerPlan holds it too). Every covered rank
gets one, read or not, once the lease is proven or the load failed: none rides a READ, so
this rank's own notification cannot end the lease before the proof. Prefill counts them in
worker/notifications.py.

Transfer thread only: sending calls the NIXL agent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from connector.errors import ConnectorError
from connector.protocol import encode_free_notif, lease_key
from worker.nixl_api import NixlAgent

if TYPE_CHECKING:  # annotations only: no import at run time
    from worker.load_lifecycle import Load

logger = logging.getLogger(__name__)


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
