"""The connector's metrics on vLLM's /metrics: vLLM's Prometheus hook for NixlPDConnector.

vLLM 0.33 calls ``NixlPDConnector.build_prom_metrics`` once per API server with its own
metric classes (multiprocess-aware) and engine labels, then ``observe`` with each interval's
aggregated ``NixlPDStats.data``. The metrics are connector.observability.metrics' own (same names,
help and buckets as ``nixl-pd serve --metrics-port``), with vLLM's engine labels in front.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)

from connector.observability.metrics import COUNTER, METRICS, MetricSpec
from connector.vllm.messages import interval_of


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


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type[PromMetric], type[PromMetricT]],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> NixlPDPromMetrics:
    """NixlPDConnector.build_prom_metrics; ``metric_types`` maps prometheus_client's
    Gauge/Counter/Histogram to the classes vLLM wants used."""
    for required in (Gauge, Counter, Histogram):
        metric_types.setdefault(required, required)  # type: ignore[arg-type]
    return NixlPDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
