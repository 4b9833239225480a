"""The connector's metrics: names, types, units and help texts once, and a recorder for them.

Everything here is plain data (no prometheus_client): the connector records into a
``MetricsRecorder``; the edges export it (``connector.observability.metrics_prometheus`` for an HTTP
``/metrics``, ``connector.vllm.metrics`` for vLLM's own endpoint). Names follow Prometheus
conventions: the ``nixl_pd_`` prefix, the unit as a suffix, counters ending in ``_total``.

Labels are bounded: a failed load's label is its kind (connector/metadata.py FailureKind);
a handshake's free-text reason is mapped to a small set of kinds (``handshake_failure_kind``).
Full messages stay in the logs.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque

import msgspec

from connector.metadata import FailureKind

COUNTER = "counter"
HISTOGRAM = "histogram"
MAX_PENDING_OBSERVATIONS = 4096  # raw values kept per histogram between take_interval calls

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LONG_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BYTES = tuple(float(4**k * 1024) for k in range(13))  # 1 KiB .. 16 GiB
_DESCRIPTORS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, 4096.0, 16384.0)


class MetricSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One metric: its Prometheus name, unit, help text, label and buckets; with buckets it
    is a histogram, without a counter."""

    name: str
    unit: str  # "seconds", "bytes", "descriptors", "requests", ...
    help: str
    label: str | None = None  # the one label name, for counters split by kind
    label_values: tuple[str, ...] = ()  # every value the label may take
    buckets: tuple[float, ...] = ()  # histogram upper bounds (+Inf implied)

    @property
    def kind(self) -> str:
        return HISTOGRAM if self.buckets else COUNTER


TRANSFER_SECONDS = MetricSpec(
    "nixl_pd_transfer_seconds",
    "seconds",
    "Decode: time from posting a request's READs to the last one done, per request and rank.",
    buckets=_SECONDS,
)
TRANSFER_BYTES = MetricSpec(
    "nixl_pd_transfer_bytes",
    "bytes",
    "Decode: bytes READ per request and rank.",
    buckets=_BYTES,
)
TRANSFER_DESCRIPTORS = MetricSpec(
    "nixl_pd_transfer_descriptors",
    "descriptors",
    "Decode: NIXL descriptors (merged byte ranges) READ per request and rank.",
    buckets=_DESCRIPTORS,
)
HANDSHAKE_SECONDS = MetricSpec(
    "nixl_pd_handshake_seconds",
    "seconds",
    "Decode: time from a remote engine's first request to its handshake loaded, per rank.",
    buckets=_LONG_SECONDS,
)
POST_SECONDS = MetricSpec(
    "nixl_pd_post_seconds",
    "seconds",
    "Decode: time in NIXL to prepare and post a request's READs (make_read, post), per "
    "request and rank; on the rank's transfer thread, so a long post() no longer stalls steps.",
    buckets=_SECONDS,
)
PREFILL_FREE_SECONDS = MetricSpec(
    "nixl_pd_prefill_free_seconds",
    "seconds",
    "Prefill: time from a request's prefill finish (lease taken) to its blocks freed.",
    buckets=_LONG_SECONDS,
)

# One label per kind, and "other" where a label no kind has would land (MetricsRecorder.inc).
LOAD_FAILURE_KINDS = (*(kind.value for kind in FailureKind), "other")

# (text in the reason, kind) for handshakes: the first match wins. The texts are ours
# (worker/peers.py, connector/net/side_channel_client.py), so the mapping is tested against them.
_HANDSHAKE_PATTERNS = (
    ("did not answer", "timeout"),
    ("refused the request", "refused"),
    ("compatib", "incompatible"),
    ("protocol version", "incompatible"),
    ("restarted", "restarted"),
    ("superseded", "superseded"),
    ("took over", "superseded"),
    ("zmq error", "network"),
)
HANDSHAKE_FAILURE_KINDS = (*dict.fromkeys(kind for _, kind in _HANDSHAKE_PATTERNS), "other")
NOTIFICATION_KINDS = ("counted", "duplicate", "stray", "garbage")

LOADS_FINISHED = MetricSpec(
    "nixl_pd_loads_finished_total",
    "requests",
    "Decode: requests whose KV this rank loaded.",
)
LOADS_FAILED = MetricSpec(
    "nixl_pd_loads_failed_total",
    "requests",
    "Decode: requests this rank could not load, by kind of reason; a load the scheduler "
    "failed before any rank ran it (refused params, a failed overlapped wait) counts once.",
    label="reason",
    label_values=LOAD_FAILURE_KINDS,
)
NOTIFICATIONS = MetricSpec(
    "nixl_pd_notifications_total",
    "notifications",
    "Prefill: free notifications received: counted, duplicate, stray (no lease) or garbage.",
    label="kind",
    label_values=NOTIFICATION_KINDS,
)
LEASES_STARTED = MetricSpec(
    "nixl_pd_leases_started_total",
    "requests",
    "Leases taken: prefill holding a prompt's KV for decode, or (bidirectional mode) decode "
    "holding a finished request's KV for the next turn's prefill. Minus the completed, "
    "expired and released ones: the leases held now.",
)
PULLED_TOKENS = MetricSpec(
    "nixl_pd_pulled_tokens_total",
    "tokens",
    "Prefill (bidirectional mode): prompt tokens loaded from a decode engine's held KV of an "
    "earlier turn instead of computed.",
)
CHUNK_READS = MetricSpec(
    "nixl_pd_chunk_reads_total",
    "chunks",
    "Decode (chunked_pull): READ windows sent to the ranks while prefill was still computing "
    "the prompt, one per announced chunk; the final window is not counted.",
)
LEASES_COMPLETED = MetricSpec(
    "nixl_pd_leases_completed_total",
    "requests",
    "Prefill: leases ended because every decode reader notified.",
)
LEASES_EXPIRED = MetricSpec(
    "nixl_pd_leases_expired_total",
    "requests",
    "Prefill: leases that expired before every decode reader notified.",
)
LEASES_RELEASED = MetricSpec(
    "nixl_pd_leases_released_total",
    "requests",
    "Prefill: leases released over the side channel by a decode engine that will not read.",
)
LEASES_READER_RESTARTED = MetricSpec(
    "nixl_pd_leases_reader_restarted_total",
    "requests",
    "Leases ended because the only reader that claimed them restarted: a message from a new "
    "boot of that reader engine said its earlier boot, which would never read or free them, "
    "is gone.",
)
HANDSHAKE_FAILURES = MetricSpec(
    "nixl_pd_handshake_failures_total",
    "handshakes",
    "Decode: failed handshakes with remote engines (background re-probes of a failed one "
    "included), by kind of reason.",
    label="reason",
    label_values=HANDSHAKE_FAILURE_KINDS,
)
QUARANTINED_LOADS = MetricSpec(
    "nixl_pd_quarantined_loads_total",
    "requests",
    "Decode: loads whose READ outlived the transfer timeout. NIXL cannot cancel a READ, so "
    "such a load is reported (failed) only once the backend says its READs ended.",
)
QUARANTINED_BLOCKS = MetricSpec(
    "nixl_pd_quarantined_blocks_total",
    "blocks",
    "Decode: blocks of quarantined loads, held from the engine while a READ may still write "
    "them. Minus nixl_pd_unquarantined_blocks_total: the blocks held in quarantine now.",
)
UNQUARANTINED_BLOCKS = MetricSpec(
    "nixl_pd_unquarantined_blocks_total",
    "blocks",
    "Decode: blocks of quarantined loads given back once every READ of the load ended.",
)

METRICS: tuple[MetricSpec, ...] = (
    TRANSFER_SECONDS,
    TRANSFER_BYTES,
    TRANSFER_DESCRIPTORS,
    HANDSHAKE_SECONDS,
    POST_SECONDS,
    PREFILL_FREE_SECONDS,
    LOADS_FINISHED,
    LOADS_FAILED,
    NOTIFICATIONS,
    LEASES_STARTED,
    PULLED_TOKENS,
    CHUNK_READS,
    LEASES_COMPLETED,
    LEASES_EXPIRED,
    LEASES_RELEASED,
    LEASES_READER_RESTARTED,
    HANDSHAKE_FAILURES,
    QUARANTINED_LOADS,
    QUARANTINED_BLOCKS,
    UNQUARANTINED_BLOCKS,
)


def handshake_failure_kind(reason: str) -> str:
    """A bounded label for a handshake's free-text failure reason."""
    lowered = reason.lower()
    for text, kind in _HANDSHAKE_PATTERNS:
        if text.lower() in lowered:
            return kind
    return "other"


class Histogram(msgspec.Struct, forbid_unknown_fields=True):
    """Cumulative state of one histogram: per-bucket (not cumulative) counts, sum, count."""

    bucket_counts: list[int]  # one per MetricSpec.buckets entry, then the +Inf bucket
    sum: float = 0.0
    count: int = 0


class MetricsSnapshot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every metric's value since the recorder started (what /metrics shows)."""

    counters: dict[str, dict[str, int]]  # metric name -> label value ("" unlabelled) -> count
    histograms: dict[str, Histogram]


class MetricsInterval(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What was recorded between two ``take_interval`` calls: counter increments and raw
    histogram observations (what vLLM's KVConnectorStats carries between processes)."""

    counters: dict[str, dict[str, int]] = {}
    observations: dict[str, list[float]] = {}

    def merged(self, other: MetricsInterval) -> MetricsInterval:
        counters = {name: dict(values) for name, values in self.counters.items()}
        for name, values in other.counters.items():
            mine = counters.setdefault(name, {})
            for label, count in values.items():
                mine[label] = mine.get(label, 0) + count
        observations = {name: list(values) for name, values in self.observations.items()}
        for name, raw in other.observations.items():
            observations.setdefault(name, []).extend(raw)
        return MetricsInterval(counters, observations)

    def is_empty(self) -> bool:
        return not any(self.observations.values()) and not any(
            any(values.values()) for values in self.counters.values()
        )

    def total(self, spec: MetricSpec) -> int:
        """A counter's increments over every label value."""
        return sum(self.counters.get(spec.name, {}).values())


class MetricsRecorder:
    """Records counters and histograms for one process; safe to call from any thread."""

    def __init__(self, max_pending_observations: int = MAX_PENDING_OBSERVATIONS) -> None:
        # Guards every attribute below: the engine thread records, exporters read.
        self._lock = threading.Lock()
        self._max_pending = max_pending_observations
        self._counters: dict[str, dict[str, int]] = {}
        self._histograms = {
            spec.name: Histogram([0] * (len(spec.buckets) + 1))
            for spec in METRICS
            if spec.kind == HISTOGRAM
        }
        self._pending_counters: dict[str, dict[str, int]] = {}
        self._pending_values: dict[str, deque[float]] = {}

    def inc(self, spec: MetricSpec, label: str = "", amount: int = 1) -> None:
        """Add ``amount`` to a counter; ``label`` must be one of ``spec.label_values``."""
        if spec.label is not None and label not in spec.label_values:
            label = "other" if "other" in spec.label_values else spec.label_values[0]
        with self._lock:
            for table in (self._counters, self._pending_counters):
                values = table.setdefault(spec.name, {})
                values[label] = values.get(label, 0) + amount

    def observe(self, spec: MetricSpec, value: float) -> None:
        """Add one observation (in ``spec.unit``) to a histogram."""
        with self._lock:
            state = self._histograms[spec.name]
            state.bucket_counts[bisect.bisect_left(spec.buckets, value)] += 1
            state.sum += value
            state.count += 1
            pending = self._pending_values.get(spec.name)
            if pending is None:
                pending = self._pending_values[spec.name] = deque(maxlen=self._max_pending)
            pending.append(float(value))

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return MetricsSnapshot(
                {name: dict(values) for name, values in self._counters.items()},
                {
                    name: msgspec.structs.replace(h, bucket_counts=list(h.bucket_counts))
                    for name, h in self._histograms.items()
                },
            )

    def take_interval(self) -> MetricsInterval:
        """What was recorded since the last call (raw values: the newest, bounded)."""
        with self._lock:
            interval = MetricsInterval(
                self._pending_counters,
                {name: list(values) for name, values in self._pending_values.items() if values},
            )
            self._pending_counters, self._pending_values = {}, {}
        return interval


_PROCESS_RECORDER = MetricsRecorder()


def default_recorder() -> MetricsRecorder:
    """The process's recorder: what a component records into unless given another one.

    One per process, as Prometheus clients keep one registry: an engine's ranks, its scheduler
    side and its exporter meet here without being wired to each other.
    """
    return _PROCESS_RECORDER
