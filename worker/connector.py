"""The worker-side connector of one TP rank: coordinates registration, loads and notifications.

Threading contract: the engine thread (the caller of every public method) is the only thread
that touches the NIXL agent. The handshake threads (worker/handshake.py) only talk ZMQ to
remote side channels and hand the bytes back through a queue, which ``start_load_kv`` and
``get_finished`` drain.

Per-request problems (a bad plan, a failed READ, a dead or incompatible peer, a failed
handshake) never raise out of ``start_load_kv`` or ``get_finished``: the request is reported
once in ``failed_recving`` with the reason, and the engine keeps serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from connector.config import ConnectorConfig
from connector.errors import ConnectorError, UnsupportedConfiguration
from connector.geometry import build_rank_layout
from connector.layout import KVCacheSpec
from connector.metadata import ConnectorMetadata, WorkerReport
from connector.protocol import PROTOCOL_VERSION, WorkerHandshake
from worker.compat import fingerprint
from worker.handshake import Fetcher, HandshakeClient
from worker.loads import LoadTable, Outcome
from worker.nixl_api import NixlAgent
from worker.notifications import NotificationCounter, NotificationStats
from worker.peers import PeerTable

logger = logging.getLogger(__name__)


def side_channel_fetcher(config: ConnectorConfig) -> Fetcher:
    """Fetch handshakes over ZMQ with the configured secret, timeout and size bound."""
    from connector.side_channel_client import fetch_handshake

    def fetch(host: str, port: int, tp_rank: int) -> WorkerHandshake:
        return fetch_handshake(
            host,
            port,
            tp_rank,
            secret=config.side_channel_secret,
            timeout_s=config.handshake_timeout_s,
            max_message_bytes=config.max_message_bytes,
        )

    return fetch


def handshake_wait_s(config: ConnectorConfig) -> float:
    """How long a load may wait for its peer: every handshake attempt, then one lease more."""
    return config.handshake_timeout_s * (config.handshake_retries + 1) + config.kv_lease_duration_s


class WorkerConnector:
    """One TP rank's connector. Create the agent early (it is slow); the caller closes it."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        spec: KVCacheSpec,
        agent: NixlAgent,
        clock: Callable[[], float] = time.monotonic,
        fetch: Fetcher | None = None,
    ) -> None:
        self._config = config
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._agent = agent
        self._clock = clock
        self._layout = build_rank_layout(spec, tp_rank, tp_size)
        self._fingerprint = fingerprint(spec)
        self._client = HandshakeClient(
            fetch or side_channel_fetcher(config), retries=config.handshake_retries
        )
        self._peers = PeerTable(
            agent,
            self._client,
            tp_rank=tp_rank,
            tp_size=tp_size,
            local_layout=self._layout,
            local_fingerprint=self._fingerprint,
            enforce_compat=config.enforce_handshake_compat,
            clock=clock,
        )
        self._notifications = NotificationCounter(
            clock=clock, early_ttl_s=config.kv_lease_duration_s
        )
        self._loads: LoadTable | None = None  # created by register_kv_caches
        self._region_addresses: tuple[int, ...] = ()
        self._registration: Any = None
        self._finished_recving: list[str] = []
        self._failed_recving: dict[str, str] = {}

    def register_kv_caches(self, region_addresses: Sequence[int]) -> None:
        """Register this rank's KV regions: one base address per region of its RankLayout."""
        region_bytes = self._layout.region_bytes
        if len(region_addresses) != len(region_bytes):
            raise UnsupportedConfiguration(
                f"register_kv_caches got {len(region_addresses)} region addresses, but the KV "
                f"layout of rank {self._tp_rank} has {len(region_bytes)} regions; pass one base "
                "address per region of connector.geometry.build_rank_layout(spec, ...)"
            )
        if self._loads is not None:
            raise UnsupportedConfiguration("register_kv_caches was already called on this rank")
        self._region_addresses = tuple(int(address) for address in region_addresses)
        self._registration = self._agent.register_regions(
            list(zip(self._region_addresses, region_bytes, strict=True))
        )
        self._loads = LoadTable(
            self._agent,
            local_region_addresses=self._region_addresses,
            clock=self._clock,
            transfer_timeout_s=self._config.kv_lease_duration_s,
            handshake_wait_s=handshake_wait_s(self._config),
            on_peer_failure=self._peers.retire,
        )

    def get_handshake_metadata(self) -> WorkerHandshake:
        """What this rank tells peers; the scheduler side serves it on the side channel."""
        if self._loads is None:
            raise UnsupportedConfiguration(
                "get_handshake_metadata needs the KV caches: call register_kv_caches first"
            )
        return WorkerHandshake(
            protocol_version=PROTOCOL_VERSION,
            engine_id=self._engine_id,
            tp_rank=self._tp_rank,
            tp_size=self._layout.tp_size,
            agent_name=self._agent.name,
            agent_metadata=self._agent.get_agent_metadata(),
            region_addresses=self._region_addresses,
            layout=self._layout,
            fingerprint=self._fingerprint.digest,
            compat_facts=dict(self._fingerprint.facts),
        )

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Take one step's instructions: sends to expect, loads to start, aborts to apply."""
        loads = self._require_loads()
        self._notifications.expect(metadata.sends)
        self._notifications.forget(metadata.forgotten)
        for spec in metadata.loads:
            loads.add(spec, self._peers.ensure(spec.remote))
        for release in metadata.releases:
            loads.abort(release.request_id, release.remote, self._peers.ensure(release.remote))
        self._progress(loads)

    def get_finished(self) -> WorkerReport:
        """What finished since the last call; each request appears in exactly one report."""
        loads = self._require_loads()
        self._progress(loads)
        self._notifications.receive(self._agent.get_new_notifs())
        report = WorkerReport(
            tp_rank=self._tp_rank,
            finished_sending=self._notifications.take_finished(),
            finished_recving=tuple(self._finished_recving),
            failed_recving=dict(self._failed_recving),
        )
        self._finished_recving.clear()
        self._failed_recving.clear()
        return report

    @property
    def notification_stats(self) -> NotificationStats:
        """Prefill: free notifications counted, and the duplicate, stray and garbage ones."""
        return self._notifications.stats

    def shutdown(self) -> None:
        """Stop the handshake threads, drop transfers and remote agents, deregister memory."""
        self._client.close()
        if self._loads is not None:
            self._loads.abandon_all()
        self._peers.close()
        if self._registration is not None:
            try:
                self._agent.deregister(self._registration)
            except ConnectorError as error:  # the agent may already be closed
                logger.warning("deregistering KV caches failed: %s", error)
            self._registration = None

    def _require_loads(self) -> LoadTable:
        if self._loads is None:
            raise UnsupportedConfiguration(
                "the worker connector has no KV caches: call register_kv_caches first"
            )
        return self._loads

    def _progress(self, loads: LoadTable) -> None:
        self._peers.poll()
        self._record(loads.advance())

    def _record(self, outcomes: list[Outcome]) -> None:
        for request_id, reason in outcomes:
            if reason is None:
                self._finished_recving.append(request_id)
            else:
                self._failed_recving[request_id] = reason
