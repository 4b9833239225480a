"""The objects NixlPDConnector hands across vLLM's process boundaries (all picklable).

Scheduler -> every worker rank each step: NixlPDMetadata. Worker ranks -> scheduler each
step: NixlPDWorkerMeta. Each worker rank -> scheduler once at start: NixlPDHandshakeMetadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connector.metadata import ConnectorMetadata, FailureKind, WorkerReport
from connector.observability.metrics import MetricsInterval
from connector.staging import StagedBlocks
from scheduler.requests import FinishedRequests


class NixlPDMetadata(KVConnectorMetadata):
    """Scheduler -> every worker rank, one per step: our instructions plus what to echo.

    ``saves`` (host staging only): requests whose prefill completes this step; each rank
    copies their blocks device->host in wait_for_save.
    """

    def __init__(
        self,
        step: ConnectorMetadata,
        announce: FinishedRequests,
        saves: tuple[StagedBlocks, ...] = (),
    ) -> None:
        self.step = step
        self.announce = announce
        self.saves = saves


class NixlPDWorkerMeta(KVConnectorWorkerMetadata):
    """Worker ranks -> scheduler, one per step: the ranks' reports, concatenated."""

    def __init__(self, reports: tuple[WorkerReport, ...]) -> None:
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, NixlPDWorkerMeta):
            return self
        return NixlPDWorkerMeta(self.reports + other.reports)


class NixlPDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One rank's WorkerHandshake, msgpack-encoded, on its way to the scheduler process."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


def merge(first: FinishedRequests, second: FinishedRequests) -> FinishedRequests:
    return FinishedRequests(
        first.finished_sending + second.finished_sending,
        first.finished_recving + second.finished_recving,
        {**first.failed_recving, **second.failed_recving},
    )


STAT_KEYS = ("loads_finished", "loads_failed", "loads_aborted", "sends_finished")
METRICS_KEY = "metrics"  # a MetricsInterval as builtins: counters and raw observations


@dataclass
class NixlPDStats(KVConnectorStats):
    """Per-interval figures, summed over ranks, the scheduler and steps (vLLM logs ``reduce()``
    and hands ``data`` to NixlPDPromMetrics for its /metrics).

    ``STAT_KEYS`` count reports per rank: a request loaded by 2 decode ranks counts 2
    loads_finished. ``data["metrics"]`` is what connector.observability.metrics recorded in the
    interval.
    """

    def __post_init__(self) -> None:
        for key in STAT_KEYS:
            self.data.setdefault(key, 0)
        self.data.setdefault(METRICS_KEY, {})

    @classmethod
    def from_report(cls, report: WorkerReport) -> NixlPDStats:
        # An abort is no failed load: a rank acks a release (the request finished, or a full
        # local prefix hit needed nothing) with it.
        num_aborted = sum(
            failure.kind is FailureKind.ABORTED for failure in report.failed_recving.values()
        )
        return cls(
            data={
                "loads_finished": len(report.finished_recving),
                "loads_failed": len(report.failed_recving) - num_aborted,
                "loads_aborted": num_aborted,
                "sends_finished": len(report.finished_sending),
            }
        )

    @classmethod
    def from_interval(cls, interval: MetricsInterval) -> NixlPDStats:
        return cls(data={METRICS_KEY: msgspec.to_builtins(interval)})

    @property
    def interval(self) -> MetricsInterval:
        return interval_of(self.data)

    def reset(self) -> None:
        self.data = {key: 0 for key in STAT_KEYS}
        self.data[METRICS_KEY] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged: dict[str, Any] = {key: self.data[key] + other.data.get(key, 0) for key in STAT_KEYS}
        interval = self.interval.merged(interval_of(other.data))
        merged[METRICS_KEY] = msgspec.to_builtins(interval)
        return NixlPDStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {key: int(self.data[key]) for key in STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in STAT_KEYS) and self.interval.is_empty()


def interval_of(data: dict[str, Any]) -> MetricsInterval:
    """The MetricsInterval in a stats ``data`` dict (empty if it has none)."""
    return msgspec.convert(data.get(METRICS_KEY) or {}, MetricsInterval)
