"""READs by index from prepared lists: byte-exact against the oracle, and the rule that picks them.

The property test forces the index path wherever a pairing allows it (full segments by index,
partial ones as byte ranges in a second READ) and executes it on FakeNixl, which really copies
bytes; decode memory must equal the oracle's and what the range path lands.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from connector.geometry import build_rank_layout
from connector.layout import (
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
    RankLayout,
)
from tests import oracle
from tests.test_planner_properties import Case, cases, padded
from worker.fake import FakeFabric, FakeNixl
from worker.nixl_api import NixlAgent, TransferState
from worker.plan.exact_runs import ByteRuns, exact_runs
from worker.plan.recipe import ReadPath, TransferRequest, peer_plan, plan_request
from worker.plan.segments import cut_segments
from worker.plan.whole_blocks import choose_prepared, indexed_request, prepared_rows, split_request

_names = itertools.count()


def _agent(fabric: FakeFabric, buffers: oracle.Buffers) -> tuple[FakeNixl, list[int]]:
    agent = FakeNixl(f"agent-{next(_names)}", fabric)
    addresses = [int(b.ctypes.data) for b in buffers]
    agent.register_regions([(a, len(b)) for a, b in zip(addresses, buffers, strict=True)])
    return agent, addresses


def _run(agent: NixlAgent, transfer: object) -> None:
    state = agent.post(transfer)
    while state is TransferState.IN_PROGRESS:
        state = agent.check(transfer)
    agent.release(transfer)


def _range_read(
    agent: NixlAgent, remote: str, runs: ByteRuns, local: list[int], remote_at: list[int]
) -> None:
    def rows(addresses: list[int], regions: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        bases = np.asarray(addresses, dtype=np.int64)[regions]
        return np.column_stack([bases + offsets, runs.lengths, np.zeros_like(offsets)])

    _run(
        agent,
        agent.make_read(
            remote,
            rows(local, runs.local_regions, runs.local_offsets),
            rows(remote_at, runs.remote_regions, runs.remote_offsets),
        ),
    )


def _request(case: Case) -> TransferRequest:
    r = case.request
    return TransferRequest(r.local_block_ids, r.remote_block_ids, r.num_tokens, r.num_cached_tokens)


def _land(
    path: ReadPath,
    case: Case,
    fabric: FakeFabric,
    owners: list[tuple[FakeNixl, list[int]]],
    prefill: RankLayout,
    local: RankLayout,
) -> tuple[oracle.Buffers, int]:
    """A decode rank's memory after executing plan_request's READs (along ``path``) on
    FakeNixl, from sentinel buffers; and how many READs went by index."""
    buffers = oracle.sentinel(local)
    agent, addresses = _agent(fabric, buffers)
    for owner, _ in owners:
        agent.add_remote_agent(owner.get_agent_metadata())
    remote = {rank: (owner_addresses, 0) for rank, (_, owner_addresses) in enumerate(owners)}
    peer = peer_plan(local, prefill, local_addresses=addresses, remote_addresses=remote)
    by_index = 0
    for plan in plan_request(peer, _request(case), path).reads:
        owner, owner_addresses = owners[plan.remote_rank]
        if plan.by_index is not None:
            rows = peer.rows[plan.remote_rank]
            _run(agent, agent.make_prepped_read(
                agent.prepare_list(None, rows.local_rows), plan.by_index.local_indices,
                agent.prepare_list(owner.name, rows.remote_rows), plan.by_index.remote_indices,
            ))  # fmt: skip
            by_index += 1
        if plan.ranges is not None:
            _range_read(agent, owner.name, plan.ranges, addresses, owner_addresses)
    return buffers, by_index


def _prefill_ranks(
    case: Case, fabric: FakeFabric
) -> tuple[list[RankLayout], list[oracle.Buffers], list[tuple[FakeNixl, list[int]]]]:
    """Each prefill rank's layout, its buffers filled by the oracle, and an agent over them."""
    prefill = [build_rank_layout(case.prefill, r, case.prefill_tp) for r in range(case.prefill_tp)]
    memory = [oracle.fill_prefill(layout, case.request, seed=r) for r, layout in enumerate(prefill)]
    return prefill, memory, [_agent(fabric, buffers) for buffers in memory]


def _check_case(case: Case) -> None:
    """By index wherever a pairing allows it: the oracle's bytes, and what the exact planner
    alone lands (executed by the oracle, no prepared rows)."""
    fabric = FakeFabric()
    request = case.request
    prefill, memory, owners = _prefill_ranks(case, fabric)
    for decode_rank in range(case.decode_tp):
        local = build_rank_layout(case.decode, decode_rank, case.decode_tp)
        actual, by_index = _land(ReadPath.BY_INDEX, case, fabric, owners, prefill[0], local)
        event(f"READs by index: {min(by_index, 2)}")
        expected = oracle.expected_decode(local, request)
        difference = oracle.first_difference(actual, expected)
        assert difference is None, f"decode rank {decode_rank}: {difference}"
        by_ranges = oracle.sentinel(local)
        plan = plan_request(peer_plan(local, prefill[0]), _request(case))
        oracle.execute(plan, by_ranges, dict(enumerate(memory)))
        assert oracle.first_difference(actual, by_ranges) is None


PATHS = {
    "by index (partial segments as ranges)": ReadPath.BY_INDEX,
    "by byte ranges (whole blocks from the prepared rows)": ReadPath.BY_RANGES,
    "as choose_prepared picks": ReadPath.CHEAPER,
    "exact planner only": ReadPath.EXACT,
}


@settings(max_examples=150, deadline=None)
@given(cases())
def test_every_path_of_plan_request_lands_the_oracles_bytes(case: Case) -> None:
    fabric = FakeFabric()
    request = case.request
    # The agents know prefill's memory by address only: it must outlive every READ.
    prefill, memory, owners = _prefill_ranks(case, fabric)
    for decode_rank in range(case.decode_tp):
        local = build_rank_layout(case.decode, decode_rank, case.decode_tp)
        expected = oracle.expected_decode(local, request)
        for name, path in PATHS.items():
            actual, _ = _land(path, case, fabric, owners, prefill[0], local)
            difference = oracle.first_difference(actual, expected)
            assert difference is None, f"decode rank {decode_rank}, {name}: {difference}"
    assert len(memory) == case.prefill_tp  # held until here


def _mixed_spec(num_blocks: int = 32) -> KVCacheSpec:
    """Decode TP 2 of a layer with 4 KV heads (each rank reads half a prefill block: its rows
    do not join) and one with a single, replicated head (whole blocks: its rows join)."""
    layers = (
        LayerSpec(name="wide", num_kv_heads=4, head_dim=2, dtype_bytes=2),
        LayerSpec(name="narrow", num_kv_heads=1, head_dim=2, dtype_bytes=2),
    )
    group = GroupSpec(
        kind=GroupKind.FULL, block_size=4, kernel_block_size=4, num_blocks=num_blocks,
        layers=layers,
    )  # fmt: skip
    return KVCacheSpec("m", "bf16", "bf16", (group,), MemoryLayout.HND)


MIXED = {  # (decode block ids, prefill block ids, tokens): contiguous runs and scattered ids
    "runs of blocks, partial last block": ((3, 4, 5, 9, 10), (0, 1, 2, 20, 21), 18),
    "scattered ids, whole blocks": ((7, 2, 30, 11), (5, 6, 1, 0), 16),
}


@pytest.mark.parametrize(
    ("local_ids", "remote_ids", "num_tokens"), MIXED.values(), ids=MIXED.keys()
)
def test_rows_that_join_and_rows_that_do_not_in_one_group(
    local_ids: tuple[int, ...], remote_ids: tuple[int, ...], num_tokens: int
) -> None:
    spec = _mixed_spec()
    request = oracle.Request(num_tokens, 0, (local_ids,), (remote_ids,))
    case = Case(spec, spec, 1, 2, request)
    fabric = FakeFabric()
    prefill = build_rank_layout(spec, 0, 1)
    memory = oracle.fill_prefill(prefill, request, seed=0)  # held: the agent keeps addresses
    owners = [_agent(fabric, memory)]
    for decode_rank in range(2):
        local = build_rank_layout(spec, decode_rank, 2)
        planner = peer_plan(local, prefill)
        rows = prepared_rows(
            planner.groups, 0, local_addresses=[1] * len(local.region_bytes), local_device=0,
            remote_addresses=[1] * len(prefill.region_bytes), remote_device=0,
        )  # fmt: skip
        assert rows is not None and 0 < rows.groups[0].num_joining < rows.groups[0].num_rows
        expected = oracle.expected_decode(local, request)
        for name, path in PATHS.items():
            actual, _ = _land(path, case, fabric, owners, prefill, local)
            difference = oracle.first_difference(actual, expected)
            assert difference is None, f"decode rank {decode_rank}, {name}: {difference}"


@settings(max_examples=200, deadline=None)
@given(cases())
def test_reads_by_index_land_the_oracles_bytes_and_the_range_paths(case: Case) -> None:
    _check_case(case)


@settings(max_examples=60, deadline=None)
@given(cases(opaque=True))
def test_opaque_blocks_by_index_land_the_oracles_bytes(case: Case) -> None:
    _check_case(case)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_padded_pages_by_index_land_the_oracles_bytes(data: st.DataObject) -> None:
    """Prepared rows stride a padded page per block and carry its content only: a state or a
    block by index lands exactly the oracle's bytes, each side padded its own way."""
    case = data.draw(cases(opaque=data.draw(st.booleans())))
    prefill = data.draw(padded(case.prefill, case.prefill_tp))
    decode = data.draw(padded(case.decode, case.decode_tp))
    _check_case(Case(prefill, decode, case.prefill_tp, case.decode_tp, case.request))


# --- which pairings can be prepared ----------------------------------------------------------


def _spec(memory_layout: MemoryLayout, kernel: int = 4, heads: int = 4) -> KVCacheSpec:
    layer = LayerSpec(name="l", num_kv_heads=heads, head_dim=2, dtype_bytes=2)
    group = GroupSpec(
        kind=GroupKind.FULL, block_size=8, kernel_block_size=kernel, num_blocks=16,
        layers=(layer, layer),
    )  # fmt: skip
    return KVCacheSpec(
        model="m", dtype="bf16", cache_dtype="bf16", groups=(group,), memory_layout=memory_layout
    )


# (decode spec, decode TP, prefill spec, prefill TP, preparable)
PAIRINGS = {
    "NHD, all heads": (_spec(MemoryLayout.NHD), 1, _spec(MemoryLayout.NHD), 1, True),
    "HND, a head slice (decode TP2 <- TP1)": (
        _spec(MemoryLayout.HND), 2, _spec(MemoryLayout.HND), 1, True,
    ),
    "NHD packed K|V, all heads": (
        _spec(MemoryLayout.NHD_PACKED), 1, _spec(MemoryLayout.NHD_PACKED), 1, True,
    ),
    "NHD, a head slice: a block is one run per token": (
        _spec(MemoryLayout.NHD), 2, _spec(MemoryLayout.NHD), 1, False,
    ),
    "kernel blocks of different sizes": (
        _spec(MemoryLayout.NHD, kernel=4), 1, _spec(MemoryLayout.NHD, kernel=8), 1, False,
    ),
    "NHD <- HND: a block is one run per (token, head)": (
        _spec(MemoryLayout.NHD), 1, _spec(MemoryLayout.HND), 1, False,
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("decode", "decode_tp", "prefill", "prefill_tp", "preparable"),
    PAIRINGS.values(),
    ids=PAIRINGS.keys(),
)
def test_pairings_that_can_be_read_by_whole_block_index(
    decode: KVCacheSpec, decode_tp: int, prefill: KVCacheSpec, prefill_tp: int, preparable: bool
) -> None:
    local = build_rank_layout(decode, 0, decode_tp)
    remote = build_rank_layout(prefill, 0, prefill_tp)
    planner = peer_plan(local, remote)
    rows = prepared_rows(
        planner.groups, 0, local_addresses=[1 << 20] * len(local.region_bytes), local_device=0,
        remote_addresses=[1 << 30] * len(remote.region_bytes), remote_device=0,
    )  # fmt: skip
    assert (rows is not None) == preparable
    if rows is not None:  # one strided row per plane per side, whatever the pool size
        fused = decode.memory_layout is MemoryLayout.NHD_PACKED  # K|V read as one plane
        num_planes = 2 if fused else 2 * 2
        assert rows.local_rows.shape == rows.remote_rows.shape == (num_planes, 5)


RULE = {  # (indices, estimated byte ranges, partial segments) -> by index?
    "nothing whole to index": ((0, 0, True), False),
    "2k contiguous, whole blocks: 8,192 indices, 64 ranges": ((8192, 64, False), True),
    "2k contiguous and a partial block: ranges, one READ": ((8192, 64, True), False),
    "32k contiguous: 131,072 indices, 64 ranges": ((131072, 64, False), False),
    "2k fragmented and a partial block": ((8192, 8192, True), True),
    "32k fragmented: 131,072 indices, as many ranges": ((131072, 131072, True), True),
    "short, whole blocks only": ((64, 64, False), True),
    "short with a partial block: ranges, one READ": ((16, 8, True), False),
}


@pytest.mark.parametrize(("inputs", "by_index"), RULE.values(), ids=RULE.keys())
def test_the_rule_reads_by_index_when_that_is_cheaper(
    inputs: tuple[int, int, bool], by_index: bool
) -> None:
    assert choose_prepared(*inputs) is by_index


def test_a_partial_last_block_is_left_to_byte_ranges() -> None:
    layout = build_rank_layout(_spec(MemoryLayout.NHD), 0, 1)
    planner = peer_plan(layout, layout)
    rows = prepared_rows(
        planner.groups, 0, local_addresses=[1 << 20, 1 << 21], local_device=0,
        remote_addresses=[1 << 30, 1 << 31], remote_device=0,
    )  # fmt: skip
    assert rows is not None
    segments = cut_segments(
        planner.groups, ((3, 5),), ((7, 9),), num_tokens=14, num_cached_tokens=0
    )
    request = indexed_request(split_request(rows, segments))
    # Kernel blocks of 4 tokens, 32 per plane: tokens [0, 12) are 3 whole kernel blocks per
    # plane (decode 6, 7, 10), the partial [12, 14) is one range per plane.
    assert request.local_indices.tolist() == [6, 7, 10, 38, 39, 42, 70, 71, 74, 102, 103, 106]
    tail = exact_runs(planner.groups, segments, 0, request.partial)
    assert tail is not None and len(tail) == 4
    # So short a request is cheaper as one READ of byte ranges: the rule keeps it whole.
    addresses = {0: ([1 << 30, 1 << 31], 0)}
    peer = peer_plan(layout, layout, local_addresses=[1 << 20, 1 << 21], remote_addresses=addresses)
    (plan,) = plan_request(peer, TransferRequest(((3, 5),), ((7, 9),), 14, 0)).reads
    assert plan.by_index is None and plan.num_reads == 1
