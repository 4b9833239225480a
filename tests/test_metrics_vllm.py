"""Metrics under vLLM: NixlPDStats through vLLM's real Scheduler, and vLLM's Prometheus hook.

A prefill and a decode engine (tests/vllm_harness.py: vLLM's Scheduler, our worker connectors
on FakeNixl, metadata pickled across the process boundary) move one request. What vLLM would
hand its stat loggers (``make_stats``' kv_connector_stats) is captured each step, aggregated
with ``build_kv_connector_stats``, and fed to ``build_prom_metrics``' objects on a private
registry. Both engines share this test's process, so they share its metrics recorder: the
figures are checked summed over the two engines, as two processes would report them apart.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip("vllm is not installed (scripts/install_vllm.sh)", allow_module_level=True)

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from connector.observability.metrics import (  # noqa: E402
    HANDSHAKE_SECONDS,
    LEASES_COMPLETED,
    LEASES_EXPIRED,
    LOADS_FAILED,
    LOADS_FINISHED,
    NOTIFICATIONS,
    PREFILL_FREE_SECONDS,
    TRANSFER_BYTES,
    TRANSFER_SECONDS,
    default_recorder,
)
from connector.vllm import NixlPDConnector  # noqa: E402
from connector.vllm.metrics import NixlPDStats  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
NUM_BLOCKS = 64
LABELS = {0: ["tiny", "0"], 1: ["tiny", "1"]}  # engine index -> (model_name, engine)


@pytest.fixture
def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[h.Engine]]:
    model = h.model_config(h.write_tiny_model(tmp_path / "tiny-llama"))
    engines: list[h.Engine] = []
    try:
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            config = h.vllm_config(model, kv_role=role, failure_policy="fail")
            cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
            engines.append(h.build_engine(name, config, cache, port=h.free_port(), env=monkeypatch))
        yield engines
    finally:
        for engine in engines:
            engine.shutdown()


def capture_stats(engine: h.Engine, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The kv_connector_stats vLLM's Scheduler passes to make_stats, one dict per step."""
    captured: list[dict[str, Any]] = []
    make_stats = engine.scheduler.make_stats

    def capture(spec: Any = None, kv_connector_stats: Any = None, *args: Any, **kw: Any) -> Any:
        if kv_connector_stats is not None:
            captured.append(kv_connector_stats.to_dict())
        return make_stats(spec, kv_connector_stats, *args, **kw)

    monkeypatch.setattr(engine.scheduler, "make_stats", capture)
    return captured


def registry_types(registry: CollectorRegistry) -> dict[Any, Any]:
    """vLLM's metric_types, bound to a private registry (vLLM's are process-global)."""

    def bound(base: Any) -> Any:
        return type(base.__name__, (base,), {"__init__": _init_with(base, registry)})

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def _init_with(base: Any, registry: CollectorRegistry) -> Any:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, registry=registry, **kwargs)

    return init


def run_one_request(prefill: h.Engine, decode: h.Engine) -> None:
    num_tokens = 3 * BLOCK_SIZE
    free_prefill = prefill.num_free_blocks()
    prefill.add(
        h.make_request(
            "req-1", num_tokens, block_size=BLOCK_SIZE,
            kv_transfer_params={"do_remote_decode": True}, max_tokens=1,
        )
    )  # fmt: skip
    prefill.run_until(lambda e: e.finished("req-1") is not None)
    params = dict(prefill.finished("req-1").kv_transfer_params)
    h.fill_blocks(prefill, params["remote_block_ids"], seed=1)
    decode.add(
        h.make_request(
            "req-1", num_tokens, block_size=BLOCK_SIZE, kv_transfer_params=params, max_tokens=3
        )
    )
    decode.run_until(lambda e: e.finished("req-1") is not None)
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)


def test_stats_reach_vllms_loggers_and_its_prometheus_objects(
    pair: list[h.Engine], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="nixl_pd.trace")
    prefill, decode = pair
    captured = [capture_stats(engine, monkeypatch) for engine in (prefill, decode)]
    default_recorder().take_interval()  # forget what earlier tests in this process recorded

    run_one_request(prefill, decode)

    merged = NixlPDStats()
    for data in (*captured[0], *captured[1]):
        merged = merged.aggregate(NixlPDConnector.build_kv_connector_stats(data))  # type: ignore[assignment]
    assert merged.reduce() == {
        "loads_finished": 1,
        "loads_failed": 0,
        "loads_aborted": 0,
        "sends_finished": 1,
    }
    interval = merged.interval
    assert interval.total(LOADS_FINISHED) == 1 and interval.total(LOADS_FAILED) == 0
    assert interval.counters[NOTIFICATIONS.name] == {"counted": 1}
    assert interval.total(LEASES_COMPLETED) == 1 and interval.total(LEASES_EXPIRED) == 0
    (num_bytes,) = interval.observations[TRANSFER_BYTES.name]
    assert num_bytes > 0
    for spec in (TRANSFER_SECONDS, HANDSHAKE_SECONDS, PREFILL_FREE_SECONDS):
        assert len(interval.observations[spec.name]) == 1, spec.name

    registry = CollectorRegistry()
    prom = NixlPDConnector.build_prom_metrics(
        decode.scheduler.vllm_config, registry_types(registry), ["model_name", "engine"], LABELS
    )
    assert prom is not None
    for engine_idx, stats in enumerate(captured):
        for data in stats:
            prom.observe(data, engine_idx)

    def summed(name: str, **labels: str) -> float:
        values = (
            registry.get_sample_value(name, {"model_name": "tiny", "engine": engine, **labels})
            for engine in ("0", "1")
        )
        return sum(value or 0.0 for value in values)

    assert summed("nixl_pd_loads_finished_total") == 1
    assert summed("nixl_pd_loads_failed_total", reason="handshake") == 0
    assert registry.get_sample_value(
        "nixl_pd_loads_failed_total", {"model_name": "tiny", "engine": "1", "reason": "aborted"}
    ) == 0  # fmt: skip
    assert summed("nixl_pd_transfer_bytes_sum") == num_bytes
    assert summed("nixl_pd_transfer_bytes_count") == 1
    assert summed("nixl_pd_handshake_seconds_count") == 1
    assert summed("nixl_pd_leases_completed_total") == 1
    assert summed("nixl_pd_notifications_total", kind="counted") == 1
    assert summed("nixl_pd_prefill_free_seconds_count") == 1

    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "nixl_pd.trace"]
    assert [line["event"] for line in lines] == [
        "load",  # decode's rank: its READ is done and the lease proven
        "send",  # prefill's rank: the free notification arrived
    ]
    load, send = lines
    # Prefill's ranks count by lease key, "<request id>@<lease id>": the send line names it.
    assert load["request_id"] == "req-1" and send["lease_key"].startswith("req-1@")
    assert (load["outcome"], load["num_bytes"], load["remote_ranks"]) == ("ok", num_bytes, [0])
    assert send["senders"] == [load["agent"]]
