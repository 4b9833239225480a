"""Metrics: names and conventions, reason kinds, the recorder, and what the connector records.

Loads run through the worker connector against the recording doubles of
test_worker_connector.py with an injected clock, so every timing is exact.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pytest

from connector.metadata import FailureKind, LoadFailure, WorkerReport
from connector.observability.metrics import (
    COUNTER,
    HANDSHAKE_FAILURES,
    HANDSHAKE_SECONDS,
    HISTOGRAM,
    LEASES_COMPLETED,
    LEASES_EXPIRED,
    LEASES_RELEASED,
    LEASES_STARTED,
    LOAD_FAILURE_KINDS,
    LOADS_FAILED,
    LOADS_FINISHED,
    METRICS,
    NOTIFICATIONS,
    POST_SECONDS,
    PREFILL_FREE_SECONDS,
    TRANSFER_BYTES,
    TRANSFER_DESCRIPTORS,
    TRANSFER_SECONDS,
    MetricsRecorder,
    MetricsSnapshot,
    default_recorder,
    handshake_failure_kind,
)
from connector.observability.trace import LoadTimeline, load_ended
from connector.protocol import encode_free_notif
from scheduler.leases import LeaseTable
from scheduler.producer import Producer
from tests.test_worker_connector import PREFILL_PORT, Read, RecordingAgent, Rig, load, source
from worker.descriptors import expand
from worker.nixl_api import Descriptors
from worker.notifications import NotificationCounter


@pytest.mark.parametrize("spec", METRICS, ids=lambda spec: spec.name)
def test_names_follow_prometheus_conventions(spec: Any) -> None:
    assert spec.name.startswith("nixl_pd_") and spec.help
    if spec.kind == COUNTER:
        assert spec.name.endswith("_total") and not spec.buckets
    else:
        assert spec.kind == HISTOGRAM and spec.name.endswith(f"_{spec.unit}")
        assert list(spec.buckets) == sorted(set(spec.buckets))
    assert (spec.label is None) == (not spec.label_values)


def test_a_failed_loads_label_is_its_kind_whatever_its_message_says() -> None:
    """Labels come from the kind the failure carries, never from its text: a message that
    reads like another kind's still counts under its own."""
    recorder = MetricsRecorder()
    failure = LoadFailure(FailureKind.PLAN, "lease expired: a message that reads like another")
    load_ended(recorder, LoadTimeline(0.0), ids=("d", "p", "e", "a"), reason=failure, now_s=1.0)
    counts = recorder.snapshot().counters[LOADS_FAILED.name]
    assert counts == {"plan": 1}
    assert set(LOAD_FAILURE_KINDS) == {kind.value for kind in FailureKind} | {"other"}


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("rank 0 at h:1 failed after 1 attempt(s): side channel h:1 did not answer within 5 s", "timeout"),
        ("side channel h:1 refused the request: bad signature", "refused"),
        ("the engines are incompatible: num_layers differ", "incompatible"),
        ("protocol version mismatch: local '3', remote '2'", "incompatible"),
        ("the prefill engine restarted and its KV is gone", "restarted"),
        ("engine p at h:1: a newer handshake superseded it", "superseded"),
        ("side channel h:1: zmq error: Address in use", "network"),
        ("nixlMismatchError: corrupt metadata", "other"),
    ],
    ids=lambda value: str(value)[:40],
)  # fmt: skip
def test_handshake_failure_reasons_map_to_bounded_kinds(reason: str, kind: str) -> None:
    assert handshake_failure_kind(reason) == kind


def test_recorder_counts_buckets_and_hands_each_interval_once() -> None:
    recorder = MetricsRecorder(max_pending_observations=2)
    recorder.inc(LOADS_FINISHED)
    recorder.inc(LOADS_FAILED, "plan", 2)
    recorder.inc(LOADS_FAILED, "not-a-kind")  # unknown label values land in "other"
    for value_s in (0.0004, 0.003, 100.0):
        recorder.observe(TRANSFER_SECONDS, value_s)
    snapshot = recorder.snapshot()
    assert snapshot.counters[LOADS_FAILED.name] == {"plan": 2, "other": 1}
    histogram = snapshot.histograms[TRANSFER_SECONDS.name]
    assert (histogram.count, histogram.sum) == (3, pytest.approx(100.0034))
    assert histogram.bucket_counts[0] == 1 and histogram.bucket_counts[-1] == 1  # 0.5 ms, +Inf
    assert histogram.bucket_counts[TRANSFER_SECONDS.buckets.index(0.005)] == 1
    interval = recorder.take_interval()
    assert interval.total(LOADS_FAILED) == 3 and interval.total(LOADS_FINISHED) == 1
    assert interval.observations[TRANSFER_SECONDS.name] == [0.003, 100.0]  # newest 2 kept
    assert recorder.take_interval().is_empty()
    assert recorder.snapshot().histograms[TRANSFER_SECONDS.name].count == 3  # cumulative


def delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> Any:
    """A counter's per-label increase, or a histogram's (count, sum) increase."""
    if name in after.histograms:
        old, new = before.histograms[name], after.histograms[name]
        return new.count - old.count, new.sum - old.sum
    old_values = before.counters.get(name, {})
    return {
        label: count - old_values.get(label, 0)
        for label, count in after.counters.get(name, {}).items()
        if count != old_values.get(label, 0)
    }


def traces(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "nixl_pd.trace"]


def read_descriptors(agent: RecordingAgent, read: Read) -> Descriptors:
    """The (N, 3) descriptors a recorded READ asked for, whether by rows or by index."""
    if not read.by_index:
        return np.asarray(read.local)
    (local_list,) = [prepared for prepared in agent.lists if prepared.owner == agent.name]
    return expand(np.asarray(local_list.rows), np.asarray(read.local))


def test_a_load_records_its_timings_sizes_and_one_trace_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="nixl_pd.trace")
    rig = Rig()
    try:
        before = default_recorder().snapshot()
        rig.channels.serve("p", 1)
        rig.channels.gate.clear()  # the handshake waits until the clock moved
        rig.step(loads=(load("a", source("pa")),))
        rig.clock.now_s += 0.5  # the handshake takes 0.5 s on the injected clock
        rig.channels.gate.set()
        rig.until(lambda: len(rig.agent.reads) == 1)
        rig.clock.now_s += 0.25  # the READ takes 0.25 s
        rig.finish_reads()
        rig.until(lambda: rig.reported("a"))
        after = default_recorder().snapshot()
    finally:
        rig.close()
    local = read_descriptors(rig.agent, rig.agent.reads[0])
    num_bytes = int(local[:, 1].sum())
    assert rig.finished == ["a"] and num_bytes > 0
    assert delta(before, after, LOADS_FINISHED.name) == {"": 1}
    assert delta(before, after, LOADS_FAILED.name) == {}
    assert delta(before, after, HANDSHAKE_SECONDS.name) == (1, pytest.approx(0.5))
    assert delta(before, after, TRANSFER_SECONDS.name) == (1, pytest.approx(0.25))
    assert delta(before, after, TRANSFER_BYTES.name) == (1, num_bytes)
    assert delta(before, after, TRANSFER_DESCRIPTORS.name) == (1, len(local))
    assert delta(before, after, POST_SECONDS.name) == (1, 0.0)  # the clock did not move
    (trace,) = traces(caplog)
    assert trace == {
        "event": "load", "request_id": "a", "remote_request_id": "pa", "remote_engine_id": "p",
        "agent": "decode-r0", "outcome": "ok", "reason": None, "handshake_ready_ms": 500.0,
        "planned_ms": 500.0, "posted_ms": 500.0, "done_ms": 750.0, "ended_ms": 750.0,
        "num_bytes": num_bytes, "num_descriptors": len(local), "remote_ranks": [0],
        "notified_ranks": [0],
    }  # fmt: skip


def test_a_failed_handshake_counts_once_per_handshake_and_once_per_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="nixl_pd.trace")
    rig = Rig()
    try:
        before = default_recorder().snapshot()
        unserved = source("pz", port=PREFILL_PORT + 9)
        rig.step(loads=(load("a", unserved), load("b", source("py", port=PREFILL_PORT + 9))))
        rig.until(lambda: rig.reported("a") and rig.reported("b"))
        after = default_recorder().snapshot()
    finally:
        rig.close()
    assert delta(before, after, HANDSHAKE_FAILURES.name) == {"timeout": 1}
    assert delta(before, after, LOADS_FAILED.name) == {"handshake": 2}
    assert delta(before, after, LOADS_FINISHED.name) == {}
    assert delta(before, after, TRANSFER_BYTES.name) == (0, 0)
    lines = traces(caplog)
    assert [(t["request_id"], t["outcome"], t["posted_ms"]) for t in lines] == [
        ("a", "handshake", None),
        ("b", "handshake", None),
    ]
    assert "did not answer" in lines[0]["reason"]


def test_no_trace_work_unless_debug_is_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nixl_pd.trace")
    rig = Rig()
    try:
        rig.step(loads=(load("a", source("pa", port=PREFILL_PORT + 9)),))
        rig.until(lambda: rig.reported("a"))
    finally:
        rig.close()
    assert traces(caplog) == []


def test_notifications_are_counted_by_kind_with_a_trace_line_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="nixl_pd.trace")
    now_s = [10.0]
    recorder = MetricsRecorder()
    counter = NotificationCounter(clock=lambda: now_s[0], early_ttl_s=1.0, metrics=recorder)
    counter.expect(["r1"])
    now_s[0] += 0.2
    counter.receive({"d0": [encode_free_notif("r1", 2)], "d1": [encode_free_notif("r1", 2)]})
    counter.receive({"d1": [encode_free_notif("r1", 2), b"garbage"]})
    counter.receive({"d0": [encode_free_notif("nobody", 1)]})
    now_s[0] += 2.0
    counter.receive({})
    assert counter.take_finished() == ("r1",)
    assert recorder.snapshot().counters[NOTIFICATIONS.name] == {
        "counted": 2, "duplicate": 1, "garbage": 1, "stray": 1,
    }  # fmt: skip
    (trace,) = traces(caplog)
    assert trace == {
        "event": "send", "lease_key": "r1", "num_notifications": 2, "senders": ["d0", "d1"],
        "waited_ms": 200.0,
    }  # fmt: skip


def test_producer_times_each_lease_to_its_free_and_counts_how_it_ended() -> None:
    now_s = [100.0]
    recorder = MetricsRecorder()
    leases = LeaseTable(duration_s=5.0)
    producer = Producer(
        engine_id="p", tp_size=1, leases=leases, clock=lambda: now_s[0],
        address=lambda: ("127.0.0.1", 7000), metrics=recorder,
    )  # fmt: skip
    for request_id in ("done", "expires", "released"):
        producer.request_finished(request_id, ((1,),), 2, token_ids=[5, 6])
    sends = producer.take_step()[0]  # lease keys, "<request id>@<lease id>"
    (done_key,) = [key for key in sends if key.startswith("done@")]
    (released_key,) = [key for key in sends if key.startswith("released@")]
    now_s[0] += 1.0
    producer.on_reports([WorkerReport(tp_rank=0, finished_sending=(done_key,))])
    leases.release([released_key])  # decode names the lease by its key
    now_s[0] += 1.0
    producer.end_lapsed_leases()
    now_s[0] += 10.0
    producer.end_lapsed_leases()
    snapshot = recorder.snapshot()
    assert {name: snapshot.counters[name] for name in snapshot.counters} == {
        LEASES_STARTED.name: {"": 3},
        LEASES_COMPLETED.name: {"": 1},
        LEASES_RELEASED.name: {"": 1},
        LEASES_EXPIRED.name: {"": 1},
    }
    free = snapshot.histograms[PREFILL_FREE_SECONDS.name]
    assert (free.count, free.sum) == (3, pytest.approx(1.0 + 2.0 + 12.0))


def test_the_http_exporter_shows_every_metric_with_exact_buckets() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from connector.observability.metrics_prometheus import MetricsServer

    recorder = MetricsRecorder()
    recorder.inc(LOADS_FAILED, "transfer_timeout")
    recorder.observe(TRANSFER_BYTES, 4096)
    recorder.observe(TRANSFER_BYTES, 5000)
    server = MetricsServer(recorder, "127.0.0.1", 0)
    try:
        text = generate_latest(server.registry).decode()
        assert server.url == f"http://127.0.0.1:{server.port}/metrics" and server.port > 0
    finally:
        server.close()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("nixl_pd_loads_failed_total", (("reason", "transfer_timeout"),))] == 1
    assert samples[("nixl_pd_loads_failed_total", (("reason", "plan"),))] == 0
    assert samples[("nixl_pd_transfer_bytes_bucket", (("le", "1024.0"),))] == 0
    assert samples[("nixl_pd_transfer_bytes_bucket", (("le", "4096.0"),))] == 1  # le: inclusive
    assert samples[("nixl_pd_transfer_bytes_bucket", (("le", "16384.0"),))] == 2
    assert samples[("nixl_pd_transfer_bytes_bucket", (("le", "+Inf"),))] == 2
    assert samples[("nixl_pd_transfer_bytes_sum", ())] == 9096
    assert samples[("nixl_pd_leases_expired_total", ())] == 0
    assert "# TYPE nixl_pd_handshake_seconds histogram" in text
