"""The connector's metrics through vLLM: its per-interval stats and its /metrics hook.

``NixlPDStats`` (vLLM's KVConnectorStats) carries each interval's figures from the ranks and
the scheduler to vLLM, which logs ``reduce()``. vLLM 0.33 calls ``NixlPDConnector.build_prom_metrics`` once per API server with its own
metric classes (multiprocess-aware) and engine labels, then ``observe`` with each interval's
aggregated ``NixlPDStats.data``. The metrics are connector.observability.metrics' own (same names,
help and buckets as ``nixl-pd serve --metrics-port``), with vLLM's engine labels in front.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import Counter, Gauge, Histogram
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from connector.metadata import FailureKind, WorkerReport
from connector.observability.metrics import COUNTER, METRICS, MetricsInterval, MetricSpec

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


class NixlPDPromMetrics(KVConnectorPromMetrics):
    """One vLLM metric per connector.observability.metrics spec; children per engine (and reason
    kind)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        # ``metric_types`` maps prometheus_client's classes to the ones vLLM wants used.
        for required in (Gauge, Counter, Histogram):
            metric_types.setdefault(required, required)  # type: ignore[arg-type]
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # metric name -> engine index -> label value ("" unlabelled) -> child
        self.children: dict[str, dict[int, dict[str, Any]]] = {
            spec.name: self._children(spec) for spec in METRICS
        }

    def _children(self, spec: MetricSpec) -> dict[int, dict[str, Any]]:
        counter_cls: Any = self._counter_cls  # vLLM's classes, typed only as Gauge | ...
        histogram_cls: Any = self._histogram_cls
        if spec.kind == COUNTER:
            extra = [spec.label] if spec.label is not None else []
            metric = counter_cls(
                name=spec.name, documentation=spec.help, labelnames=[*self._labelnames, *extra]
            )
        else:
            metric = histogram_cls(
                name=spec.name,
                documentation=spec.help,
                buckets=list(spec.buckets),
                labelnames=self._labelnames,
            )
        label_values = spec.label_values if spec.label is not None else ("",)
        return {
            engine: {
                value: metric.labels(*engine_values, *([value] if value else []))
                for value in label_values
            }
            for engine, engine_values in self.per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        interval = interval_of(transfer_stats_data)
        for name, values in interval.observations.items():
            histogram = self.children.get(name, {}).get(engine_idx, {}).get("")
            if histogram is None:
                continue  # a name this version does not know, or an engine index it was not given
            for value in values:
                histogram.observe(value)
        for name, counts in interval.counters.items():
            children = self.children.get(name, {}).get(engine_idx, {})
            for label, count in counts.items():
                child = children.get(label) or children.get("other")
                if child is not None and count > 0:
                    child.inc(count)
