"""Multi-turn (bidirectional mode) inside vLLM 0.33's real Scheduler, FakeNixl on the CPU.

Turn 1 goes prefill -> decode as usual; decode then holds the finished request's blocks under
a lease and returns params for the next turn. Turn 2's prefill gets them back (as a router
passes them), pulls the history it does not have cached from decode, computes the rest and
hands the request on to decode as usual. The harness runs no model: KV bytes are seeded
random values, so what prefill holds after the pull can be compared with decode's blocks.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip(
        "vllm is not installed (scripts/install_vllm.sh); CI sets NIXL_PD_REQUIRE_VLLM",
        allow_module_level=True,
    )

from vllm.v1.request import RequestStatus  # noqa: E402

from connector.lease_binding import (
    block_digest,  # noqa: E402
    token_digest,  # noqa: E402
)
from connector.metadata import LoadSpec  # noqa: E402
from connector.net.side_channel_client import check_leases_status  # noqa: E402
from connector.observability.metrics import PULLED_TOKENS, default_recorder  # noqa: E402
from connector.protocol import LeaseRef, LeaseStatus  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
NUM_BLOCKS = 64
TURN1_PROMPT = list(range(1, 2 * BLOCK_SIZE + 1))  # two full blocks
ANSWER_TOKENS = BLOCK_SIZE + 1  # decode's KV then covers 3 full blocks (the last token has none)
NEW_MESSAGE = list(range(100, 100 + BLOCK_SIZE))
BIDIRECTIONAL = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def make_pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    engines: list[h.Engine] = []

    def make(
        *,
        prefill_extra: dict[str, Any] | None = None,
        decode_extra: dict[str, Any] | None = None,
        tp_sizes: tuple[int, int] = (1, 1),
    ) -> tuple[h.Engine, h.Engine]:
        pair = []
        sides = (
            ("prefill", "kv_producer", BIDIRECTIONAL if prefill_extra is None else prefill_extra),
            ("decode", "kv_consumer", BIDIRECTIONAL if decode_extra is None else decode_extra),
        )
        for (name, role, extra), tp_size in zip(sides, tp_sizes, strict=True):
            config = h.vllm_config(
                model,
                kv_role=role,
                failure_policy="recompute",
                extra_config=extra,
                tp_size=tp_size,
            )
            cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, tp_size=tp_size)
            engine = h.build_engine(name, config, cache, port=h.free_port(), env=monkeypatch)
            engines.append(engine)
            pair.append(engine)
        return pair[0], pair[1]

    yield make
    for engine in engines:
        engine.shutdown()


def _pulled_tokens() -> int:
    return default_recorder().snapshot().counters.get(PULLED_TOKENS.name, {}).get("", 0)


def _run_both_until(first: h.Engine, second: h.Engine, done: Any) -> None:
    """Step both engines in turn until ``done()``: with verify_kv a reader's lease check
    waits for the holder's digests, which its ranks report in the holder's own steps."""

    def stepped(engine: h.Engine) -> bool:
        second.step()
        return bool(done())

    first.run_until(stepped)


def _turn1(prefill: h.Engine, decode: h.Engine) -> dict[str, Any] | None:
    """Turn 1 through both engines; returns the params decode handed back (None: none)."""
    params = h.prefill_for_decode(prefill, "t1", len(TURN1_PROMPT), block_size=BLOCK_SIZE)
    h.fill_blocks(prefill, params["remote_block_ids"], seed=1)
    decode.add(
        h.make_request(
            "t1",
            len(TURN1_PROMPT),
            block_size=BLOCK_SIZE,
            kv_transfer_params=params,
            max_tokens=ANSWER_TOKENS,
            token_ids=TURN1_PROMPT,
        )
    )
    _run_both_until(decode, prefill, lambda: decode.finished("t1") is not None)
    returned = decode.finished("t1").kv_transfer_params
    return None if returned is None else dict(returned)


def _turn2_prompt() -> list[int]:
    return TURN1_PROMPT + [h.SAMPLED_TOKEN] * ANSWER_TOKENS + NEW_MESSAGE


def _prefill_turn2(
    prefill: h.Engine, decode: h.Engine, held: dict[str, Any] | None
) -> dict[str, Any]:
    """Turn 2 on prefill with decode's params (as a router passes them); returns the params
    prefill hands to decode."""
    prompt = _turn2_prompt()
    params = dict(held) if held is not None else {"do_remote_decode": True}
    prefill.add(
        h.make_request(
            "t2",
            len(prompt),
            block_size=BLOCK_SIZE,
            kv_transfer_params=params,
            max_tokens=1,
            token_ids=prompt,
        )
    )
    _run_both_until(prefill, decode, lambda: prefill.finished("t2") is not None)
    output = prefill.finished("t2")
    assert output.new_token_ids == [h.SAMPLED_TOKEN]
    assert output.kv_transfer_params is not None
    return dict(output.kv_transfer_params)


@pytest.mark.parametrize(
    "tp_sizes", [(1, 1), (1, 2), (2, 1)], ids=["tp1-tp1", "prefill-tp1-decode-tp2", "tp2-tp1"]
)
def test_turn2_prefill_pulls_the_history_it_lacks_from_decode(
    make_pair: Any, tp_sizes: tuple[int, int]
) -> None:
    prefill, decode = make_pair(tp_sizes=tp_sizes)
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    held = _turn1(prefill, decode)

    # Decode holds the finished request's blocks and says so in vLLM 0.33's keys.
    assert held is not None
    assert held["do_remote_decode"] is True and held["do_remote_prefill"] is False
    assert held["remote_num_tokens"] == len(TURN1_PROMPT) + ANSWER_TOKENS - 1
    assert len(held["remote_block_ids"][0]) == 3
    assert held["remote_engine_id"] == decode.scheduler.vllm_config.kv_transfer_config.engine_id
    assert isinstance(held["remote_blocks_expiry_time"], float)
    assert decode.num_free_blocks() == free_decode - 3
    h.fill_blocks(decode, held["remote_block_ids"], seed=2)  # the answer's KV, as decode wrote it
    answer_block = [held["remote_block_ids"][0][2]]
    decode_answer_kv = h.heads_bytes(decode, answer_block)

    pulled_before = _pulled_tokens()
    for_decode = _prefill_turn2(prefill, decode, held)

    # Prefill had turn 1's prompt cached (two blocks): it pulled only the answer's block.
    assert _pulled_tokens() - pulled_before == BLOCK_SIZE
    assert h.heads_bytes(prefill, [for_decode["remote_block_ids"][0][2]]) == decode_answer_kv
    assert prefill.stats["loads_finished"] == tp_sizes[0]
    # Prefill's free notification ended decode's hold: decode frees, long before the TTL.
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)

    # Turn 2 goes on to decode as usual, and decode holds it again for turn 3.
    decode.add(
        h.make_request(
            "t2",
            len(_turn2_prompt()),
            block_size=BLOCK_SIZE,
            kv_transfer_params=for_decode,
            max_tokens=3,
            token_ids=_turn2_prompt(),
        )
    )
    decode.run_until(lambda e: e.finished("t2") is not None)
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    turn3 = decode.finished("t2").kv_transfer_params
    assert turn3 is not None and turn3["remote_num_tokens"] == len(_turn2_prompt()) + 2


def test_with_verify_kv_the_pull_checks_decode_held_digests(make_pair: Any) -> None:
    extra = {**BIDIRECTIONAL, "verify_kv": True}
    prefill, decode = make_pair(prefill_extra=extra, decode_extra=extra)
    free_decode = decode.num_free_blocks()
    held = _turn1(prefill, decode)
    assert held is not None
    pulled_before = _pulled_tokens()
    _prefill_turn2(prefill, decode, held)
    assert _pulled_tokens() - pulled_before == BLOCK_SIZE
    assert prefill.stats["loads_finished"] == 1 and prefill.stats["loads_failed"] == 0
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_the_pull_is_a_load_in_the_step_metadata(make_pair: Any) -> None:
    prefill, decode = make_pair()
    held = _turn1(prefill, decode)
    assert held is not None
    prompt = _turn2_prompt()
    prefill.add(
        h.make_request(
            "t2",
            len(prompt),
            block_size=BLOCK_SIZE,
            kv_transfer_params=held,
            max_tokens=1,
            token_ids=prompt,
        )
    )
    scheduled = prefill.scheduler.schedule()
    loads: tuple[LoadSpec, ...] = scheduled.kv_connector_metadata.step.loads
    assert [(load.request_id, load.num_cached_tokens, load.num_tokens) for load in loads] == [
        ("t2", 2 * BLOCK_SIZE, 3 * BLOCK_SIZE)
    ]
    assert loads[0].source.engine_id == held["remote_engine_id"]
    assert loads[0].source.lease_id == held["remote_lease_id"]
    assert prefill.scheduler.requests["t2"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_an_expired_hold_fails_the_pull_and_prefill_recomputes(make_pair: Any) -> None:
    decode_extra = {**BIDIRECTIONAL, "decoder_kv_blocks_ttl": 0.3}
    prefill, decode = make_pair(decode_extra=decode_extra)
    free_decode = decode.num_free_blocks()
    held = _turn1(prefill, decode)
    assert held is not None
    h.fill_blocks(decode, held["remote_block_ids"], seed=2)
    decode_answer_kv = h.heads_bytes(decode, [held["remote_block_ids"][0][2]])
    decode.run_until(lambda e: e.num_free_blocks() == free_decode, timeout_s=5.0)  # the TTL

    pulled_before = _pulled_tokens()
    for_decode = _prefill_turn2(
        prefill, decode, held
    )  # still finishes: recomputed (policy recompute)

    assert _pulled_tokens() == pulled_before
    assert prefill.stats["loads_failed"] == 1 and prefill.stats.get("loads_finished", 0) == 0
    assert h.heads_bytes(prefill, [for_decode["remote_block_ids"][0][2]]) != decode_answer_kv
    assert for_decode["do_remote_prefill"] is True


def test_params_without_a_lease_id_cannot_be_proven_and_prefill_recomputes(
    make_pair: Any,
) -> None:
    prefill, decode = make_pair()
    held = _turn1(prefill, decode)
    assert held is not None
    del held["remote_lease_id"]  # a router that drops our key, or another decode connector
    pulled_before = _pulled_tokens()
    _prefill_turn2(prefill, decode, held)
    assert _pulled_tokens() == pulled_before
    assert prefill.stats["loads_failed"] == 1 and prefill.stats.get("loads_finished", 0) == 0


def test_below_the_recompute_threshold_prefill_computes_and_releases_decode(
    make_pair: Any,
) -> None:
    prefill_extra = {**BIDIRECTIONAL, "kv_recompute_threshold": BLOCK_SIZE + 1}
    prefill, decode = make_pair(prefill_extra=prefill_extra)
    free_decode = decode.num_free_blocks()
    held = _turn1(prefill, decode)
    pulled_before = _pulled_tokens()
    _prefill_turn2(prefill, decode, held)  # 16 uncached tokens held by decode: below 17
    assert _pulled_tokens() == pulled_before
    assert prefill.stats.get("loads_finished", 0) == 0
    # Released over the side channel at prefill's request_finished, not left to the TTL.
    decode.run_until(lambda e: e.num_free_blocks() == free_decode, timeout_s=5.0)


def test_without_the_mode_decode_holds_nothing_and_prefill_pulls_nothing(
    make_pair: Any,
) -> None:
    prefill, decode = make_pair(prefill_extra={}, decode_extra={})
    free_decode = decode.num_free_blocks()
    assert _turn1(prefill, decode) is None
    assert decode.num_free_blocks() == free_decode


STAGED = {**BIDIRECTIONAL, "kv_buffer_device": "cpu"}


def _lease_status(engine: h.Engine, held: dict[str, Any]) -> LeaseStatus:
    """What the holder's side channel answers a reader about the lease ``held`` names."""
    return check_leases_status(
        "127.0.0.1",
        held["remote_port"],
        [_pull_ref(held)],
        engine_id=held["remote_engine_id"],
        boot_id=held["remote_boot_id"],
        secret=None,
        timeout_s=5.0,
    )


def _pull_ref(held: dict[str, Any]) -> LeaseRef:
    """The ref turn 2's prefill sends to pull every token the hold ``held`` offers: its
    tokens (turn 1's prompt and answer) and the hold's blocks."""
    num_tokens = held["remote_num_tokens"]
    return LeaseRef(
        held["remote_request_id"],
        held["remote_lease_id"],
        (),
        token_digest(_turn2_prompt(), num_tokens),
        block_digest(held["remote_block_ids"], num_tokens),
    )


@pytest.mark.parametrize("tp_sizes", [(1, 1), (1, 2)], ids=["tp1-tp1", "prefill-tp1-decode-tp2"])
def test_with_host_staging_a_hold_is_copied_to_the_host_before_its_lease_is_readable(
    make_pair: Any, tp_sizes: tuple[int, int]
) -> None:
    """Decode computed the answer's KV on the device; NIXL reads the host buffer. The hold's
    lease answers pending (not held) until every decode rank copied its blocks device->host
    (the step after request_finished), and the next turn's pull then reads the answer's KV."""
    prefill, decode = make_pair(prefill_extra=STAGED, decode_extra=STAGED, tp_sizes=tp_sizes)
    for engine in (prefill, decode):
        engine.call_wait_for_save = True
    held = _turn1(prefill, decode)
    assert held is not None
    h.fill_blocks(decode, held["remote_block_ids"], seed=2)  # the answer's KV, on the device
    answer_block = [held["remote_block_ids"][0][2]]
    decode_answer_kv = h.heads_bytes(decode, answer_block)

    waiting = _lease_status(decode, held)
    assert waiting.held == (False,) and waiting.pending == (True,), waiting
    decode.step()  # the ranks copy the hold device->host and report it
    ready = _lease_status(decode, held)
    assert ready.held == (True,) and ready.staged == (True,) and not any(ready.pending), ready

    for_decode = _prefill_turn2(prefill, decode, held)
    assert prefill.stats["loads_finished"] == tp_sizes[0]
    assert h.heads_bytes(prefill, [for_decode["remote_block_ids"][0][2]]) == decode_answer_kv


@pytest.mark.parametrize("broken", [False, True], ids=["copy-right", "copy-changes-a-value"])
def test_with_verify_kv_a_hold_whose_copy_to_the_host_differs_ends_and_the_pull_fails(
    make_pair: Any, broken: bool
) -> None:
    """verify_kv compares a hold's device->host copy as it does prefill's: one that differs
    ends the hold's lease (WorkerReport.unsaved), so the next turn's pull fails and prefill
    recomputes instead of reading the bad copy."""
    extra = {**STAGED, "verify_kv": True}
    prefill, decode = make_pair(prefill_extra=extra, decode_extra=extra)
    for engine in (prefill, decode):
        engine.call_wait_for_save = True

    def copy_op(src: Any, dst: Any, src_ids: list[int], dst_ids: list[int], direction: str) -> None:
        for name, tensor in src.items():
            dst[name][dst_ids] = tensor[src_ids].to(dst[name].device)
        if broken and direction == "d2h":
            first_layer = dst[sorted(dst)[0]]
            first_layer[(dst_ids[-1],) + (0,) * (first_layer.dim() - 1)] += 1.0  # one value

    for worker in decode.workers:
        worker.set_host_xfer_buffer_ops(copy_op)
    held = _turn1(prefill, decode)
    assert held is not None
    h.fill_blocks(decode, held["remote_block_ids"], seed=2)
    pulled_before = _pulled_tokens()
    _prefill_turn2(prefill, decode, held)  # finishes either way (policy recompute)
    if broken:
        assert _pulled_tokens() == pulled_before
        assert prefill.stats["loads_failed"] == 1 and prefill.stats.get("loads_finished", 0) == 0
    else:
        assert _pulled_tokens() - pulled_before == BLOCK_SIZE
        assert prefill.stats["loads_finished"] == 1 and prefill.stats.get("loads_failed", 0) == 0
