"""End to end in one process: prefill and decode engines, each a real SchedulerConnector plus one
WorkerConnector per TP rank, FakeNixl moving real bytes and the side channel on loopback.

Every scenario ends with the accounting check: every block either engine allocated came back
exactly once (a double free raises), and every request was reported exactly once (counted).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from connector.config import ConnectorConfig
from connector.geometry import build_rank_layout
from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec, MemoryLayout
from connector.metadata import BlockIds, SideChannelBoot
from connector.net.side_channel_client import send_heartbeat
from connector.observability.metrics import (
    QUARANTINED_BLOCKS,
    QUARANTINED_LOADS,
    UNQUARANTINED_BLOCKS,
    default_recorder,
)
from connector.protocol import WorkerHandshake, lease_key
from scheduler.connector import RequestInfo, Role, SchedulerConnector
from scheduler.heartbeats import HeartbeatSender
from scheduler.requests import uncached_suffix_blocks
from tests import oracle
from tests.scheduler_helpers import prompt_ids
from worker.connector import WorkerConnector, side_channel_fetcher
from worker.fake import FakeFabric, FakeNixl
from worker.handshake import Fetcher

CONFIG = ConnectorConfig(
    side_channel_port=0,
    kv_lease_duration_s=30.0,
    heartbeat_interval_s=5.0,
    handshake_timeout_s=2.0,
    handshake_retries=0,
)
LEASE_S = CONFIG.kv_lease_duration_s


def make_spec(
    *, model: str = "tiny", kind: GroupKind = GroupKind.FULL, num_kv_heads: int = 4,
    block_size: int = 4, kernel_block_size: int | None = None,
    memory_layout: MemoryLayout = MemoryLayout.NHD,
) -> KVCacheSpec:  # fmt: skip
    num_planes = 1 if kind is GroupKind.MLA else 2
    layers = tuple(LayerSpec(f"l{i}", num_kv_heads, 8, 2, num_planes) for i in range(2))
    group = GroupSpec(kind, block_size, kernel_block_size or block_size, 32, layers)
    return KVCacheSpec(model, "bfloat16", "bfloat16", (group,), memory_layout)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class CountingNixl(FakeNixl):
    """FakeNixl that counts posted READs and records the names of the threads calling it."""

    def __init__(self, name: str, fabric: FakeFabric) -> None:
        super().__init__(name, fabric)
        self.num_posted = 0
        self.threads: set[str] = set()

    def __getattribute__(self, attribute: str) -> Any:
        if not attribute.startswith("_") and attribute not in ("threads", "num_posted", "faults"):
            object.__getattribute__(self, "__dict__").setdefault("threads", set()).add(
                threading.current_thread().name
            )
        return object.__getattribute__(self, attribute)

    def post(self, transfer: Any) -> Any:
        self.num_posted += 1
        return super().post(transfer)


class BlockPool:
    """The engine's block allocator: every block it hands out must come back exactly once."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self._groups = spec.groups
        self._free = [list(range(group.num_blocks)) for group in spec.groups]

    def allocate(self, num_tokens: int) -> BlockIds:
        counts = [-(-num_tokens // group.block_size) for group in self._groups]
        return tuple(
            tuple(free.pop(0) for _ in range(count))
            for free, count in zip(self._free, counts, strict=True)
        )

    def release(self, block_ids: BlockIds) -> None:
        for free, ids in zip(self._free, block_ids, strict=True):
            for block in ids:
                assert block not in free, f"block {block} freed twice"
                free.append(block)

    @property
    def num_leaked(self) -> int:
        return sum(
            g.num_blocks - len(free) for g, free in zip(self._groups, self._free, strict=True)
        )


class Engine:
    """One engine as the connector sees it: scheduler side, TP worker ranks, KV memory."""

    def __init__(
        self, name: str, role: Role, spec: KVCacheSpec, tp_size: int, *, clock: Clock,
        fabric: FakeFabric, config: ConnectorConfig = CONFIG,
        heartbeats: HeartbeatSender | None = None, fetch: Fetcher | None = None,
        make_agent: Callable[[str], Any] | None = None,
    ) -> None:  # fmt: skip
        self.name, self.role, self.spec = name, role, spec
        self.layouts = [build_rank_layout(spec, rank, tp_size) for rank in range(tp_size)]
        make = oracle.sentinel if role is Role.CONSUMER else (lambda lay: oracle.noise(lay, 7))
        self.buffers = [make(layout) for layout in self.layouts]
        make_agent = make_agent or (lambda agent_name: CountingNixl(agent_name, fabric))
        self.agents = [make_agent(f"{name}-r{rank}") for rank in range(tp_size)]
        self.workers = [
            WorkerConnector(config, engine_id=name, tp_rank=rank, tp_size=tp_size, spec=spec,
                            agent=agent, clock=clock, fetch=fetch)
            for rank, agent in enumerate(self.agents)
        ]  # fmt: skip
        for worker, buffers in zip(self.workers, self.buffers, strict=True):
            worker.register_kv_caches([buffer.ctypes.data for buffer in buffers])
        self.scheduler = SchedulerConnector(
            config, engine_id=name, role=role, spec=spec, tp_size=tp_size, clock=clock,
            heartbeat_sender=heartbeats,
        )  # fmt: skip
        if role is Role.PRODUCER:
            self.scheduler.start_side_channel([w.get_handshake_metadata() for w in self.workers])
        self.pool = BlockPool(spec)
        self.held: dict[str, BlockIds] = {}
        self.free_on_report: set[str] = set()
        self.reports: collections.Counter[str] = collections.Counter()
        self.outcomes: dict[str, str | None] = {}  # decode: None = received, else the reason

    def step(self) -> None:
        metadata = self.scheduler.build_connector_meta()
        for worker in self.workers:
            worker.start_load_kv(metadata)
        # Deterministic steps: a transfer-thread pass applies the metadata and one more runs
        # before the report (a real engine never waits: it reports what is ready).
        for worker in self.workers:
            assert worker.flush() and worker.flush()
        self.scheduler.update_connector_output([w.get_finished() for w in self.workers])
        finished = self.scheduler.take_finished()
        for request_id in finished.finished_sending:
            self._report(request_id, None)
            self.free(request_id)
        for request_id in finished.finished_recving:
            self._report(request_id, None)
        for request_id, failure in finished.failed_recving.items():
            self._report(request_id, failure.message)

    def _report(self, request_id: str, reason: str | None) -> None:
        self.reports[request_id] += 1
        self.outcomes[request_id] = reason
        if request_id in self.free_on_report:
            self.free_on_report.discard(request_id)
            self.free(request_id)

    def free(self, request_id: str) -> None:
        self.pool.release(self.held.pop(request_id))

    # Prefill.

    def prefill(self, request_id: str, num_tokens: int) -> dict[str, Any]:
        info = RequestInfo(
            request_id, num_tokens, {"do_remote_decode": True}, token_ids=prompt_ids(num_tokens)
        )
        assert self.scheduler.get_num_new_matched_tokens(info, 0) == (0, False)
        block_ids = self.held[request_id] = self.pool.allocate(num_tokens)
        request = oracle.Request(num_tokens, 0, (), block_ids)
        for layout, buffers in zip(self.layouts, self.buffers, strict=True):
            for buffer, computed in zip(
                buffers, oracle.fill_prefill(layout, request, 7), strict=True
            ):
                buffer[:] = computed
        delay, params = self.scheduler.request_finished(info, block_ids)
        assert delay and params is not None
        return params

    # Decode.

    def receive(self, request_id: str, params: dict[str, Any], num_tokens: int, num_cached: int = 0,
                *, allocate: bool = True) -> RequestInfo:  # fmt: skip
        info = RequestInfo(request_id, num_tokens, params, token_ids=prompt_ids(num_tokens))
        num_external, _ = self.scheduler.get_num_new_matched_tokens(info, num_cached)
        if allocate:
            self.allocate(info, num_external)
        return info

    def allocate(self, info: RequestInfo, num_external: int) -> None:
        block_ids = self.held[info.request_id] = self.pool.allocate(info.num_prompt_tokens)
        self.scheduler.update_state_after_alloc(info, block_ids, num_external)

    def finish(self, info: RequestInfo, *, aborted: bool = False) -> None:
        """The request ends (decoded, failed or aborted); free now unless the connector delays."""
        if aborted:
            info = RequestInfo(
                info.request_id, info.num_prompt_tokens, info.kv_transfer_params, True,
                token_ids=info.token_ids,
            )  # fmt: skip
        delay, _ = self.scheduler.request_finished(info, self.held.get(info.request_id, ((),)))
        if info.request_id not in self.held:
            return
        if delay:
            self.free_on_report.add(info.request_id)
        else:
            self.free(info.request_id)

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()
        for agent in self.agents:
            agent.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def engines(clock: Clock) -> Iterator[Callable[..., Engine]]:
    fabric = FakeFabric()
    made: list[Engine] = []
    names = itertools.count()

    def make(role: Role, spec: KVCacheSpec, tp_size: int, **kwargs: Any) -> Engine:
        kind = "prefill" if role is Role.PRODUCER else "decode"
        engine = Engine(
            f"{kind}{next(names)}", role, spec, tp_size, clock=clock, fabric=fabric, **kwargs
        )
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def run_until(
    engines: Sequence[Engine], condition: Callable[[], bool], timeout_s: float = 5.0
) -> None:
    """Step every engine until ``condition`` (handshakes and heartbeats run on real threads)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the engines did not get there in time"
        for engine in engines:
            engine.step()
        time.sleep(0.001)


def assert_accounted(*engines: Engine) -> None:
    main = threading.current_thread().name
    for engine in engines:
        # The engine thread registers and shuts down; between, only transfer threads (FakeNixl
        # also touches the peer agent of a READ) call agents, never handshake or sender threads.
        for agent in engine.agents:
            others = getattr(agent, "threads", set()) - {main}
            assert all(name.startswith("nixl-pd-transfer-r") for name in others), others
        assert engine.pool.num_leaked == 0, f"{engine.name} leaked blocks"
        assert not engine.held and not engine.free_on_report
        assert all(count == 1 for count in engine.reports.values()), engine.reports


def assert_bytes_landed(decode: Engine, request_id: str, prefill_ids: BlockIds, num_tokens: int,
                        num_cached: int) -> None:  # fmt: skip
    block_ids = decode.held[request_id]
    suffix = uncached_suffix_blocks(
        block_ids, decode.spec.groups, num_cached_tokens=num_cached, num_tokens=num_tokens
    )
    request = oracle.Request(num_tokens, num_cached, suffix, prefill_ids)
    for layout, buffers in zip(decode.layouts, decode.buffers, strict=True):
        difference = oracle.first_difference(buffers, oracle.expected_decode(layout, request))
        assert difference is None, f"decode rank {layout.tp_rank}: {difference}"


# --- full lifecycle --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "spec_kwargs", "num_cached"),
    [
        pytest.param(1, 1, {}, 0, id="tp1-tp1"),
        pytest.param(1, 2, {}, 0, id="p1-d2"),
        pytest.param(2, 1, {}, 0, id="p2-d1"),
        pytest.param(2, 2, {"memory_layout": MemoryLayout.HND}, 4, id="p2-d2-hnd-prefix-hit"),
        pytest.param(2, 1, {"kind": GroupKind.MLA, "num_kv_heads": 1}, 0, id="mla-p2-d1-notify-only"),
        pytest.param(1, 2, {"block_size": 8, "kernel_block_size": 4}, 0, id="kernel-blocks"),
    ],
)  # fmt: skip
def test_full_lifecycle_moves_the_bytes(
    engines: Callable[..., Engine], prefill_tp: int, decode_tp: int, spec_kwargs: dict[str, Any],
    num_cached: int,
) -> None:  # fmt: skip
    spec = make_spec(**spec_kwargs)
    prefill = engines(Role.PRODUCER, spec, prefill_tp)
    decode = engines(Role.CONSUMER, spec, decode_tp)
    num_tokens = 13
    params = prefill.prefill("p-1", num_tokens)
    prefill_ids = prefill.held["p-1"]
    info = decode.receive("d-1", params, num_tokens, num_cached)
    run_until([prefill, decode], lambda: "d-1" in decode.outcomes and "p-1" in prefill.outcomes)
    assert decode.outcomes == {"d-1": None}
    assert_bytes_landed(decode, "d-1", prefill_ids, num_tokens, num_cached)
    decode.finish(info)
    assert_accounted(prefill, decode)


def test_many_requests_share_one_handshake_and_finish_once(engines: Callable[..., Engine]) -> None:
    prefill = engines(Role.PRODUCER, make_spec(), 2)
    decode = engines(Role.CONSUMER, make_spec(), 2)
    infos = [decode.receive(f"d-{i}", prefill.prefill(f"p-{i}", 5 + i), 5 + i) for i in range(6)]
    run_until([prefill, decode], lambda: len(decode.outcomes) == 6 and len(prefill.outcomes) == 6)
    assert set(decode.outcomes.values()) == {None}
    for info in infos:
        decode.finish(info)
    assert_accounted(prefill, decode)


# --- aborts ----------------------------------------------------------------------------------


def test_abort_before_schedule_releases_prefill_at_once(engines: Callable[..., Engine]) -> None:
    prefill = engines(Role.PRODUCER, make_spec(), 2)
    decode = engines(Role.CONSUMER, make_spec(), 1)
    info = decode.receive("d-1", prefill.prefill("p-1", 9), 9, allocate=False)
    decode.finish(info, aborted=True)  # the engine dropped it before allocating blocks
    run_until([prefill, decode], lambda: "p-1" in prefill.outcomes)  # no lease expiry needed
    assert "d-1" not in decode.outcomes  # the engine never waited for it
    assert_accounted(prefill, decode)


def test_abort_after_alloc_before_load_reports_aborted(engines: Callable[..., Engine]) -> None:
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 2)
    info = decode.receive("d-1", prefill.prefill("p-1", 9), 9)
    decode.finish(info, aborted=True)
    run_until([prefill, decode], lambda: "d-1" in decode.outcomes and "p-1" in prefill.outcomes)
    assert decode.outcomes == {"d-1": "aborted"}
    assert_accounted(prefill, decode)


@pytest.mark.parametrize("stall_polls", [pytest.param(0, id="while-handshaking"),
                                         pytest.param(5, id="mid-transfer")])  # fmt: skip
def test_abort_during_load_waits_for_the_load(
    engines: Callable[..., Engine], stall_polls: int
) -> None:
    gate = threading.Event()  # holds the handshake until the abort is in
    fetch_over_zmq = side_channel_fetcher(CONFIG)

    def gated_fetch(host: str, port: int, tp_rank: int) -> WorkerHandshake:
        gate.wait(5.0)
        return fetch_over_zmq(host, port, tp_rank, "")

    if stall_polls:
        gate.set()
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 1, fetch=gated_fetch)
    agent = decode.agents[0]
    agent.faults.stall_polls = stall_polls
    info = decode.receive("d-1", prefill.prefill("p-1", 9), 9)
    decode.step()  # the LoadSpec goes out; the handshake starts on its thread
    if stall_polls:
        run_until([decode], lambda: agent.num_posted == 1)
    assert agent.num_posted == (1 if stall_polls else 0)
    decode.finish(info, aborted=True)
    decode.step()
    assert "d-1" in decode.held and not decode.outcomes  # blocks stay under a possible READ
    gate.set()
    run_until([prefill, decode], lambda: "d-1" in decode.outcomes and "p-1" in prefill.outcomes)
    assert_accounted(prefill, decode)


def test_engine_failing_requests_mid_load_under_load_leaks_nothing(
    engines: Callable[..., Engine],
) -> None:
    """Issue 11: an engine that runs out of blocks fails some requests in every state while
    others load; the connector reports each once, the rest finish, and no block leaks."""
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 1)
    decode.agents[0].faults.stall_polls = 3  # READs stay in flight for a few steps
    infos = [decode.receive(f"d-{i}", prefill.prefill(f"p-{i}", 5), 5) for i in range(6)]
    unallocated = decode.receive("d-x", prefill.prefill("p-x", 5), 5, allocate=False)
    decode.step()  # loads go out; handshake on its thread
    run_until([decode], lambda: decode.agents[0].num_posted >= 1)
    for info in (*infos[::2], unallocated):  # the engine gives up on these mid-load
        decode.finish(info, aborted=True)
    run_until(
        [prefill, decode],
        lambda: len(decode.outcomes) == 6 and len(prefill.outcomes) == 7,
    )
    # A load whose READ already finished is reported received; decode then frees at once.
    assert {decode.outcomes[info.request_id] for info in infos[::2]} <= {"aborted", None}
    assert {decode.outcomes[info.request_id] for info in infos[1::2]} == {None}
    for info in infos[1::2]:
        decode.finish(info)
    assert_accounted(prefill, decode)


def test_abort_after_receive_frees_at_once(engines: Callable[..., Engine]) -> None:
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 1)
    info = decode.receive("d-1", prefill.prefill("p-1", 9), 9)
    run_until([prefill, decode], lambda: "d-1" in decode.outcomes and "p-1" in prefill.outcomes)
    decode.finish(info, aborted=True)
    assert_accounted(prefill, decode)


# --- leases ----------------------------------------------------------------------------------


def test_lease_expires_when_no_decode_reads(engines: Callable[..., Engine], clock: Clock) -> None:
    prefill = engines(Role.PRODUCER, make_spec(), 2)
    prefill.prefill("p-1", 9)
    prefill.step()
    assert "p-1" not in prefill.outcomes
    clock.now_s += LEASE_S + 1
    prefill.step()
    assert prefill.outcomes == {"p-1": None}
    assert_accounted(prefill)


def test_heartbeats_renew_the_lease(engines: Callable[..., Engine], clock: Clock) -> None:
    acked = threading.Event()

    def send(destination: SideChannelBoot, ids: Sequence[str]) -> None:
        engine_id, host, port, _ = destination
        send_heartbeat(host, port, ids, engine_id=engine_id, secret=None, timeout_s=2.0)
        acked.set()

    heartbeats = HeartbeatSender(secret=None, timeout_s=2.0, send=send)
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 1, heartbeats=heartbeats)
    info = decode.receive("d-1", prefill.prefill("p-1", 9), 9, allocate=False)
    clock.now_s += CONFIG.heartbeat_interval_s + 1
    decode.step()  # waiting for blocks; the heartbeat goes out
    assert acked.wait(5.0)
    clock.now_s += LEASE_S - CONFIG.heartbeat_interval_s  # past the first lease's end
    prefill.step()
    assert "p-1" not in prefill.outcomes  # renewed, still held
    decode.allocate(info, 9)
    run_until([prefill, decode], lambda: "d-1" in decode.outcomes and "p-1" in prefill.outcomes)
    assert decode.outcomes == {"d-1": None}
    decode.finish(info)
    assert_accounted(prefill, decode)


# --- peers that go away or do not fit --------------------------------------------------------


def test_prefill_gone_before_handshake_fails_fast(engines: Callable[..., Engine]) -> None:
    config = ConnectorConfig(side_channel_port=0, handshake_timeout_s=0.3, handshake_retries=1)
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 2, config=config)
    params = prefill.prefill("p-1", 9)
    prefill.shutdown()  # the whole prefill engine dies: side channel and agents
    info = decode.receive("d-1", params, 9)
    run_until([decode], lambda: "d-1" in decode.outcomes)
    assert "did not answer within 0.3 s" in (decode.outcomes["d-1"] or "")
    decode.finish(info)
    assert_accounted(decode)


@pytest.mark.parametrize("stall_polls", [pytest.param(0, id="before-transfer"),
                                         pytest.param(3, id="during-transfer")])  # fmt: skip
def test_prefill_agents_gone_fail_the_read(
    engines: Callable[..., Engine], stall_polls: int
) -> None:
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 1)
    params = prefill.prefill("p-1", 9)
    if not stall_polls:
        prefill.agents[0].close()  # the worker died; its side channel still answers
    decode.agents[0].faults.stall_polls = stall_polls
    info = decode.receive("d-1", params, 9)
    if stall_polls:
        run_until([decode], lambda: decode.agents[0].num_posted == 1)
        prefill.agents[0].close()
    run_until([decode], lambda: "d-1" in decode.outcomes)
    assert "remote agent disconnected" in (decode.outcomes["d-1"] or "")
    decode.finish(info)
    assert_accounted(decode)


def test_timed_out_read_is_reported_only_once_it_can_no_longer_land(
    engines: Callable[..., Engine], clock: Clock
) -> None:
    """Issue 30 item 5: NIXL over UCX does not stop a READ when its handle is released. A READ
    stalled past the transfer timeout keeps decode's blocks (the load unreported) until it
    ends; once reported, no byte lands in them."""
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 1)
    agent = decode.agents[0]
    agent.faults.stall_polls = 40  # a paused prefill: the READ stays in flight a while
    agent.faults.land_after_release = True  # as UCX: release() does not stop it
    before = default_recorder().snapshot().counters
    info = decode.receive("d-1", prefill.prefill("p-1", 9), 9)
    run_until([decode], lambda: agent.num_posted == 1)
    clock.now_s += LEASE_S + 1  # past the transfer timeout (the lease duration)
    sentinel = [buffer.copy() for buffers in decode.buffers for buffer in buffers]
    run_until([decode], lambda: "d-1" in decode.outcomes)
    assert "did not finish within" in (decode.outcomes["d-1"] or "")
    assert _differs(decode, sentinel), "reported while its READ had not landed"
    after_report = [buffer.copy() for buffers in decode.buffers for buffer in buffers]
    for _ in range(60):  # longer than any stall left: a READ still live would land now
        decode.step()
    assert not _differs(decode, after_report), "a READ wrote blocks already reported"
    after = default_recorder().snapshot().counters
    counted = {
        spec.name: sum(after.get(spec.name, {}).values()) - sum(before.get(spec.name, {}).values())
        for spec in (QUARANTINED_LOADS, QUARANTINED_BLOCKS, UNQUARANTINED_BLOCKS)
    }
    num_blocks = sum(len(ids) for ids in decode.held["d-1"])
    assert list(counted.values()) == [1, num_blocks, num_blocks]
    decode.finish(info)
    prefill.step()
    assert_accounted(decode)


def _differs(engine: Engine, snapshot: list[Any]) -> bool:
    buffers = [buffer for per_rank in engine.buffers for buffer in per_rank]
    return any((now != then).any() for now, then in zip(buffers, snapshot, strict=True))


def test_incompatible_model_fails_and_prefill_lease_frees(
    engines: Callable[..., Engine], clock: Clock
) -> None:
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(model="another-model"), 1)
    info = decode.receive("d-1", prefill.prefill("p-1", 9), 9)
    run_until([prefill, decode], lambda: "d-1" in decode.outcomes)
    assert "model: local 'another-model', remote 'tiny'" in (decode.outcomes["d-1"] or "")
    decode.finish(info)
    clock.now_s += LEASE_S + 1
    prefill.step()
    assert_accounted(prefill, decode)


def test_stray_duplicate_and_garbage_notifications_change_nothing(
    engines: Callable[..., Engine], clock: Clock
) -> None:
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 1)
    target = prefill.agents[0]
    rogue = decode.agents[0]  # a real peer misbehaving: it already knows prefill's agent
    params = prefill.prefill("p-1", 9)
    info = decode.receive("d-1", params, 9)
    run_until([prefill, decode], lambda: "d-1" in decode.outcomes and "p-1" in prefill.outcomes)
    # Notifications name the lease (request@lease): the ended lease's key is a late duplicate,
    # the bare request id names no lease at all (stray, like the never-leased one).
    ended_key = lease_key("p-1", params["remote_lease_id"]).encode()
    for message in (ended_key + b":1", b"garbage", b"\xff\xfe:1", b"never-leased:1", b"p-1:0",
                    b"p-1:1"):  # fmt: skip
        rogue.send_notif(target.name, message)
    info2 = decode.receive("d-2", prefill.prefill("p-2", 9), 9)
    run_until([prefill, decode], lambda: "d-2" in decode.outcomes and "p-2" in prefill.outcomes)
    assert decode.outcomes == {"d-1": None, "d-2": None}
    clock.now_s += LEASE_S + 1  # the never-leased ids are written off as stray
    prefill.step()
    stats = prefill.workers[0].notification_stats
    assert (stats.counted, stats.duplicate, stats.garbage, stats.stray) == (2, 1, 3, 2)
    decode.finish(info)
    decode.finish(info2)
    assert_accounted(prefill, decode)


@pytest.mark.real_nixl
def test_full_lifecycle_over_real_nixl(engines: Callable[..., Engine]) -> None:
    from worker.nixl_real import RealNixlAgent

    def real_agent(name: str) -> RealNixlAgent:
        return RealNixlAgent(f"{name}-{uuid.uuid4().hex[:8]}")

    spec = make_spec()
    prefill = engines(Role.PRODUCER, spec, 2, make_agent=real_agent)
    decode = engines(Role.CONSUMER, spec, 1, make_agent=real_agent)
    params = prefill.prefill("p-1", 11)
    prefill_ids = prefill.held["p-1"]
    info = decode.receive("d-1", params, 11)
    # Real agents and threads: on a loaded 2-core machine this took up to 16 s (2 s quiet).
    done = lambda: "d-1" in decode.outcomes and "p-1" in prefill.outcomes  # noqa: E731
    run_until([prefill, decode], done, timeout_s=30.0)
    assert decode.outcomes == {"d-1": None}
    assert_bytes_landed(decode, "d-1", prefill_ids, 11, 0)
    decode.finish(info)
    assert_accounted(prefill, decode)


def test_an_internal_error_during_a_read_keeps_its_blocks_until_it_ends(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug on a load's path fails it, but a READ NIXL still runs is not released and its
    blocks are not reported until it ends: release() would not stop it (UCX)."""
    prefill = engines(Role.PRODUCER, make_spec(), 1)
    decode = engines(Role.CONSUMER, make_spec(), 1)
    agent = decode.agents[0]
    agent.faults.stall_polls = 20
    agent.faults.land_after_release = True  # as UCX: release() does not stop it
    info = decode.receive("d-1", prefill.prefill("p-1", 9), 9)
    run_until([decode], lambda: agent.num_posted == 1)

    def broken_poll(self: Any, load: Any) -> None:
        raise RuntimeError("a bug while polling")

    monkeypatch.setattr("worker.loads.LoadTable._poll", broken_poll)
    sentinel = [buffer.copy() for buffers in decode.buffers for buffer in buffers]
    run_until([decode], lambda: "d-1" in decode.outcomes)
    assert "internal error: RuntimeError('a bug while polling')" in (decode.outcomes["d-1"] or "")
    assert _differs(decode, sentinel), "reported while its READ had not landed"
    after_report = [buffer.copy() for buffers in decode.buffers for buffer in buffers]
    for _ in range(40):  # longer than any stall left: a READ still live would land now
        decode.step()
    assert not _differs(decode, after_report), "a READ wrote blocks already reported"
    decode.finish(info)
    prefill.step()
    assert_accounted(decode)
