"""A TP rank's worker connector: registration, then loads and notifications on its transfer thread.

Threading contract: the engine thread calls every public method, and touches the NIXL agent
only before the transfer thread starts (``register_kv_caches``, which also reads the agent
metadata once) and after it stops (``shutdown``). In between, the rank's ``TransferThread`` is
the only thread that calls the agent, and it owns the LoadTable, the PeerTable (with the
prepared lists of worker/reads.py) and the NotificationCounter: ``start_load_kv`` just queues
the step's metadata for it, and ``get_finished`` just takes what it published under
``_outcomes_lock``; neither ever waits on a copy, a plan or a poll. Why a thread: NIXL's
``post()`` of a READ with few descriptors over same-host CMA copies inline, for tenths of a
second (benchmarks/engine_thread_bench.py), releasing the GIL while it copies. A pass runs at
once after a submit or a ``wake`` (a lease check answered), else every BUSY_POLL_S while loads
are live, or every IDLE_POLL_S. The handshake threads (worker/handshake.py) only talk ZMQ and
hand the bytes back through a queue, which the transfer thread drains.

Per-request problems (a bad plan, a failed READ, a dead or incompatible peer, a failed
handshake) never raise out of ``start_load_kv`` or ``get_finished``: the request is reported
once in ``failed_recving`` with the reason, and the engine keeps serving.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from connector.config import ConnectorConfig
from connector.errors import ConnectorError, UnsupportedConfiguration
from connector.geometry import build_rank_layout
from connector.layout import KVCacheSpec
from connector.memory import HOST_MEMORY, Memory
from connector.metadata import (
    ConnectorMetadata,
    DigestSpec,
    GroupDigests,
    LoadFailure,
    LoadSpec,
    WorkerReport,
)
from connector.protocol import PROTOCOL_VERSION, DigestClaim, WorkerHandshake
from worker.handshake import BootFetcher, Fetcher, HandshakeClient, any_boot, fingerprint
from worker.kv_digest import check_digestible, host_regions, lease_digests, read_claims
from worker.lease_proof import (
    LeaseCheck,
    LeaseProofs,
    SilentSideChannels,
    one_by_one,
    side_channel_batch_check,
    side_channel_checks,
)
from worker.loads import LoadTable
from worker.nixl_api import NixlAgent
from worker.notifications import NotificationCounter, NotificationStats
from worker.peers import PeerTable
from worker.reads import PreparedLists, keep_plan_memory_mapped
from worker.stall_watch import StallWatch, StallWatchdog

logger = logging.getLogger(__name__)

Item = TypeVar("Item")

BUSY_POLL_S = 0.001  # while READs are live: a finished READ is seen within about 1 ms
IDLE_POLL_S = 0.05  # nothing live: free notifications (prefill) are collected within 50 ms
STOP_TIMEOUT_S = 10.0  # a post() in progress finishes its copy first (well under a second)


def side_channel_fetcher(config: ConnectorConfig) -> BootFetcher:
    """Fetch handshakes over ZMQ with the configured secret, timeout and size bound, naming
    the boot the params name (one exchange per rank; a restarted prefill refuses it)."""
    from connector.net.side_channel_client import fetch_handshake

    def fetch(host: str, port: int, tp_rank: int, boot_id: str) -> WorkerHandshake:
        return fetch_handshake(
            host,
            port,
            tp_rank,
            secret=config.side_channel_secret,
            timeout_s=config.handshake_timeout_s,
            max_message_bytes=config.max_message_bytes,
            boot_id=boot_id,
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
        lease_check: LeaseCheck | None = None,
    ) -> None:
        self._config = config
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._agent = agent
        self._clock = clock
        self._layout = build_rank_layout(spec, tp_rank, tp_size)
        self._fingerprint = fingerprint(spec)
        self._client = HandshakeClient(
            any_boot(fetch) if fetch else side_channel_fetcher(config),
            retries=config.handshake_retries,
            clock=clock,
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
            local_backends=config.backends,
        )
        if config.verify_kv:
            check_digestible(self._layout)
        silence = SilentSideChannels(config.handshake_timeout_s)
        _, check_digests = side_channel_checks(config, silence)
        self._proofs = LeaseProofs(
            one_by_one(lease_check) if lease_check else side_channel_batch_check(config, silence),
            check_digests=check_digests if config.verify_kv else None,
            on_answer=self._wake_transfer,
            clock=clock,
        )
        self._digest_views: list[Any] = []  # verify_kv: byte views of this rank's regions
        self._digests: dict[str, tuple[GroupDigests, ...]] = {}  # computed, not yet reported
        self._notifications = NotificationCounter(
            clock=clock, early_ttl_s=config.kv_lease_duration_s
        )
        self._loads: LoadTable | None = None  # created by register_kv_caches
        self._transfer: TransferThread[ConnectorMetadata] | None = None  # ditto
        self._stall_watch = StallWatch()  # the transfer thread publishes, the watchdog reads
        self._watchdog: StallWatchdog | None = None  # started with the transfer thread
        self._region_addresses: tuple[int, ...] = ()
        self._memory = HOST_MEMORY
        self._registration: Any = None
        self._agent_metadata = b""
        # Guards what the transfer thread publishes for get_finished and notification_stats.
        self._outcomes_lock = threading.Lock()
        self._finished_recving: list[str] = []
        self._failed_recving: dict[str, LoadFailure] = {}
        self._finished_sending: list[str] = []
        self._stats = NotificationStats()
        self._stats_published = 0  # transfer thread: num_stat_changes when last published

    def register_kv_caches(
        self, region_addresses: Sequence[int], memory: Memory = HOST_MEMORY
    ) -> None:
        """Register this rank's KV regions: one base address per region of its RankLayout,
        all in ``memory`` (host DRAM, or one GPU)."""
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
        self._memory = memory
        if self._config.verify_kv:
            if memory != HOST_MEMORY:
                raise UnsupportedConfiguration(
                    "verify_kv digests the registered KV memory on the host; this rank "
                    f"registers {memory}: stage through host memory (kv_buffer_device: cpu) "
                    "or turn verify_kv off"
                )
            self._digest_views = host_regions(self._region_addresses, region_bytes)
        self._registration = self._agent.register_regions(
            list(zip(self._region_addresses, region_bytes, strict=True)), memory
        )
        self._loads = LoadTable(
            self._agent,
            local_region_addresses=self._region_addresses,
            local_memory=memory,
            clock=self._clock,
            transfer_timeout_s=self._config.kv_lease_duration_s,
            handshake_wait_s=handshake_wait_s(self._config),
            on_peer_failure=self._peers.retire,
            proofs=self._proofs,
            precheck_skip_s=self._config.lease_precheck_skip_s,
            claims=self._claims if self._config.verify_kv else None,
        )
        self._agent_metadata = self._agent.get_agent_metadata()
        self._peers.use_prepared_lists(PreparedLists(self._agent, self._region_addresses, memory))
        keep_plan_memory_mapped()
        loads = self._loads
        self._transfer = TransferThread(
            f"nixl-pd-transfer-r{self._tp_rank}", self._pass, busy=lambda: len(loads) > 0
        )
        self._transfer.start()
        self._watchdog = StallWatchdog(
            f"nixl-pd-stall-watch-r{self._tp_rank}",
            self._stall_watch,
            clock=self._clock,
            context=f"rank {self._tp_rank} of engine {self._engine_id}: ",
        )
        self._watchdog.start()

    def get_handshake_metadata(self) -> WorkerHandshake:
        """What this rank tells peers; the scheduler side serves it on the side channel."""
        self._require_loads()
        return WorkerHandshake(
            protocol_version=PROTOCOL_VERSION,
            engine_id=self._engine_id,
            tp_rank=self._tp_rank,
            tp_size=self._layout.tp_size,
            agent_name=self._agent.name,
            agent_metadata=self._agent_metadata,
            region_addresses=self._region_addresses,
            layout=self._layout,
            fingerprint=self._fingerprint.digest,
            compat_facts=dict(self._fingerprint.facts),
            memory=self._memory,
            backends=tuple(self._config.backends),
        )

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Queue one step's instructions (sends to expect, loads to start, aborts) for the
        transfer thread; returns at once."""
        self._require_transfer().submit(metadata)

    def get_finished(self) -> WorkerReport:
        """What the transfer thread finished since the last call; each request appears in
        exactly one report. Never waits on the transfer thread."""
        self._require_transfer()
        with self._outcomes_lock:
            report = WorkerReport(
                tp_rank=self._tp_rank,
                finished_sending=tuple(self._finished_sending),
                finished_recving=tuple(self._finished_recving),
                failed_recving=dict(self._failed_recving),
                digests=self._digests,
            )
            self._digests = {}
            self._finished_sending.clear()
            self._finished_recving.clear()
            self._failed_recving.clear()
        return report

    def check_stalls(self) -> bool:
        """Log a stall report now if one is due (worker/stall_watch.py); the watchdog thread
        does the same every second. True if this call logged one."""
        return self._watchdog is not None and self._watchdog.check()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the transfer thread has run a whole pass after this call, so what was
        queued before it is applied and what finished is published. For tests and drills
        that need determinism; an engine never calls it (it would wait on copies)."""
        return self._require_transfer().flush(timeout_s)

    @property
    def notification_stats(self) -> NotificationStats:
        """Prefill: free notifications counted, and the duplicate, stray and garbage ones."""
        with self._outcomes_lock:
            return dataclasses.replace(self._stats)

    def shutdown(self) -> None:
        """Stop the transfer and handshake threads, drop transfers and remote agents,
        deregister memory."""
        if self._watchdog is not None:
            self._watchdog.stop()
        stopped = self._transfer is None or self._transfer.stop()
        self._client.close()
        self._proofs.close()
        if not stopped:
            logger.error(
                "the transfer thread of rank %d did not stop; leaving the NIXL agent to it",
                self._tp_rank,
            )
            return
        if self._loads is not None:
            self._loads.abandon_all()
        self._peers.close()
        if self._registration is not None:
            try:
                self._agent.deregister(self._registration)
            except ConnectorError as error:  # the agent may already be closed
                logger.warning("deregistering KV caches failed: %s", error)
            self._registration = None

    def _wake_transfer(self) -> None:
        """A lease check answered (check thread): the load waiting on it moves now, not at
        the next poll (up to 1 ms later, twice per load: before and after its READs)."""
        transfer = self._transfer
        if transfer is not None:
            transfer.wake()

    def _require_loads(self) -> LoadTable:
        if self._loads is None:
            raise UnsupportedConfiguration(
                "the worker connector has no KV caches: call register_kv_caches first"
            )
        return self._loads

    def _require_transfer(self) -> TransferThread[ConnectorMetadata]:
        self._require_loads()
        if self._transfer is None or not self._transfer.alive:
            raise UnsupportedConfiguration(
                f"the transfer thread of rank {self._tp_rank} is not running: shut down already?"
            )
        return self._transfer

    def _pass(self, batch: list[ConnectorMetadata]) -> None:
        """Transfer thread: one pass, and what every load waits on after it for the stall
        watchdog (a pass that does not return is a stall the watchdog sees too)."""
        loads = self._require_loads()
        self._stall_watch.pass_started(self._clock())
        try:
            self._move(loads, batch)
        finally:
            self._stall_watch.publish(loads.waits(), self._clock())

    def _move(self, loads: LoadTable, batch: list[ConnectorMetadata]) -> None:
        """Apply the queued steps, move every load, collect notifications, publish outcomes."""
        for metadata in batch:
            self._apply(loads, metadata)
        self._peers.poll()
        outcomes = loads.advance()
        try:
            self._notifications.receive(self._agent.get_new_notifs())
        except ConnectorError as error:
            logger.warning("collecting free notifications failed: %s", error)
        sent = self._notifications.take_finished()
        stats_changed = self._stats_published != self._notifications.num_stat_changes
        if not outcomes and not sent and not stats_changed:
            return  # nothing to publish: most passes
        with self._outcomes_lock:
            for request_id, reason in outcomes:
                if reason is None:
                    self._finished_recving.append(request_id)
                else:
                    self._failed_recving[request_id] = reason
            self._finished_sending.extend(sent)
            if stats_changed:
                self._stats = dataclasses.replace(self._notifications.stats)
                self._stats_published = self._notifications.num_stat_changes

    def _apply(self, loads: LoadTable, metadata: ConnectorMetadata) -> None:
        if metadata.digests:
            self._digest_leases(metadata.digests)
        if metadata.sends:
            self._notifications.expect(metadata.sends)
        if metadata.forgotten:
            self._notifications.forget(metadata.forgotten)
        for spec in metadata.loads:
            loads.add(spec, self._peers.ensure(spec.source))
        for release in metadata.releases:
            peer = self._peers.ensure(release.source)
            loads.abort(release.request_id, release.source, peer, release.failure)

    def _digest_leases(self, specs: tuple[DigestSpec, ...]) -> None:
        """verify_kv, prefill: digest newly leased blocks; the next report carries them."""
        if not self._digest_views:
            logger.warning("verify_kv is off on this rank; %d lease(s) not digested", len(specs))
            return
        digests = {}
        for spec in specs:
            try:
                digests[spec.key] = lease_digests(
                    self._layout, self._digest_views, spec.block_ids, spec.num_tokens
                )
            except (IndexError, ValueError) as error:  # ids beyond this rank's blocks
                logger.warning("verify_kv: cannot digest lease %s: %s", spec.key, error)
        with self._outcomes_lock:
            self._digests.update(digests)

    def _claims(self, spec: LoadSpec) -> tuple[DigestClaim, ...]:
        """verify_kv, decode: the digests of what this rank READ of ``spec``."""
        return read_claims(
            self._layout,
            self._digest_views,
            spec.local_block_ids,
            spec.num_cached_tokens,
            spec.num_tokens,
        )


class TransferThread(Generic[Item]):
    """Runs ``step(items)`` on its own thread until ``stop``; ``step`` must not raise."""

    def __init__(
        self,
        name: str,
        step: Callable[[list[Item]], None],
        *,
        busy: Callable[[], bool],
        busy_poll_s: float = BUSY_POLL_S,
        idle_poll_s: float = IDLE_POLL_S,
    ) -> None:
        self._step = step
        self._busy = busy
        self._busy_poll_s = busy_poll_s
        self._idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue[Item] = queue.SimpleQueue()  # thread-safe by itself
        self._barriers: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()  # flush()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: Item) -> None:
        """Hand one item to the next pass (never blocks)."""
        self._inbox.put(item)
        self._wake.set()

    def wake(self) -> None:
        """Run a pass now rather than at the next poll: something the step waits on arrived
        (a lease check's answer), so a load need not wait out a poll interval for it."""
        self._wake.set()

    def flush(self, timeout_s: float) -> bool:
        """Wait until a whole pass ran after this call (tests and shutdown paths; never the
        engine's hot path). False if it did not within ``timeout_s``."""
        if not self.alive:
            return False
        done = threading.Event()
        self._barriers.put(done)
        self._wake.set()
        return done.wait(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Stop after the pass in progress; True once the thread has ended."""
        self._stopping.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # before draining: a submit after this wakes the next wait
            barriers = _drain(self._barriers)
            items = _drain(self._inbox)
            try:
                self._step(items)
            except Exception:  # the step guards each request; this keeps the thread alive
                logger.exception("transfer thread: unexpected error in a pass")
            for barrier in barriers:
                barrier.set()
            self._wake.wait(self._busy_poll_s if self._busy() else self._idle_poll_s)


def _drain(inbox: queue.SimpleQueue[Item]) -> list[Item]:
    """Everything queued so far (this thread is the only consumer, so empty() is exact)."""
    items = []
    while not inbox.empty():
        items.append(inbox.get_nowait())
    return items
