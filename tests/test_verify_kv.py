"""verify_kv: decode's digest claims match prefill's digests exactly when the bytes are right.

Property tests against the byte-level oracle (tests/oracle.py): random pairings of block
sizes, kernel splits, memory layouts, TP sizes, prefix hits and block formats. Prefill's memory
holds the true KV in its leased blocks and noise elsewhere; decode's memory holds what the
planner's READs brought. Every decode rank's claims must match the prefill ranks' digests, and
one wrong byte among those decode read must not. Then end to end through the example engines
on FakeNixl: the demo's whole matrix passes with verify_kv on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from connector.errors import UnsupportedConfiguration
from connector.geometry import build_rank_layout
from connector.layout import GroupKind
from connector.protocol import DIGEST_OK, DIGEST_PENDING
from examples.demo import run_demo
from scheduler.digests import verify_claims
from tests import oracle
from tests.test_e2e_fake import CASES, options_for
from tests.test_planner_properties import Case, cases
from worker.kv_digest import check_digestible, lease_digests, read_claims
from worker.plan.recipe import TransferRequest, peer_plan, plan_request


def _transfer(case: Case) -> tuple[dict[int, Any], list[tuple[Any, list[Any]]]]:
    """Prefill ranks' digests, and each decode rank's (layout, memory after the READs)."""
    request = case.request
    prefill = [build_rank_layout(case.prefill, r, case.prefill_tp) for r in range(case.prefill_tp)]
    memory = {r: oracle.fill_prefill(layout, request, seed=r) for r, layout in enumerate(prefill)}
    digests = {
        r: lease_digests(layout, memory[r], request.remote_block_ids, request.num_tokens)
        for r, layout in enumerate(prefill)
    }
    decoded = []
    for rank in range(case.decode_tp):
        local = build_rank_layout(case.decode, rank, case.decode_tp)
        plan = plan_request(
            peer_plan(local, prefill[0]),
            TransferRequest(
                request.local_block_ids,
                request.remote_block_ids,
                num_tokens=request.num_tokens,
                num_cached_tokens=request.num_cached_tokens,
            ),
        )
        buffers = oracle.sentinel(local)
        oracle.execute(plan, buffers, memory)
        decoded.append((local, buffers))
    return digests, decoded


def _claims(case: Case, layout: Any, buffers: Any) -> Any:
    request = case.request
    return read_claims(
        layout, buffers, request.local_block_ids, request.num_cached_tokens, request.num_tokens
    )


def _digestible(case: Case) -> bool:
    """What verify_kv digests: one head set per group on every rank."""
    sides = ((case.prefill, case.prefill_tp), (case.decode, case.decode_tp))
    try:
        for spec, tp_size in sides:
            for rank in range(tp_size):
                check_digestible(build_rank_layout(spec, rank, tp_size))
    except UnsupportedConfiguration:
        return False
    return True


def assert_one_wrong_read_byte_is_caught(
    case: Case, digests: dict[int, Any], decoded: list[Any], data: st.DataObject
) -> None:
    # A byte decode READ: where its memory differs from the sentinel it started from.
    read = [
        (rank, region, int(offset))
        for rank, (layout, buffers) in enumerate(decoded)
        for region, expected in enumerate(oracle.sentinel(layout))
        for offset in np.flatnonzero(buffers[region] != expected)
    ]
    assume(read)
    rank, region, offset = data.draw(st.sampled_from(read))
    layout, buffers = decoded[rank]
    buffers[region][offset] ^= data.draw(st.integers(1, 255))
    verdict = verify_claims(_claims(case, layout, buffers), digests, case.prefill_tp)
    assert verdict.startswith("digest mismatch"), verdict


@settings(max_examples=200, deadline=None)
@given(cases())
def test_the_bytes_read_match_prefills_digests(case: Case) -> None:
    assume(_digestible(case))
    digests, decoded = _transfer(case)
    for layout, buffers in decoded:
        claims = _claims(case, layout, buffers)
        assert verify_claims(claims, digests, case.prefill_tp) == DIGEST_OK


@settings(max_examples=100, deadline=None)
@given(cases(opaque=True))
def test_opaque_blocks_read_whole_match_prefills_digests(case: Case) -> None:
    assume(_digestible(case))
    digests, decoded = _transfer(case)
    for layout, buffers in decoded:
        assert verify_claims(_claims(case, layout, buffers), digests, case.prefill_tp) == DIGEST_OK


@settings(max_examples=150, deadline=None)
@given(cases(), st.data())
def test_one_wrong_byte_that_was_read_is_caught(case: Case, data: st.DataObject) -> None:
    assume(_digestible(case))
    digests, decoded = _transfer(case)
    assert_one_wrong_read_byte_is_caught(case, digests, decoded, data)


def test_a_rank_that_has_not_reported_yet_is_pending_not_a_mismatch() -> None:
    case = _dense_case(prefill_tp=2, decode_tp=1)
    digests, decoded = _transfer(case)
    layout, buffers = decoded[0]
    claims = _claims(case, layout, buffers)
    assert verify_claims(claims, {0: digests[0]}, num_ranks=2) == DIGEST_PENDING
    assert verify_claims(claims, digests, num_ranks=2) == DIGEST_OK


def _hybrid_case(prefill_pad: int | None, decode_pad: int | None) -> Case:
    """A state group (one 48-byte state per request, pages padded per side) and attention."""
    from connector.layout import GroupSpec, KVCacheSpec, LayerSpec, MemoryLayout

    state = LayerSpec("s0", num_kv_heads=1, head_dim=48, dtype_bytes=1, num_planes=1)
    attention = LayerSpec("a0", num_kv_heads=2, head_dim=4, dtype_bytes=2)

    def spec(pad: int | None) -> KVCacheSpec:
        ssm = GroupSpec(
            GroupKind.SSM, 4, 4, 16, (state,), page_stride_bytes=None if pad is None else 48 + pad
        )
        full = GroupSpec(GroupKind.FULL, 4, 4, 16, (attention,))
        return KVCacheSpec("m", "bf16", "bf16", (ssm, full), MemoryLayout.HND_PACKED)

    # Prefill's state is in its last block (the first is a placeholder); decode loads it into
    # its one state block.
    request = oracle.Request(10, 0, ((9,), (3, 5, 7)), ((0, 11), (2, 4, 6)))
    return Case(spec(prefill_pad), spec(decode_pad), 1, 1, request)


@pytest.mark.parametrize(
    ("prefill_pad", "decode_pad"),
    [(None, None), (80, 80), (80, None), (None, 16), (16, 208)],
    ids=["dense", "same-padding", "prefill-padded", "decode-padded", "different-padding"],
)
def test_ssm_state_is_digested_without_its_padding(prefill_pad: Any, decode_pad: Any) -> None:
    case = _hybrid_case(prefill_pad, decode_pad)
    digests, [(layout, buffers)] = _transfer(case)
    state = layout.groups[0].planes[0]
    state_at = state.offset_bytes + 9 * state.kernel_block_stride_bytes  # decode's block 9
    assert verify_claims(_claims(case, layout, buffers), digests, 1) == DIGEST_OK

    if decode_pad:  # a padding byte is no part of the state: nobody reads it
        buffers[state.region][state_at + 48] ^= 0xFF
        assert verify_claims(_claims(case, layout, buffers), digests, 1) == DIGEST_OK
    buffers[state.region][state_at + 47] ^= 0x01  # the state's last byte
    verdict = verify_claims(_claims(case, layout, buffers), digests, 1)
    assert verdict.startswith("digest mismatch in group 0"), verdict


def _dense_case(prefill_tp: int, decode_tp: int, kind: GroupKind = GroupKind.FULL) -> Case:
    from connector.layout import GroupSpec, KVCacheSpec, LayerSpec

    layer = LayerSpec("l0", num_kv_heads=4, head_dim=4, dtype_bytes=2)
    group = GroupSpec(kind, block_size=4, kernel_block_size=4, num_blocks=16, layers=(layer,))
    spec = KVCacheSpec("m", "bf16", "bf16", (group,))
    request = oracle.Request(10, 0, ((3, 5, 7),), ((2, 4, 6),))
    return Case(spec, spec, prefill_tp, decode_tp, request)


@pytest.mark.parametrize("row", list(CASES.values()), ids=list(CASES))
def test_the_demo_matrix_passes_with_verify_kv_on(row: tuple[str, ...]) -> None:
    import msgspec

    result = run_demo(msgspec.structs.replace(options_for(row), verify_kv=True))
    assert result.errors == []
    assert result.failed_requests == 0
    assert result.tokens_match and result.kv_match


@settings(max_examples=100, deadline=None)
@given(cases(fp8=True), st.data())
def test_fp8_bytes_read_match_and_one_wrong_byte_is_caught(case: Case, data: st.DataObject) -> None:
    """FP8 pages (one byte per element, heads of 1-3 bytes: digested byte-wise, not as words):
    what decode read matches prefill's digests, and one flipped byte of it does not."""
    assume(_digestible(case))
    digests, decoded = _transfer(case)
    for layout, buffers in decoded:
        assert verify_claims(_claims(case, layout, buffers), digests, case.prefill_tp) == DIGEST_OK
    assert_one_wrong_read_byte_is_caught(case, digests, decoded, data)
