"""Leases bound to tokens: params paired with another prompt fail the load before any READ.

Unit level: the digest, the wire structs, the lease table's comparison. End to end on the
example engine (FakeNixl, in process), both directions: decode given prefill's params with
another prompt, and a next turn's prefill whose history the client edited, each fail with
``tokens mismatch`` before posting a READ, and the engines keep serving.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.config import ConnectorConfig
from connector.lease_binding import (
    HeldTokens,
    block_digest,
    pack_tokens,
    token_digest,
    tokens_verdict,
)
from connector.net.side_channel_client import check_leases_status
from connector.protocol import (
    REFUSED_TOKENS,
    LeaseCheck,
    LeaseRef,
    LeaseStatus,
    ReaderId,
    Refusal,
    TokenDigest,
    decode_request_payload,
)
from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from scheduler.connector import RequestInfo, Role, SchedulerConnector
from scheduler.leases import LeaseTable
from tests.scheduler_helpers import (
    CONFIG,
    DENSE,
    FakeClock,
    RecordingHeartbeats,
    decode_request,
    handshakes,
    start_load,
)
from worker.fake import FakeFabric, FakeNixl, FakeRead
from worker.loads import checked_source
from worker.nixl_api import TransferState

# ---- the digest ------------------------------------------------------------------------


def test_the_digest_is_blake2b_64_over_the_count_and_the_int32_ids() -> None:
    ids = [5, 7, 151_000]
    expected = hashlib.blake2b(
        struct.pack("<Q", 3) + struct.pack("<3i", *ids), digest_size=8
    ).digest()
    assert token_digest(ids, 3) == TokenDigest(3, int.from_bytes(expected, "little"))


def test_a_prefix_digests_like_the_prefix_and_never_like_the_whole() -> None:
    ids = list(range(100, 164))
    assert token_digest(ids, 32) == token_digest(ids[:32], 32)
    assert token_digest(ids, 32) != token_digest(ids, 64)
    assert token_digest([1, 2, 3], 3) != token_digest([1, 2, 4], 3)


@pytest.mark.parametrize(
    "ids, num_tokens",
    [([1, 2], 3), ([], 1), ([1, 2], 0), ([2**31], 1), ([-(2**31) - 1], 1)],
    ids=["fewer-ids-than-tokens", "no-ids", "no-tokens", "id-over-int32", "id-under-int32"],
)
def test_nothing_is_bound_when_the_ids_cannot_say(ids: list[int], num_tokens: int) -> None:
    assert pack_tokens(ids, num_tokens) is None
    assert token_digest(ids, num_tokens) is None
    assert token_digest(None, 4) is None


HELD = list(range(1000, 1048))
VERDICTS = {
    "the-same-tokens": (HELD, 48, ""),
    "a-prefix-of-them": (HELD[:30], 30, ""),
    "one-token-edited": (
        [*HELD[:10], 7, *HELD[11:]],
        48,
        "other tokens than the reader's first 48",
    ),
    "more-than-the-lease-holds": ([*HELD, 1], 49, "hold 48 tokens, the reader expects 49"),
}


@pytest.mark.parametrize("expected_ids, num_tokens, verdict", VERDICTS.values(), ids=VERDICTS)
def test_the_holder_compares_the_readers_tokens_with_its_own(
    expected_ids: list[int], num_tokens: int, verdict: str
) -> None:
    packed = pack_tokens(HELD, len(HELD))
    expected = token_digest(expected_ids, num_tokens)
    assert packed is not None and expected is not None
    found = tokens_verdict(packed, expected)
    assert (verdict in found) if verdict else found == ""
    assert bool(found) == bool(verdict)


# ---- a holder's ids, packed when a check first needs them -------------------------------

int32s = st.integers(-(2**31), 2**31 - 1)


@given(
    held=st.lists(st.integers(-(2**31) - 2, 2**31 + 1), max_size=24),
    num_held=st.integers(0, 26),
    data=st.data(),
)
def test_held_tokens_answer_as_the_packed_bytes_would(
    held: list[int], num_held: int, data: st.DataObject
) -> None:
    """A reader's digest of the held ids (a prefix, or with one id edited) or of others."""
    num_expected = data.draw(st.integers(1, 26))
    if data.draw(st.booleans()):
        expected_ids = [min(max(i, -(2**31)), 2**31 - 1) for i in held[:num_expected]]
        if expected_ids and data.draw(st.booleans()):
            expected_ids[data.draw(st.integers(0, len(expected_ids) - 1))] ^= 1
    else:
        expected_ids = data.draw(st.lists(int32s, min_size=num_expected, max_size=26))
    expected_ids += [0] * (num_expected - len(expected_ids))
    digest = token_digest(expected_ids, num_expected)
    assert digest is not None
    packed = pack_tokens(held, num_held)  # the oracle: what request_finished packed before
    oracle = NOT_INT32 if packed is None else tokens_verdict(packed, digest)
    lazy = HeldTokens.of(held, num_held)
    assert (lazy is None) == (num_held < 1 or len(held) < num_held)
    if lazy is None:
        return  # nothing to bind: Producer offers nothing then
    assert lazy.verdict(digest) == oracle
    assert lazy.verdict(digest) == oracle  # a second check: the kept bytes


class ReadCountingIds(list[int]):
    """An engine's id list that counts how often its ids are read (slices and iteration)."""

    num_reads = 0

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            self.num_reads += 1
        return super().__getitem__(index)

    def __iter__(self) -> Any:
        self.num_reads += 1
        return super().__iter__()


def test_held_tokens_read_the_engines_list_once_and_only_when_asked() -> None:
    ids = ReadCountingIds(HELD)
    held = HeldTokens.of(ids, 48)
    assert held is not None and ids.num_reads == 0
    ids.append(5)  # the engine appends its answer: the ids a lease covers stay
    wrong = token_digest([*HELD[:47], 1], 48)
    right = token_digest(HELD, 48)
    assert wrong is not None and right is not None
    assert "other tokens" in held.verdict(wrong)
    assert held.verdict(right) == ""
    assert ids.num_reads == 1  # packed once; later checks use the bytes


NOT_INT32 = "the lease's token ids do not fit int32, so no reader can show it expects them"


def test_a_held_id_past_int32_refuses_every_reader() -> None:
    held = HeldTokens.of([1, 2**31], 2)
    expected = token_digest([1, 2], 2)
    assert held is not None and expected is not None
    assert held.packed() is None and held.verdict(expected) == NOT_INT32


# ---- the wire --------------------------------------------------------------------------


def test_a_lease_check_with_tokens_and_reader_round_trips() -> None:
    check = LeaseCheck(
        "prefill-0",
        (LeaseRef("p1", "ab12", (), TokenDigest(40, 2**64 - 1)),),
        ReaderId("decode-0", "f" * 32),
    )
    assert decode_request_payload(msgspec.msgpack.encode(check)) == check


def test_an_older_readers_lease_check_still_decodes() -> None:
    old = msgspec.msgpack.encode({"type": "lease_check", "engine_id": "p", "leases": [["p1", "l"]]})
    assert decode_request_payload(old) == LeaseCheck("p", (LeaseRef("p1", "l"),))


def test_a_status_without_refusals_omits_the_field_for_older_readers() -> None:
    assert b"refused" not in msgspec.msgpack.encode(LeaseStatus((True,)))
    refused = LeaseStatus((False,), refused=(Refusal(REFUSED_TOKENS, "why"),))
    assert b"refused" in msgspec.msgpack.encode(refused)


# ---- the lease table -------------------------------------------------------------------


def _ref(tokens: TokenDigest | None, request_id: str = "p1", lease_id: str = "L1") -> LeaseRef:
    return LeaseRef(request_id, lease_id, (), tokens)


def test_a_held_lease_is_refused_to_a_reader_expecting_other_tokens() -> None:
    table = LeaseTable(10.0)
    table.lease("p1", 0.0, "L1", tokens=HeldTokens.of(HELD, 48))
    right, wrong = token_digest(HELD, 48), token_digest([*HELD[:47], 1], 48)
    status = table.check([_ref(right), _ref(wrong), _ref(None)], 1.0)
    assert status.held == (True, False, False)
    assert status.refused[0] is None
    assert status.refused[1] == Refusal(
        REFUSED_TOKENS,
        "the lease's blocks hold other tokens than the reader's first 48 (or their KV was "
        "computed with another LoRA adapter, cache salt or multimodal input)",
    )
    assert status.refused[2] is not None and status.refused[2].kind == REFUSED_TOKENS
    assert "does not say which tokens it expects" in status.refused[2].reason
    assert table.check([_ref(right)], 1.0) == LeaseStatus((True,))  # nothing refused: omitted


def test_a_lease_taken_without_ids_answers_as_before() -> None:
    table = LeaseTable(10.0)
    table.lease("p1", 0.0, "L1")
    assert table.check([_ref(token_digest([1, 2], 2))], 1.0) == LeaseStatus((True,))


def test_an_ended_or_other_lease_is_not_held_and_not_refused() -> None:
    table = LeaseTable(10.0)
    table.lease("p1", 0.0, "L1", tokens=HeldTokens.of(HELD, 48))
    wrong = token_digest([1] * 48, 48)
    assert table.check([_ref(wrong, lease_id="L0")], 1.0) == LeaseStatus((False,))
    table.complete("p1")
    assert table.check([_ref(wrong)], 1.0) == LeaseStatus((False,))


# ---- end to end on the example engine (FakeNixl) ----------------------------------------


class CountingNixl(FakeNixl):
    """FakeNixl that counts the READs it posts."""

    num_posted = 0  # across every agent of the test: reset by the fixture

    def post(self, transfer: FakeRead) -> TransferState:
        CountingNixl.num_posted += 1
        return super().post(transfer)


def example_engines(
    suffix: str, *, bidirectional: bool = False, precheck_skip_s: float = 0.0
) -> tuple[Engine, Engine]:
    """A prefill and a decode example engine (``prefill-<suffix>``, ``decode-<suffix>``) on one
    FakeFabric, their READs counted by CountingNixl."""
    fabric = FakeFabric()
    config = ConnectorConfig(
        side_channel_port=0,
        kv_lease_duration_s=30.0,
        handshake_timeout_s=5.0,
        bidirectional_kv_xfer=bidirectional,
        kv_recompute_threshold=8,
        lease_precheck_skip_s=precheck_skip_s,
    )
    prefill, decode = (
        Engine(
            EngineConfig(f"{role}-{suffix}", role=role, num_blocks=64),
            connector_config=config,
            agent_factory=lambda name: CountingNixl(name, fabric),
        )
        for role in ("prefill", "decode")
    )
    return prefill, decode


def _engines(*, bidirectional: bool = False) -> tuple[Engine, Engine]:
    return example_engines("tok", bidirectional=bidirectional)


def run_until_output(engines: tuple[Engine, ...], request_id: str) -> RequestOutput:
    for _ in range(20_000):
        for engine in engines:
            for output in engine.step():
                if output.request_id == request_id:
                    return output
    raise AssertionError(f"{request_id} unfinished")


def drain(engines: tuple[Engine, ...]) -> None:
    for _ in range(2000):
        if not any(engine.has_work() for engine in engines):
            return
        for engine in engines:
            engine.step()
    raise AssertionError("engines still hold requests")


def _prefill(prefill: Engine, request_id: str, prompt: list[int], params: dict[str, Any]) -> Any:
    prefill.add_request(EngineRequest(request_id, prompt, 1, params))
    first = run_until_output((prefill,), request_id)
    assert first.error is None and first.kv_transfer_params is not None
    return first


def test_decode_given_params_of_another_prompt_fails_before_any_read() -> None:
    prefill, decode = _engines()
    try:
        prompt = [(3 * t + 1) % 64 for t in range(40)]
        first = _prefill(prefill, "p", prompt, {"do_remote_decode": True})
        edited = [*prompt[:20], (prompt[20] + 1) % 64, *prompt[21:]]  # same length, one token
        CountingNixl.num_posted = 0
        decode.add_request(
            EngineRequest("d", edited + first.token_ids, 3, first.kv_transfer_params)
        )
        failed = run_until_output((prefill, decode), "d")
        assert failed.error is not None
        reason = failed.error.removeprefix("KV load failed: ")
        assert reason.startswith("tokens mismatch: prefill engine 'prefill-tok' request 'p'")
        assert "other tokens than the reader's first 40" in reason
        assert failed.error_kind == "tokens_mismatch"
        assert CountingNixl.num_posted == 0
        # The right prompt with fresh params loads over NIXL and decodes.
        again = _prefill(prefill, "p2", prompt, {"do_remote_decode": True})
        decode.add_request(
            EngineRequest("d2", prompt + again.token_ids, 3, again.kv_transfer_params)
        )
        good = run_until_output((prefill, decode), "d2")
        assert good.error is None and good.num_external_tokens == 40
        assert CountingNixl.num_posted > 0
        drain((prefill, decode))
        assert (prefill.num_leaked_blocks, decode.num_leaked_blocks) == (0, 0)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_next_turn_whose_history_was_edited_does_not_pull_it() -> None:
    prefill, decode = _engines(bidirectional=True)
    try:
        prompt = [(5 * t + 2) % 64 for t in range(40)]
        first = _prefill(prefill, "t1p", prompt, {"do_remote_decode": True})
        decode.add_request(
            EngineRequest("t1", prompt + first.token_ids, 6, first.kv_transfer_params)
        )
        turn1 = run_until_output((prefill, decode), "t1")
        assert turn1.error is None and turn1.kv_transfer_params is not None
        history = prompt + turn1.token_ids
        edited = [*history[:10], (history[10] + 1) % 64, *history[11:]]
        CountingNixl.num_posted = 0
        prefill.add_request(EngineRequest("t2p", edited + [9] * 12, 1, turn1.kv_transfer_params))
        failed = run_until_output((prefill, decode), "t2p")
        assert failed.error is not None
        reason = failed.error.removeprefix("KV load failed: ")
        assert reason.startswith("tokens mismatch: prefill engine 'decode-tok' request 't1'")
        assert CountingNixl.num_posted == 0
        drain((prefill, decode))
        assert (prefill.num_leaked_blocks, decode.num_leaked_blocks) == (0, 0)
    finally:
        prefill.shutdown()
        decode.shutdown()


# ---- the engine-agnostic API: which ids a load and a lease are bound to ---------------------


def _connector(engine_id: str, role: Role) -> SchedulerConnector:
    return SchedulerConnector(
        msgspec.structs.replace(CONFIG, side_channel_port=0),
        engine_id=engine_id,
        role=role,
        spec=DENSE,
        tp_size=2,
        clock=FakeClock(),
        heartbeat_sender=RecordingHeartbeats(),
    )


def test_a_loads_ranks_check_the_requests_first_tokens_as_this_reader() -> None:
    """The engine thread hands its own id list on, unread: each rank digests it (on its
    transfer thread, worker/loads.py) into what its lease checks expect."""
    decode = _connector("decode-0", Role.CONSUMER)
    try:
        ids = ReadCountingIds(range(500, 545))  # 45 ids; the load covers the first 40
        params = decode_request().kv_transfer_params
        spec = start_load(decode, RequestInfo("d1", 40, params, token_ids=ids))
        assert spec.token_ids is ids and ids.num_reads == 0  # not packed, not hashed, not copied
        assert spec.source.tokens is None and spec.source.reader == decode.reader
        assert checked_source(spec).tokens == token_digest(list(range(500, 540)), 40)
        assert decode.reader.engine_id == "decode-0" and len(decode.reader.boot_id) == 32
    finally:
        decode.shutdown()


def test_prefill_binds_its_lease_to_the_prompt_it_leased() -> None:
    prefill = _connector("prefill-0", Role.PRODUCER)
    try:
        prefill.start_side_channel(handshakes("prefill-0"))
        prompt = list(range(7, 47))
        engine_ids = ReadCountingIds([*prompt, 3])
        info = RequestInfo("p1", 40, {"do_remote_decode": True}, token_ids=engine_ids)
        _, params = prefill.request_finished(info, ((1, 2, 3),))
        assert params is not None
        assert engine_ids.num_reads == 0  # finishing packs nothing: the check packs them
        engine_ids.append(9)  # the engine may grow its list; the lease's 40 ids stay
        lease_id = params["remote_lease_id"]
        blocks = block_digest(((1, 2, 3),), 40)
        refs = [
            LeaseRef("p1", lease_id, (), token_digest(prompt, 40), blocks),
            LeaseRef("p1", lease_id, (), token_digest([*prompt[:39], 8], 40), blocks),
        ]
        status = check_leases_status(
            "127.0.0.1",
            params["remote_port"],
            refs,
            engine_id="prefill-0",
            boot_id=params["remote_boot_id"],
            secret=None,
            timeout_s=5.0,
        )
        assert status.held == (True, False)
        assert status.refused[0] is None
        assert status.refused[1] is not None and "other tokens" in status.refused[1].reason
        assert engine_ids.num_reads == 1
    finally:
        prefill.shutdown()
