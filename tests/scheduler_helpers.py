"""Shared builders for the scheduler-connector tests: specs, clock, requests and reports."""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from typing import Any

import msgspec

from connector.config import ConnectorConfig
from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec
from connector.lease_binding import block_digest, token_digest
from connector.lifecycle import TransitionTable
from connector.metadata import (
    ABORTED_LOAD,
    FailureKind,
    LoadFailure,
    LoadSpec,
    RemoteSource,
    SideChannelBoot,
    WorkerReport,
)
from connector.protocol import PROTOCOL_VERSION, LeaseRef, WorkerHandshake
from scheduler.connector import FinishedRequests, RequestInfo, Role, SchedulerConnector
from scheduler.heartbeats import HeartbeatSender
from tests.test_protocol import make_handshake

LEASE_S = 30.0
HEARTBEAT_S = 5.0
CONFIG = ConnectorConfig(
    side_channel_host="127.0.0.1",
    side_channel_port=5600,
    kv_lease_duration_s=LEASE_S,
    heartbeat_interval_s=HEARTBEAT_S,
    handshake_timeout_s=2.0,
)
LAYER = LayerSpec("layer0", num_kv_heads=4, head_dim=8, dtype_bytes=2)
FULL_16 = GroupSpec(
    GroupKind.FULL, block_size=16, kernel_block_size=16, num_blocks=64, layers=(LAYER,)
)
SSM_64 = GroupSpec(
    GroupKind.SSM, block_size=64, kernel_block_size=64, num_blocks=8, layers=(LAYER,)
)
DENSE = KVCacheSpec("tiny", "bfloat16", "bfloat16", (FULL_16,))
HYBRID = KVCacheSpec("tiny", "bfloat16", "bfloat16", (FULL_16, SSM_64))
NO_FINISHED = FinishedRequests()


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class RecordingHeartbeats(HeartbeatSender):
    """Records messages as (engine_id, host, port, lease_keys) instead of sending them:
    releases when submitted, heartbeats when the test drives the timer (``beat_if_due``; no
    thread sends them)."""

    def __init__(self) -> None:
        super().__init__(secret=None, timeout_s=1.0, send=self._record_heartbeat, timer=False)
        self.sent: list[tuple[str, str, int, tuple[str, ...]]] = []
        self.released: list[tuple[str, str, int, tuple[str, ...]]] = []

    def _record_heartbeat(self, destination: SideChannelBoot, lease_keys: Sequence[str]) -> object:
        engine_id, host, port, _ = destination
        self.sent.append((engine_id, host, port, tuple(lease_keys)))
        return len(lease_keys)

    def submit_release(self, destination: SideChannelBoot, lease_keys: Sequence[str]) -> bool:
        engine_id, host, port, _ = destination
        self.released.append((engine_id, host, port, tuple(lease_keys)))
        return True


class MoveLog:
    """Watches a lifecycle's moves (a Book's on_move): each must be an edge of ``table`` that
    continues the record's last state; a record's life starts at ``start`` and ends in a
    terminal state exactly once (a second end would have to start from ``start`` again)."""

    def __init__(self, table: TransitionTable[Any], start: enum.Enum) -> None:
        self.table = table
        self.start = start
        self.live: dict[str, enum.Enum] = {}  # request id -> state, for records not yet ended
        self.lives_ended: collections.Counter[str] = collections.Counter()
        self.edges: set[tuple[enum.Enum, enum.Enum]] = set()

    def __call__(self, request_id: str, current: enum.Enum, target: enum.Enum) -> None:
        assert self.table.allows(current, target), f"{request_id}: {current} -> {target}"
        last = self.live.get(request_id, self.start)
        assert last is current, f"{request_id} moved from {current} but stood at {last}"
        self.edges.add((current, target))
        if target in self.table.terminal:
            self.live.pop(request_id, None)
            self.lives_ended[request_id] += 1
        else:
            self.live[request_id] = target


def make_decode(
    clock: FakeClock,
    heartbeats: HeartbeatSender,
    spec: KVCacheSpec = DENSE,
    tp_size: int = 2,
) -> SchedulerConnector:
    return SchedulerConnector(
        CONFIG,
        engine_id="decode-0",
        role=Role.CONSUMER,
        spec=spec,
        tp_size=tp_size,
        clock=clock,
        heartbeat_sender=heartbeats,
    )


def prompt_ids(num_tokens: int, first: int = 100) -> list[int]:
    """Token ids for a request: leases are bound to them, so every finishing request has some."""
    return list(range(first, first + num_tokens))


def bound_ref(
    request_id: str, lease_id: str, params: dict[str, Any], num_tokens: int = 40
) -> LeaseRef:
    """A ref as a reader of ``params`` (a lease of ``prompt_ids(num_tokens)``) sends it: the
    tokens it expects and the blocks and count it reads."""
    return LeaseRef(
        request_id,
        lease_id,
        (),
        token_digest(prompt_ids(num_tokens), num_tokens),
        block_digest(params["remote_block_ids"], num_tokens),
    )


def bound_source(source: RemoteSource, num_tokens: int = 40) -> RemoteSource:
    """``source`` as a reader's rank checks it (``bound_ref``'s tokens and blocks)."""
    return msgspec.structs.replace(
        source,
        tokens=token_digest(prompt_ids(num_tokens), num_tokens),
        blocks=block_digest(source.remote_block_ids, num_tokens),
    )


def prefill_request(request_id: str = "p1", **extra: Any) -> RequestInfo:
    return RequestInfo(
        request_id, 40, {"do_remote_decode": True, **extra}, token_ids=prompt_ids(40)
    )


REMOTE_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_request_id": "p1",
    "remote_block_ids": [[1, 2, 3]],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 2,
}
REMOTE = RemoteSource("prefill-0", "127.0.0.1", 5600, 2, "p1", ((1, 2, 3),))


def decode_request(
    request_id: str = "d1", num_prompt_tokens: int = 40, **changes: Any
) -> RequestInfo:
    return RequestInfo(
        request_id,
        num_prompt_tokens,
        {**REMOTE_PARAMS, **changes},
        token_ids=prompt_ids(num_prompt_tokens),
    )


def failure(message: str, kind: FailureKind = FailureKind.TRANSFER) -> LoadFailure:
    """A rank's failed load: ``message``, as a failure of ``kind``."""
    return LoadFailure(kind, message)


ABORTED = ABORTED_LOAD


def report(tp_rank: int, **fields: Any) -> WorkerReport:
    return WorkerReport(tp_rank=tp_rank, **fields)


def all_ranks(tp_size: int = 2, **fields: Any) -> list[WorkerReport]:
    return [report(rank, **fields) for rank in range(tp_size)]


def handshakes(engine_id: str = "prefill-0", tp_size: int = 2) -> list[WorkerHandshake]:
    return [
        WorkerHandshake(
            PROTOCOL_VERSION,
            engine_id,
            rank,
            tp_size,
            f"a{rank}",
            b"",
            (),
            make_handshake(rank).layout,
            "f",
            {},
        )
        for rank in range(tp_size)
    ]


def start_load(
    decode: SchedulerConnector, request: RequestInfo | None = None, *, num_cached: int = 16
) -> LoadSpec:
    """gnnmt -> alloc -> metadata: the request's LoadSpec (blocks 10.. cover its tokens)."""
    request = request or decode_request()
    assert decode.get_num_new_matched_tokens(request, num_cached) == (40 - num_cached, True)
    decode.update_state_after_alloc(request, ((10, 11, 12),), 40 - num_cached)
    meta = decode.build_connector_meta()
    assert len(meta.loads) == 1 and meta.releases == ()
    return meta.loads[0]
