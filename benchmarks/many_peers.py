"""Many peers, in one process: what a decode rank pays per prefill engine, and what a prefill
engine pays per reader, at several sizes so the growth law is measured, not assumed.

No engines: prefill engines are real SideChannelServers holding real leases and serving
WorkerHandshakes of FakeNixl agents (TP 8, real registered buffers); the decode rank is a real
WorkerConnector (FakeNixl, the real ZMQ handshake and lease-check clients). Sections:

  handshake   one decode rank (TP 1) pairs with E prefill engines of TP 8 (8*E remote ranks):
              wall time to the first load from each (handshake + lease checks + READs),
              retained memory per peer (tracemalloc), then a burst of 8 loads from each engine
              in one step: its wall time and the LeaseCheck messages the side channels got
  side        one prefill side channel: LeaseCheck messages per second with 1..256 leases each,
              and handshake requests per second (what 256 decode readers cost it)
  scheduler   scheduler hooks per engine step with N leases (prefill) or N loads (decode) in
              flight
  worker      one transfer-thread pass over N loads in flight

    UCX_NET_DEVICES=lo PYTHONPATH=$PWD .venv/bin/python -m benchmarks.many_peers [--quick]

Timings on a shared 2-core machine are noisy: read the ratios between sizes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from connector.config import ConnectorConfig
from connector.geometry import build_rank_layout
from connector.metadata import ConnectorMetadata, LoadSpec, RemoteSource, WorkerReport
from connector.net.side_channel_client import check_leases_status, fetch_boot_id, fetch_handshake
from connector.params import parse_kv_transfer_params
from connector.protocol import PROTOCOL_VERSION, LeaseRef, WorkerHandshake
from scheduler.connector import SchedulerConnector
from scheduler.heartbeats import HeartbeatSender
from scheduler.leases import LeaseTable
from scheduler.requests import RequestInfo, Role
from scheduler.side_channel import SideChannelServer
from tests.test_worker_parts import make_spec
from worker.connector import WorkerConnector
from worker.fake import FakeFabric, FakeNixl
from worker.handshake import fingerprint

HOST = "127.0.0.1"
SPEC = make_spec(num_kv_heads=8, num_layers=4, num_blocks=32)
PREFILL_TP = 8
BURST_PER_ENGINE = 8  # loads from each prefill engine in one step, once handshaken
CONFIG = ConnectorConfig(handshake_timeout_s=5.0, handshake_retries=0, kv_lease_duration_s=600.0)
IDS = [1, 2, 3, 4]  # a finished request's token ids: a lease is bound to them


@dataclass
class Prefill:
    """One prefill engine: TP 8 FakeNixl ranks with real buffers, a side channel, leases."""

    engine_id: str
    server: SideChannelServer
    leases: LeaseTable
    buffers: list[np.ndarray]
    num_checks: list[int]  # LeaseCheck messages served
    num_refs: list[int]  # leases named in them

    def lease(self, request_id: str) -> RemoteSource:
        lease_id = f"l-{request_id}"
        self.leases.lease(request_id, time.monotonic(), lease_id)
        return RemoteSource(
            self.engine_id, HOST, self.server.port, PREFILL_TP, request_id, ((1, 2),),
            boot_id=self.server.boot_id, lease_id=lease_id,
        )  # fmt: skip


def start_prefill(engine_id: str, fabric: FakeFabric) -> Prefill:
    handshakes, buffers = {}, []
    digest, facts = fingerprint(SPEC)
    for rank in range(PREFILL_TP):
        layout = build_rank_layout(SPEC, rank, PREFILL_TP)
        agent = FakeNixl(f"{engine_id}-r{rank}", fabric)
        regions = [np.zeros(size, dtype=np.uint8) for size in layout.region_bytes]
        buffers.extend(regions)
        addresses = tuple(region.ctypes.data for region in regions)
        agent.register_regions(list(zip(addresses, layout.region_bytes, strict=True)))
        handshakes[rank] = WorkerHandshake(
            PROTOCOL_VERSION, engine_id, rank, PREFILL_TP, agent.name,
            agent.get_agent_metadata(), addresses, layout, digest, dict(facts),
        )  # fmt: skip
    leases = LeaseTable(600.0)
    num_checks, num_refs = [0], [0]

    def on_check(refs: tuple[LeaseRef, ...]):  # type: ignore[no-untyped-def]
        num_checks[0] += 1
        num_refs[0] += len(refs)
        return leases.check(refs, time.monotonic())

    server = SideChannelServer(
        HOST, 0, handshakes, engine_id=engine_id, on_heartbeat=lambda ids: 0,
        on_release=leases.release, on_lease_check=on_check,
    )  # fmt: skip
    server.start()
    return Prefill(engine_id, server, leases, buffers, num_checks, num_refs)


def decode_rank(fabric: FakeFabric) -> tuple[WorkerConnector, list[np.ndarray]]:
    layout = build_rank_layout(SPEC, 0, 1)
    regions = [np.zeros(size, dtype=np.uint8) for size in layout.region_bytes]
    worker = WorkerConnector(
        CONFIG, engine_id="decode", tp_rank=0, tp_size=1, spec=SPEC,
        agent=FakeNixl("decode-r0", fabric),
    )  # fmt: skip
    worker.register_kv_caches([region.ctypes.data for region in regions])
    return worker, regions


def run_loads(worker: WorkerConnector, loads: list[LoadSpec], timeout_s: float = 120.0) -> float:
    """Submit ``loads`` in one step; seconds until every one is reported (all must succeed)."""
    start = time.perf_counter()
    worker.start_load_kv(ConnectorMetadata(loads=tuple(loads)))
    done: dict[str, str | None] = {}
    while len(done) < len(loads):
        if time.perf_counter() - start > timeout_s:
            raise SystemExit(f"only {len(done)} of {len(loads)} loads ended in {timeout_s} s")
        report: WorkerReport = worker.get_finished()
        done.update(dict.fromkeys(report.finished_recving))
        done.update(report.failed_recving)
        time.sleep(0.001)
    failed = {key: reason for key, reason in done.items() if reason is not None}
    if failed:
        raise SystemExit(f"{len(failed)} loads failed, e.g. {next(iter(failed.items()))}")
    return time.perf_counter() - start


def handshake_section(sizes: list[int]) -> list[dict[str, object]]:
    rows = []
    for num_engines in sizes:
        fabric = FakeFabric()
        prefills = [start_prefill(f"p{index}", fabric) for index in range(num_engines)]
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        worker, _regions = decode_rank(fabric)
        try:
            first = [
                LoadSpec(f"a{i}", ((0, 1),), 8, 0, prefill.lease(f"a{i}"))
                for i, prefill in enumerate(prefills)
            ]
            cold_s = run_loads(worker, first)
            gc.collect()
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            checks_before = sum(p.num_checks[0] for p in prefills)
            burst = [
                LoadSpec(f"b{i}-{j}", ((2 + 2 * j, 3 + 2 * j),), 8, 0, prefill.lease(f"b{i}-{j}"))
                for i, prefill in enumerate(prefills)
                for j in range(BURST_PER_ENGINE)
            ]
            burst_s = run_loads(worker, burst)
            retained = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
            rows.append({
                "prefill engines": num_engines,
                "remote ranks": num_engines * PREFILL_TP,
                "first loads s": round(cold_s, 3),
                "per peer ms": round(1000 * cold_s / num_engines, 1),
                "KiB per peer": round(retained / num_engines / 1024, 1),
                "burst loads": len(burst),
                "burst s": round(burst_s, 3),
                "LeaseChecks in burst": sum(p.num_checks[0] for p in prefills) - checks_before,
            })  # fmt: skip
        finally:
            worker.shutdown()
            for prefill in prefills:
                prefill.server.stop()
    return rows


def side_channel_section(refs_per_message: list[int], seconds: float) -> list[dict[str, object]]:
    fabric = FakeFabric()
    prefill = start_prefill("p-side", fabric)
    rows = []
    try:
        boot_id = fetch_boot_id(HOST, prefill.server.port, engine_id=None, secret=None, timeout_s=2)
        sources = [prefill.lease(f"r{i}") for i in range(max(refs_per_message))]
        for num_refs in refs_per_message:
            refs = [(s.remote_request_id, s.lease_id) for s in sources[:num_refs]]
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                held = check_leases_status(
                    HOST, prefill.server.port, refs, engine_id=prefill.engine_id,
                    boot_id=boot_id, secret=None, timeout_s=2.0,
                ).held  # fmt: skip
                assert all(held)
                count += 1
            elapsed = time.perf_counter() - start
            rows.append({
                "message": f"LeaseCheck of {num_refs}",
                "messages/s": round(count / elapsed),
                "leases/s": round(count * num_refs / elapsed),
            })  # fmt: skip
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fetch_handshake(HOST, prefill.server.port, count % PREFILL_TP, secret=None, timeout_s=2)
            count += 1
        elapsed = time.perf_counter() - start
        rows.append({
            "message": "handshake of 1 rank (Hello + request)",
            "messages/s": round(2 * count / elapsed),
            "leases/s": 0,
        })  # fmt: skip
    finally:
        prefill.server.stop()
    return rows


class _NoSend:
    def submit(self, *args: object, **kwargs: object) -> bool:
        return True

    submit_release = submit

    def stop(self) -> None:
        pass


def _connector(role: Role, engine_id: str, clock: Callable[[], float]) -> SchedulerConnector:
    sender: HeartbeatSender = _NoSend()  # type: ignore[assignment]
    return SchedulerConnector(
        CONFIG, engine_id=engine_id, role=role, spec=SPEC, tp_size=1, clock=clock,
        heartbeat_sender=sender,
    )  # fmt: skip


@contextmanager
def _started(connector: SchedulerConnector) -> Iterator[SchedulerConnector]:
    layout = build_rank_layout(SPEC, 0, 1)
    digest, facts = fingerprint(SPEC)
    handshake = WorkerHandshake(
        PROTOCOL_VERSION, "p-sched", 0, 1, "a", b"", (4096, 8192), layout, digest, dict(facts)
    )
    connector.start_side_channel([handshake])
    try:
        yield connector
    finally:
        connector.shutdown()


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def scheduler_section(sizes: list[int], steps: int) -> list[dict[str, object]]:
    """Per engine step: one new request through the hooks, plus the step's metadata and
    report handling, with ``n`` others in flight (prefill: leased; decode: loading)."""
    rows = []
    clock_s = [0.0]

    def clock() -> float:
        return clock_s[0]

    for n in sizes:
        with _started(_connector(Role.PRODUCER, "p-sched", clock)) as prefill:
            params = {"do_remote_decode": True}
            for i in range(n):
                prefill.request_finished(RequestInfo(f"h{i}", 4, params, token_ids=IDS), [[1]])
            prefill.build_connector_meta()
            samples, decode_params = [], []
            for step in range(steps):
                start = time.perf_counter()
                _, returned = prefill.request_finished(
                    RequestInfo(f"s{step}", 4, params, token_ids=IDS), [[3]]
                )
                prefill.build_connector_meta()
                prefill.update_connector_output([WorkerReport(0)])
                prefill.take_finished()
                samples.append(time.perf_counter() - start)
                decode_params.append(returned)
        decode = _connector(Role.CONSUMER, "d-sched", clock)
        source = parse_kv_transfer_params(decode_params[0])
        assert source is not None
        raw = dict(decode_params[0] or {})
        for i in range(n):
            request = RequestInfo(f"d{i}", 4, raw)
            decode.get_num_new_matched_tokens(request, 0)
            decode.update_state_after_alloc(request, [[i % 30]], 4)
        decode.build_connector_meta()
        decode_samples = []
        for step in range(steps):
            request = RequestInfo(f"e{step}", 4, raw)
            start = time.perf_counter()
            decode.get_num_new_matched_tokens(request, 0)
            decode.update_state_after_alloc(request, [[3]], 4)
            decode.build_connector_meta()
            decode.update_connector_output([WorkerReport(0)])
            decode.take_finished()
            decode.has_pending_work()
            decode_samples.append(time.perf_counter() - start)
        decode.shutdown()
        rows.append({
            "in flight": n,
            "prefill step us": _median_us(samples),
            "decode step us": _median_us(decode_samples),
        })  # fmt: skip
    return rows


class _Unanswered:
    """A lease check that never answers within the measurement: loads wait in CHECKING."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def __call__(self, remote: RemoteSource) -> bool:
        self.gate.wait(60)
        return True


def worker_section(sizes: list[int]) -> list[dict[str, object]]:
    """The transfer thread's pass with ``n`` loads waiting on their lease check."""
    rows = []
    for n in sizes:
        fabric = FakeFabric()
        prefill = start_prefill("p-worker", fabric)
        layout = build_rank_layout(SPEC, 0, 1)
        regions = [np.zeros(size, dtype=np.uint8) for size in layout.region_bytes]
        check = _Unanswered()
        worker = WorkerConnector(
            CONFIG, engine_id="decode", tp_rank=0, tp_size=1, spec=SPEC,
            agent=FakeNixl("decode-w", fabric), lease_check=check,
        )  # fmt: skip
        worker.register_kv_caches([region.ctypes.data for region in regions])
        try:
            loads = [
                LoadSpec(f"w{i}", ((i % 30,),), 4, 0, prefill.lease(f"w{i}")) for i in range(n)
            ]
            worker.start_load_kv(ConnectorMetadata(loads=tuple(loads)))
            worker.flush(30)
            samples = []
            for _ in range(20):
                start = time.perf_counter()
                worker.flush(30)  # one whole pass after this call
                samples.append(time.perf_counter() - start)
            rows.append(
                {"loads in flight": n, "pass ms": round(statistics.median(samples) * 1e3, 2)}
            )
        finally:
            check.gate.set()
            worker.shutdown()
            prefill.server.stop()
    return rows


def print_table(title: str, rows: list[dict[str, object]]) -> None:
    print(f"\n{title}")
    headers = list(rows[0])
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in headers) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    parser.add_argument(
        "--sections", default="handshake,side,scheduler,worker", help="comma-separated"
    )
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    quick = args.quick
    if "handshake" in sections:
        sizes = [1, 4] if quick else [1, 4, 16, 64]
        print_table("decode rank x E prefill engines of TP 8", handshake_section(sizes))
    if "side" in sections:
        refs = [1, 16] if quick else [1, 16, 256]
        print_table("one prefill side channel", side_channel_section(refs, 0.3 if quick else 1.0))
    if "scheduler" in sections:
        sizes = [100, 1000] if quick else [1000, 3000, 10000]
        print_table("scheduler hooks per step", scheduler_section(sizes, 50 if quick else 200))
    if "worker" in sections:
        sizes = [100, 1000] if quick else [1000, 3000, 10000]
        print_table("transfer-thread pass", worker_section(sizes))


if __name__ == "__main__":
    main()
