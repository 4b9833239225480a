"""A decode request through the vLLM adapter, walked along REQUEST_LOAD_LIFECYCLE (its one
record, in Consumer): its tokens are claimed on its params' word and the params read at
allocation; refused params are announced as a failed load once vLLM parked the request, and
never offered a load again; loads whose LoadSpec went out are reported by the ranks, never
echoed; nothing stays tracked once each request finished."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.outputs import KVConnectorOutput

from connector.metadata import FailureKind, LoadFailure, WorkerReport
from connector.vllm.scheduler import NixlPDWorkerMeta, SchedulerSide
from scheduler.connector import Role, SchedulerConnector
from scheduler.consumer import UNREAD_OR_REFUSED
from scheduler.requests import REQUEST_LOAD_LIFECYCLE, RequestLoadState
from tests import vllm_harness as h
from tests.scheduler_helpers import (
    CONFIG,
    DENSE,
    REMOTE_PARAMS,
    FakeClock,
    MoveLog,
    RecordingHeartbeats,
)

NUM_TOKENS = 40
BAD_PARAMS: dict[str, Any] = {"do_remote_prefill": True, "remote_block_ids": "not-a-list"}
# Refused at the first ask: without a literal true flag nothing is claimed unread.
NOT_A_FLAG: dict[str, Any] = {**REMOTE_PARAMS, "do_remote_prefill": "yes"}


class Blocks:
    """What the adapter reads of vLLM's KVCacheBlocks: the block ids per cache group."""

    def __init__(self, num_blocks: int) -> None:
        self._groups = ([10 + i for i in range(num_blocks)],)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self._groups


def walk(params: dict[str, Any], path: str) -> tuple[list[Any], MoveLog]:
    """Drive request "d1" along ``path``; returns each call's result and the moves taken."""
    log = MoveLog(REQUEST_LOAD_LIFECYCLE, RequestLoadState.NEW)
    connector = SchedulerConnector(
        CONFIG,
        engine_id="decode-0",
        role=Role.CONSUMER,
        spec=DENSE,
        tp_size=1,
        clock=FakeClock(),
        heartbeat_sender=RecordingHeartbeats(),
        on_move=log,
    )
    side = SchedulerSide(connector, h.kv_cache_config(block_size=16, num_blocks=64))
    request = h.make_request("d1", NUM_TOKENS, block_size=16, kv_transfer_params=params)
    results: list[Any] = []
    for call in path.split(", "):
        name, _, arg = call.partition(" ")
        if name == "params":  # something edits the request's params (e.g. another connector)
            request.kv_transfer_params = None if arg == "none" else {"do_remote_prefill": False}
        elif name == "match":
            results.append(side.get_num_new_matched_tokens(request, int(arg)))
        elif name == "alloc":
            side.update_state_after_alloc(request, Blocks(3), int(arg))  # type: ignore[arg-type]
        elif name == "meta":
            announce = side.build_connector_meta().announce
            results.append((*announce.finished_recving, *announce.failed_recving))
        elif name == "ranks":
            side.update_connector_output(_ranks_say(arg == "ok"))
        else:
            results.append(side.request_finished(request, ([10, 11, 12],)))
    return results, log


def _ranks_say(ok: bool) -> KVConnectorOutput:
    """The one rank's report that d1's load ended, and vLLM's own aggregate of it."""
    if ok:
        report = WorkerReport(0, finished_recving=("d1",))
    else:
        report = WorkerReport(0, failed_recving={"d1": LoadFailure(FailureKind.TRANSFER, "boom")})
    return KVConnectorOutput(
        finished_recving={"d1"},
        failed_recving=set() if ok else {"d1"},
        kv_connector_worker_meta=NixlPDWorkerMeta((report,)),
    )


CLAIMED = (NUM_TOKENS, True)
NOTHING = (0, False)
FREE = (False, None)
PATHS = [
    (
        "refused, parked, announced once, never offered again",
        BAD_PARAMS,
        "match 0, match 0, alloc 40, meta, meta, match 0, finish",
        [CLAIMED, CLAIMED, ("d1",), (), NOTHING, FREE],
    ),
    (
        "refused with nothing to load",
        BAD_PARAMS,
        "match 40, match 0, finish",
        [NOTHING] * 2 + [FREE],
    ),
    (
        "refused, finished before vLLM parked it",
        BAD_PARAMS,
        "match 0, finish, meta",
        [CLAIMED, FREE, ()],
    ),
    (
        "refused, vLLM allocated nothing",
        BAD_PARAMS,
        "match 0, alloc 0, meta, finish",
        [CLAIMED, (), FREE],
    ),
    (
        "refused at the first ask, parked, announced once",
        NOT_A_FLAG,
        "match 0, match 0, alloc 40, meta, meta, match 0, finish",
        [CLAIMED, CLAIMED, ("d1",), (), NOTHING, FREE],
    ),
    (
        "refused at the first ask, finished before vLLM parked it",
        NOT_A_FLAG,
        "match 0, finish, meta",
        [CLAIMED, FREE, ()],
    ),
    (
        "claimed, then nothing left to load (a local prefix hit grew)",
        REMOTE_PARAMS,
        "match 16, match 40, meta, finish, meta, ranks fail",
        [(24, True), NOTHING, (), FREE, ()],
    ),
    (
        "finished after allocation, before its LoadSpec went out",
        REMOTE_PARAMS,
        "match 16, alloc 24, finish, meta, ranks fail",
        [(24, True), (True, None), ()],
    ),
    (
        "a load the ranks report is not echoed",
        REMOTE_PARAMS,
        "match 16, alloc 24, meta, ranks ok, meta, finish",
        [(24, True), (), (), FREE],
    ),
    (
        "claimed, its params cleared before allocation: nothing parked, nothing loads",
        REMOTE_PARAMS,
        "match 16, params none, match 16, alloc 0, meta, finish",
        [(24, True), NOTHING, (), FREE],
    ),
    (
        "claimed, its params changed to ask for no load, then parked: announced failed",
        REMOTE_PARAMS,
        "match 16, params other, alloc 24, meta, match 16, finish",
        [(24, True), ("d1",), NOTHING, FREE],
    ),
    (
        "claimed, finished unread",
        REMOTE_PARAMS,
        "match 16, finish",
        [(24, True), FREE],
    ),
    (
        "a load the ranks fail is not echoed",
        REMOTE_PARAMS,
        "match 16, alloc 24, meta, ranks fail, meta, finish",
        [(24, True), (), (), FREE],
    ),
]


@pytest.mark.parametrize(
    ("params", "path", "expected"), [c[1:] for c in PATHS], ids=[c[0] for c in PATHS]
)
def test_tracking_paths(params: dict[str, Any], path: str, expected: list[Any]) -> None:
    results, log = walk(params, path)
    assert results == expected
    assert not log.live, "a finished request is still tracked (its ranks answered)"


def test_the_paths_take_every_edge_out_of_a_claim_or_a_refusal() -> None:
    """The edges out of a claim or a refusal, each through the adapter (the rest of
    the table: tests/test_scheduler_lifecycles.py)."""
    taken = set().union(*(walk(params, path)[1].edges for _, params, path, _ in PATHS))
    every = {
        (current, target)
        for current, targets in REQUEST_LOAD_LIFECYCLE.moves.items()
        for target in targets
        if current in UNREAD_OR_REFUSED or target in UNREAD_OR_REFUSED
    }
    assert every - taken == set()


def test_a_decode_requests_params_are_parsed_once_at_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import scheduler.requests as requests_module

    parsed: list[object] = []
    real_parse = requests_module.parse_kv_transfer_params

    def counting_parse(raw: Any) -> Any:
        parsed.append(raw)
        return real_parse(raw)

    monkeypatch.setattr(requests_module, "parse_kv_transfer_params", counting_parse)
    results, _ = walk(REMOTE_PARAMS, "match 16, match 16")
    assert results == [(24, True)] * 2 and parsed == [], "asking twice read no params"
    results, _ = walk(REMOTE_PARAMS, "match 16, match 16, alloc 24, meta, ranks ok, finish")
    assert results == [(24, True)] * 2 + [(), FREE]
    assert parsed == [REMOTE_PARAMS], "read once, at allocation, and kept to the finish"
