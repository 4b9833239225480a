"""Leases bound to their blocks: a load succeeds only reading exactly the blocks its lease holds.

Unit level: the digest, and the lease table's verdict on every edit of a reader's blocks
(hypothesis), exact-only reads of a lease with a state group, refs that do not say what they
read. Through the scheduler connector: no unbound lease (a hold offers only tokens with ids
and final KV). End to end on the example engine (FakeNixl, in process), both directions:
params whose ``remote_block_ids`` are another request's fail with ``blocks mismatch``, with
and without the check before the READs; the controls load.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.lease_binding import HeldBlocks, HeldTokens, block_digest, token_digest
from connector.protocol import (
    REFUSED_BLOCKS,
    REFUSED_TOKENS,
    BlockDigest,
    LeaseRef,
    LeaseStatus,
    TokenDigest,
)
from examples.engine import Engine, EngineRequest, RequestOutput
from scheduler.connector import RequestInfo, Role, SchedulerConnector
from scheduler.leases import LeaseTable
from tests.scheduler_helpers import (
    CONFIG,
    DENSE,
    HYBRID,
    FakeClock,
    RecordingHeartbeats,
    all_ranks,
    bound_ref,
    decode_request,
    handshakes,
    prompt_ids,
    start_load,
)
from tests.test_token_binding import CountingNixl, drain, example_engines, run_until_output

# ---- the digest ------------------------------------------------------------------------


def test_the_digest_is_blake2b_64_over_the_counts_and_the_int64_ids() -> None:
    expected = hashlib.blake2b(
        struct.pack("<QQ", 20, 2) + struct.pack("<Q2q", 2, 3, 4) + struct.pack("<Qq", 1, 9),
        digest_size=8,
    ).digest()
    assert block_digest(((3, 4), (9,)), 20) == BlockDigest(20, int.from_bytes(expected, "little"))


def test_moving_a_block_between_groups_digests_otherwise() -> None:
    assert block_digest(((3, 4), (9,)), 20) != block_digest(((3,), (4, 9)), 20)
    assert block_digest(((3, 4),), 20) != block_digest(((3, 4), ()), 20)


# ---- the lease table's verdict ------------------------------------------------------------

HELD_IDS = prompt_ids(64)
groups_st = st.lists(
    st.lists(st.integers(0, 2**40), min_size=1, max_size=6), min_size=1, max_size=3
).map(lambda groups: tuple(tuple(group) for group in groups))


def _lease(block_ids: tuple[tuple[int, ...], ...], num_tokens: int, *, exact: bool) -> LeaseTable:
    table = LeaseTable(10.0)
    tokens = HeldTokens.of(HELD_IDS, num_tokens)
    table.lease(
        "p1", 0.0, "L1", tokens=tokens, blocks=HeldBlocks(block_ids, num_tokens, exact=exact)
    )
    return table


def _read(block_ids: Any, num_remote: int, num_read: int | None = None) -> LeaseRef:
    """The ref of a reader reading ``num_read`` tokens (default: all) of ``block_ids``,
    assumed to hold ``num_remote``."""
    num_read = num_remote if num_read is None else num_read
    return LeaseRef(
        "p1", "L1", (), token_digest(HELD_IDS, num_read), block_digest(block_ids, num_remote)
    )


EDITS = ("swap-groups", "one-id-changed", "dropped-block", "added-block", "other-token-count")


def _edited(
    block_ids: tuple[tuple[int, ...], ...], num_tokens: int, edit: str, data: st.DataObject
) -> tuple[Any, int]:
    """``block_ids`` and ``num_tokens`` with one edit a router or client could make."""
    groups = [list(group) for group in block_ids]
    g = data.draw(st.integers(0, len(groups) - 1))
    if edit == "swap-groups":
        other = data.draw(st.integers(0, len(groups) - 1))
        groups[g], groups[other] = groups[other], groups[g]
    elif edit == "one-id-changed":
        i = data.draw(st.integers(0, len(groups[g]) - 1))
        groups[g][i] = data.draw(st.integers(0, 2**40).filter(lambda new: new != groups[g][i]))
    elif edit == "dropped-block":
        del groups[g][data.draw(st.integers(0, len(groups[g]) - 1))]
    elif edit == "added-block":
        groups[g].insert(data.draw(st.integers(0, len(groups[g]))), data.draw(st.integers(0, 99)))
    else:
        num_tokens = data.draw(st.integers(1, 64).filter(lambda n: n != num_tokens))
    return groups, num_tokens


@given(
    block_ids=groups_st,
    num_tokens=st.integers(1, 64),
    exact=st.booleans(),
    edit=st.sampled_from(EDITS),
    data=st.data(),
)
def test_a_reader_of_other_blocks_or_another_count_is_refused(
    block_ids: tuple[tuple[int, ...], ...], num_tokens: int, exact: bool, edit: str,
    data: st.DataObject,
) -> None:  # fmt: skip
    edited, num_edited = _edited(block_ids, num_tokens, edit, data)
    table = _lease(block_ids, num_tokens, exact=exact)
    status = table.check(
        [_read(edited, num_edited, min(num_edited, num_tokens)), _read(block_ids, num_tokens)], 1.0
    )
    if [list(group) for group in block_ids] == edited and num_edited == num_tokens:
        assert status == LeaseStatus((True, True))  # the edit changed nothing (a swap of equals)
        return
    assert status.held == (False, True)
    refusal = status.refused[0]
    assert refusal is not None and refusal.kind == REFUSED_BLOCKS and status.refused[1] is None
    if edit == "other-token-count":
        assert f"hold {num_tokens} tokens, the reader assumes {num_edited} " in refusal.reason
    else:
        assert "not the blocks the lease holds" in refusal.reason


@given(block_ids=groups_st, num_tokens=st.integers(2, 64), data=st.data())
def test_a_prefix_of_the_tokens_is_read_only_from_an_attention_only_lease(
    block_ids: tuple[tuple[int, ...], ...], num_tokens: int, data: st.DataObject
) -> None:
    num_read = data.draw(st.integers(1, num_tokens - 1))
    prefix = _read(block_ids, num_tokens, num_read)
    assert _lease(block_ids, num_tokens, exact=False).check([prefix], 1.0) == LeaseStatus((True,))
    status = _lease(block_ids, num_tokens, exact=True).check([prefix], 1.0)
    assert status.held == (False,)
    refusal = status.refused[0]
    assert refusal is not None and refusal.kind == REFUSED_TOKENS
    assert f"state after exactly {num_tokens} tokens, the reader reads {num_read}" in refusal.reason
    whole = _read(block_ids, num_tokens)
    assert _lease(block_ids, num_tokens, exact=True).check([whole], 1.0) == LeaseStatus((True,))


def _grow(table: LeaseTable, block_ids: Any, num_tokens: int, lease_id: str = "L1", *,
          exact: bool = False) -> None:  # fmt: skip
    """Re-bind request p1's lease (chunked pulls: the next chunk, or request_finished)."""
    tokens = HeldTokens.of(HELD_IDS, num_tokens)
    table.lease(
        "p1", 0.5, lease_id, tokens=tokens, blocks=HeldBlocks(block_ids, num_tokens, exact=exact)
    )


@given(block_ids=groups_st, num_tokens=st.integers(2, 64), data=st.data())
def test_a_lease_grown_under_its_id_still_answers_readers_of_what_it_announced_before(
    block_ids: tuple[tuple[int, ...], ...], num_tokens: int, data: st.DataObject
) -> None:
    """Chunked pulls: the reader of a chunk whose lease check reaches prefill after the next
    chunk's announcement (or the prompt's end) re-bound the lease reads blocks it still holds
    (seen on real engines: such a good request failed `blocks mismatch`)."""
    earlier = tuple(group[: data.draw(st.integers(1, len(group)))] for group in block_ids)
    num_earlier = data.draw(st.integers(1, num_tokens))
    table = _lease(earlier, num_earlier, exact=False)
    _grow(table, block_ids, num_tokens)
    refs = [_read(earlier, num_earlier), _read(block_ids, num_tokens)]
    assert table.check(refs, 1.0) == LeaseStatus((True, True))
    # Grown twice: the first announcement still answers.
    longer = tuple((*group, 7) for group in block_ids)
    _grow(table, longer, 64)
    assert table.check([_read(earlier, num_earlier)], 1.0) == LeaseStatus((True,))


GROWTHS_THAT_KEEP_NOTHING = {
    "blocks-that-do-not-extend": (((9, 2, 3, 4),), 40, "L1", False),
    "an-exact-lease": (((1, 2, 3, 4),), 40, "L1", True),
    "another-lease-id": (((1, 2, 3, 4),), 40, "L2", False),
    "fewer-tokens": (((1, 2, 3, 4),), 16, "L1", False),
}


@pytest.mark.parametrize(
    ("grown", "num_tokens", "lease_id", "exact"),
    GROWTHS_THAT_KEEP_NOTHING.values(),
    ids=GROWTHS_THAT_KEEP_NOTHING,
)
def test_a_lease_re_bound_otherwise_refuses_readers_of_its_earlier_blocks(
    grown: Any, num_tokens: int, lease_id: str, exact: bool
) -> None:
    table = _lease(((1, 2, 3),), 24, exact=False)
    _grow(table, grown, num_tokens, lease_id, exact=exact)
    earlier_reader = LeaseRef(
        "p1", lease_id, (), token_digest(HELD_IDS, 24), block_digest(((1, 2, 3),), 24)
    )
    status = table.check([earlier_reader], 1.0)
    assert status.held == (False,)
    refusal = status.refused[0]
    assert refusal is not None and refusal.kind in (REFUSED_BLOCKS, REFUSED_TOKENS)


def test_a_grown_lease_refuses_a_reader_of_blocks_it_never_announced() -> None:
    table = _lease(((1, 2),), 32, exact=False)
    _grow(table, ((1, 2, 3, 4),), 64)
    for never in (_read(((1, 2, 3),), 48), _read(((1,),), 16), _read(((1, 2),), 24)):
        status = table.check([never], 1.0)
        assert status.held == (False,), never
        refusal = status.refused[0]
        assert refusal is not None and refusal.kind == REFUSED_BLOCKS


BLOCKS = ((1, 2, 3),)
REFS_THAT_DO_NOT_SAY = {
    "no-tokens": (
        LeaseRef("p1", "L1", (), None, block_digest(BLOCKS, 40)),
        REFUSED_TOKENS,
        "does not say which tokens it expects",
    ),
    "no-blocks": (
        LeaseRef("p1", "L1", (), token_digest(HELD_IDS, 40), None),
        REFUSED_BLOCKS,
        "does not say which blocks it reads",
    ),
    "neither": (LeaseRef("p1", "L1"), REFUSED_BLOCKS, "does not say which blocks it reads"),
}


@pytest.mark.parametrize(
    ("ref", "kind", "why"), REFS_THAT_DO_NOT_SAY.values(), ids=REFS_THAT_DO_NOT_SAY
)
def test_a_ref_that_does_not_say_what_it_reads_is_never_held(
    ref: LeaseRef, kind: str, why: str
) -> None:
    status = _lease(BLOCKS, 40, exact=False).check([ref], 1.0)
    assert status.held == (False,)
    refusal = status.refused[0]
    assert refusal is not None and refusal.kind == kind and why in refusal.reason


# ---- no unbound lease --------------------------------------------------------------------

MODE = msgspec.structs.replace(
    CONFIG,
    side_channel_port=0,
    bidirectional_kv_xfer=True,
    decoder_kv_blocks_ttl_s=100.0,
    kv_recompute_threshold=8,
)


def _connector(engine_id: str, role: Role, spec: Any = DENSE) -> SchedulerConnector:
    connector = SchedulerConnector(
        MODE, engine_id=engine_id, role=role, spec=spec, tp_size=2, clock=FakeClock(),
        heartbeat_sender=RecordingHeartbeats(),
    )  # fmt: skip
    connector.start_side_channel(handshakes(engine_id))
    return connector


def _status(params: dict[str, Any], refs: list[LeaseRef]) -> LeaseStatus:
    from connector.net.side_channel_client import check_leases_status

    return check_leases_status(
        params["remote_host"], params["remote_port"], refs,
        engine_id=params["remote_engine_id"], boot_id=params["remote_boot_id"], secret=None,
        timeout_s=5.0,
    )  # fmt: skip


def _loaded_decode() -> SchedulerConnector:
    """A decode engine in multi-turn mode whose request d1 loaded its prompt (40 tokens)."""
    decode = _connector("decode-0", Role.CONSUMER)
    start_load(decode)
    decode.update_connector_output(all_ranks(finished_recving=("d1",)))
    decode.take_finished()
    return decode


def _finished(num_computed_tokens: int, token_ids: list[int] | None) -> RequestInfo:
    params = decode_request().kv_transfer_params
    return RequestInfo("d1", 40, params, False, num_computed_tokens, token_ids)


def test_a_hold_offers_only_tokens_with_ids_and_final_kv() -> None:
    """vLLM's async scheduling with spec decode: num_computed_tokens (52) counts in-flight
    draft positions past the ids (45: prompt 40, answer 5, the last one sampled)."""
    decode = _loaded_decode()
    try:
        delay, params = decode.request_finished(_finished(52, prompt_ids(45)), ((10, 11, 12, 13),))
        assert delay is True and params is not None
        assert params["remote_num_tokens"] == 44 and params["remote_block_ids"] == [[10, 11, 12]]
        lease_id = params["remote_lease_id"]
        final = bound_ref("d1", lease_id, params, 44)
        drafts = LeaseRef(
            "d1", lease_id, (), TokenDigest(52, 0), block_digest(((10, 11, 12, 13),), 52)
        )
        status = _status(params, [final, drafts])
        assert status.held == (True, False)
        assert status.refused[1] is not None and status.refused[1].kind == REFUSED_BLOCKS
    finally:
        decode.shutdown()


def test_a_hold_without_ids_offers_nothing(caplog: pytest.LogCaptureFixture) -> None:
    decode = _loaded_decode()
    try:
        with caplog.at_level(logging.INFO):
            finished = decode.request_finished(_finished(48, None), ((10, 11, 12, 13),))
        assert finished == (False, None)
        assert "passed no token ids" in caplog.text
    finally:
        decode.shutdown()


@pytest.mark.parametrize(
    ("token_ids", "why"),
    [(None, "passed no token ids"), (prompt_ids(39), "passed 39 token ids for 40 tokens")],
    ids=["no-ids", "fewer-ids-than-tokens"],
)
def test_a_prefill_without_the_ids_offers_nothing(
    token_ids: list[int] | None, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    prefill = _connector("prefill-0", Role.PRODUCER)
    try:
        info = RequestInfo("p1", 40, {"do_remote_decode": True}, token_ids=token_ids)
        assert prefill.request_finished(info, ((1, 2, 3),)) == (False, None)
        assert why in caplog.text
    finally:
        prefill.shutdown()


def test_a_prefill_lease_of_a_model_with_a_state_group_is_read_only_whole() -> None:
    prefill = _connector("prefill-0", Role.PRODUCER, HYBRID)
    try:
        info = RequestInfo("p1", 40, {"do_remote_decode": True}, token_ids=prompt_ids(41))
        _, params = prefill.request_finished(info, ((1, 2, 3), (4,)))
        assert params is not None
        lease_id = params["remote_lease_id"]
        whole = bound_ref("p1", lease_id, params, 40)
        prefix = LeaseRef("p1", lease_id, (), token_digest(prompt_ids(39), 39), whole.blocks)
        status = _status(params, [whole, prefix])
        assert status.held == (True, False)
        assert (
            status.refused[1] is not None
            and "a state is read only whole" in status.refused[1].reason
        )
    finally:
        prefill.shutdown()


# ---- end to end on the example engine (FakeNixl) -----------------------------------------


def _engines(*, bidirectional: bool = False, precheck_skip_s: float = 0.0) -> tuple[Engine, Engine]:
    return example_engines("blk", bidirectional=bidirectional, precheck_skip_s=precheck_skip_s)


def _prefill(prefill: Engine, request_id: str, prompt: list[int]) -> RequestOutput:
    prefill.add_request(EngineRequest(request_id, prompt, 1, {"do_remote_decode": True}))
    first = run_until_output((prefill,), request_id)
    assert first.error is None and first.kv_transfer_params is not None
    return first


def _decoded(engines: tuple[Engine, Engine], request_id: str, prompt: list[int],
             first: RequestOutput, max_tokens: int = 3) -> RequestOutput:  # fmt: skip
    engines[1].add_request(
        EngineRequest(request_id, prompt + first.token_ids, max_tokens, first.kv_transfer_params)
    )
    return run_until_output(engines, request_id)


def _prompt(seed: int, num_tokens: int = 40) -> list[int]:
    return [(seed * t + 1) % 64 for t in range(num_tokens)]


@pytest.mark.parametrize(
    ("precheck_skip_s", "num_reads"), [(0.0, 0), (60.0, 1)],
    ids=["checked-before-the-reads", "reads-first-the-proof-fails"],
)  # fmt: skip
def test_decode_given_another_requests_blocks_fails_with_blocks_mismatch(
    precheck_skip_s: float, num_reads: int
) -> None:
    engines = _engines(precheck_skip_s=precheck_skip_s)
    prefill, decode = engines
    try:
        a_prompt, b_prompt = _prompt(3), _prompt(5)
        control = _decoded(engines, "d0", a_prompt, _prefill(prefill, "p0", a_prompt))
        assert control.error is None and control.num_external_tokens == 40  # side channel heard
        a, b = _prefill(prefill, "pa", a_prompt), _prefill(prefill, "pb", b_prompt)
        assert a.kv_transfer_params is not None and b.kv_transfer_params is not None
        swapped = {
            **a.kv_transfer_params,
            "remote_block_ids": b.kv_transfer_params["remote_block_ids"],
        }
        assert swapped["remote_block_ids"] != a.kv_transfer_params["remote_block_ids"]
        CountingNixl.num_posted = 0
        failed = _decoded(
            engines, "da", a_prompt, RequestOutput("pa", a.token_ids, kv_transfer_params=swapped)
        )
        assert failed.error is not None and failed.token_ids == []
        reason = failed.error.removeprefix("KV load failed: ")
        assert reason.startswith("blocks mismatch: prefill engine 'prefill-blk' request 'pa'")
        assert "not the blocks the lease holds" in reason
        assert failed.error_kind == "blocks_mismatch"
        assert (CountingNixl.num_posted > 0) == bool(num_reads)
        # B's own params still load: the refusal ended nothing of B's lease.
        good = _decoded(engines, "db", b_prompt, b)
        assert good.error is None and good.num_external_tokens == 40
        drain(engines)
        assert (prefill.num_leaked_blocks, decode.num_leaked_blocks) == (0, 0)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_next_turn_given_another_conversations_blocks_does_not_pull_them() -> None:
    engines = _engines(bidirectional=True)
    prefill, decode = engines
    try:
        held: dict[str, dict[str, Any]] = {}
        histories: dict[str, list[int]] = {}
        for conversation, seed in (("c1", 3), ("c2", 5)):
            prompt = _prompt(seed)
            first = _prefill(prefill, f"{conversation}-p1", prompt)
            turn1 = _decoded(engines, f"{conversation}-t1", prompt, first, 6)
            assert turn1.error is None and turn1.kv_transfer_params is not None
            held[conversation] = turn1.kv_transfer_params
            histories[conversation] = prompt + first.token_ids + turn1.token_ids
        assert held["c1"]["remote_num_tokens"] == held["c2"]["remote_num_tokens"]
        swapped = {**held["c1"], "remote_block_ids": held["c2"]["remote_block_ids"]}
        CountingNixl.num_posted = 0
        prefill.add_request(EngineRequest("c1-t2", histories["c1"] + [9] * 12, 1, swapped))
        failed = run_until_output(engines, "c1-t2")
        assert failed.error is not None
        reason = failed.error.removeprefix("KV load failed: ")
        assert reason.startswith("blocks mismatch: prefill engine 'decode-blk' request 'c1-t1'")
        assert CountingNixl.num_posted == 0
        # The control: c2's next turn with its own params pulls its history.
        prefill.add_request(EngineRequest("c2-t2", histories["c2"] + [9] * 12, 1, held["c2"]))
        pulled = run_until_output(engines, "c2-t2")
        assert pulled.error is None and pulled.num_external_tokens > 0
        assert CountingNixl.num_posted > 0
    finally:
        prefill.shutdown()
        decode.shutdown()
