"""vLLM's decode semantics in the adapter: SSM prefill backoff, scratch-slot clipping, refusals.

Driven through vLLM 0.33's real Scheduler with a hybrid model (a full-attention group and a
Mamba state group; at the end, one with a sliding-window group instead), FakeNixl moving the
bytes.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip(
        "vllm is not installed (scripts/install_vllm.sh); CI sets NIXL_PD_REQUIRE_VLLM",
        allow_module_level=True,
    )

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request  # noqa: E402

from connector.errors import UnsupportedConfiguration  # noqa: E402
from connector.layout import TOKEN_ADDRESSABLE, BlockFormat, window_read_start  # noqa: E402
from connector.vllm import NixlPDConnector  # noqa: E402
from connector.vllm.scheduler import (  # noqa: E402
    clip_ssm_groups,
    prefill_backoff_tokens,
    transferred_prompt_tokens,
    truncate_for_prefill,
)
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
MAMBA_STATE = BlockFormat("MAMBA_STATE", token_addressable=False)
FORMATS = [TOKEN_ADDRESSABLE, MAMBA_STATE]  # attention group, Mamba group
# Without prefix caching vLLM runs Mamba in its "none" cache mode, where a Mamba block spans
# max_model_len tokens (MambaModelConfig): a request's list is [state, scratch...], and the
# kernel reads the state from column 0 (mamba_get_block_table_tensor).
MAMBA_BLOCK_SIZE = h.MAX_MODEL_LEN


@pytest.mark.parametrize(
    ("groups", "scratch", "expected"),
    [
        (((1, 2), (0, 0, 7)), (None, 0), ((1, 2), (7,))),
        (((1, 2), (0, 7, 8, 9)), (None, 2), ((1, 2), (7,))),
        (((1,), (7,)), (None, 2), ((1,), (7,))),
        (((1,), ()), (None, 2), ((1,), ())),
    ],
    ids=["placeholders-dropped", "scratch-slots-dropped", "state-kept-before-scratch-exists", "full-hit-empty"],
)  # fmt: skip
def test_ssm_groups_clip_to_the_running_state(groups: Any, scratch: Any, expected: Any) -> None:
    assert clip_ssm_groups(groups, scratch) == expected


def hybrid_cache(tp_size: int = 1, scratch: int = 0, align: bool = False) -> KVCacheConfig:
    """Attention and Mamba; ``align``: vLLM's Mamba prefix caching, a state per block."""
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=max(h.MODEL_KV_HEADS // tp_size, 1),
        head_size=h.HEAD_SIZE,
        dtype=torch.float32,
    )
    mamba = MambaSpec(
        block_size=BLOCK_SIZE if align else MAMBA_BLOCK_SIZE,
        shapes=((3, 4), (5,)),
        dtypes=(torch.float32, torch.float32),
        num_speculative_blocks=scratch,
        mamba_cache_mode="align" if align else "none",
    )
    groups = [KVCacheGroupSpec(["layers.0"], full), KVCacheGroupSpec(["layers.1"], mamba)]
    return KVCacheConfig(
        num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups, kv_cache_layout="LBNHC"
    )


@pytest.fixture
def hybrid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    model = h.model_config(h.write_tiny_model(tmp_path))
    built: list[h.Engine] = []

    def make(
        tp_sizes: tuple[int, int] = (1, 1), scratch: int = 0, decode_align: bool = False
    ) -> list[h.Engine]:
        for role, tp_size in zip(("kv_producer", "kv_consumer"), tp_sizes, strict=True):
            align = decode_align and role == "kv_consumer"
            config = h.vllm_config(model, kv_role=role, tp_size=tp_size, block_size=BLOCK_SIZE)
            config.scheduler_config.disable_hybrid_kv_cache_manager = False
            config.cache_config.enable_prefix_caching = align  # Mamba caching needs 'align'
            config.cache_config.mamba_cache_mode = "align" if align else "none"
            cache = hybrid_cache(tp_size, scratch, align)
            built.append(
                h.build_engine(role, config, cache, port=h.free_port(), env=monkeypatch, block_format=FORMATS)
            )  # fmt: skip
        return built[-2:]

    yield make
    for engine in built:
        engine.shutdown()


def _prefill(
    prefill: h.Engine, num_tokens: int, prompt_logprobs: int | None = None, max_tokens: int = 4
) -> tuple[Any, dict[str, Any]]:
    request = h.make_request("r", num_tokens, block_size=BLOCK_SIZE, max_tokens=max_tokens,
                             kv_transfer_params={"do_remote_decode": True},
                             prompt_logprobs=prompt_logprobs)  # fmt: skip
    prefill.add(request)
    prefill.run_until(lambda e: e.finished("r") is not None, timeout_s=30)
    return request, dict(prefill.finished("r").kv_transfer_params)


def _fill_every_block(engine: h.Engine, seed: int) -> None:
    """Distinct non-zero bytes in every block of every group (the null block, scratch slots
    and free blocks too): a load from any block but the leased one shows in the bytes."""
    every_block = range(engine.scheduler.kv_cache_config.num_blocks)
    h.fill_blocks(engine, [every_block, every_block], seed)


def _kernel_state(decode: h.Engine, loaded: Sequence[Sequence[int]], scratch: int = 0) -> bytes:
    """The Mamba state decode's kernel will start from: in the "none" cache mode vLLM passes
    the group's list [state, scratch...] as the block table and reads column 0 (vLLM 0.33,
    mamba_get_block_table_tensor and MambaAttentionMetadataBuilder)."""
    assert len(loaded[1]) == 1 + scratch, f"decode's Mamba list {loaded[1]}"
    (state,) = h.block_bytes(decode, 0, 1, loaded[1][:1])
    return state


def test_with_mamba_prefill_stops_one_token_short_and_decode_derives_the_last_state(
    hybrid: Any,
) -> None:
    """33 tokens: prefill computes 32 (two whole blocks) and offers one state block; decode
    loads exactly those 32 (a 33-token load would need a third prefill block and fail) and the
    running state arrives byte for byte, for decode to apply token 33 once."""
    prefill, decode = hybrid()
    request, params = _prefill(prefill, 2 * BLOCK_SIZE + 1)
    assert (request.num_prompt_tokens, request.max_tokens) == (2 * BLOCK_SIZE, 1)
    attention_blocks, state_blocks = params["remote_block_ids"]
    assert (len(attention_blocks), len(state_blocks)) == (2, 1)
    _fill_every_block(prefill, seed=5)
    (expected_state,) = h.block_bytes(prefill, 0, 1, state_blocks)

    decode.add(h.make_request("r", 2 * BLOCK_SIZE + 1, block_size=BLOCK_SIZE, kv_transfer_params=params))  # fmt: skip
    loaded = h.run_until_loaded(decode, "r", timeout_s=30)
    assert decode.stats["loads_failed"] == 0 and decode.stats["loads_finished"] == 1
    assert _kernel_state(decode, loaded) == expected_state
    assert h.block_bytes(decode, 0, 0, loaded[0][:2]) == h.block_bytes(prefill, 0, 0, attention_blocks)  # fmt: skip


@pytest.mark.parametrize(
    ("num_tokens", "scratch"),
    [(2 * BLOCK_SIZE + 1, 0), (2 * BLOCK_SIZE + 5, 0), (2 * BLOCK_SIZE + 1, 2)],
    ids=["state-ends-a-block", "state-mid-block", "with-scratch-slots"],
)
def test_an_align_mode_decode_gets_the_state_where_its_first_step_takes_it(
    hybrid: Any, num_tokens: int, scratch: int
) -> None:
    """With Mamba prefix caching (the "align" mode) decode keeps a state per 16-token block,
    and a new request's first step takes its running state from column
    (num_computed_tokens - 1) // block_size of the list (vLLM 0.33,
    mamba_utils.preprocess_mamba), copying it on: the loaded state must be there."""
    prefill, decode = hybrid(scratch=scratch, decode_align=True)
    _, params = _prefill(prefill, num_tokens)
    _fill_every_block(prefill, seed=7)
    (expected_state,) = h.block_bytes(prefill, 0, 1, params["remote_block_ids"][1])
    decode.add(h.make_request("r", num_tokens, block_size=BLOCK_SIZE, kv_transfer_params=params))  # fmt: skip
    loaded = h.run_until_loaded(decode, "r", timeout_s=30)
    assert decode.stats["loads_failed"] == 0 and decode.stats["loads_finished"] == 1
    column = (params["remote_num_tokens"] - 1) // BLOCK_SIZE
    assert h.block_bytes(decode, 0, 1, loaded[1][column : column + 1]) == [expected_state]


@pytest.mark.parametrize(
    ("num_prompt_tokens", "backoff", "expected"),
    [(33, 0, 33), (33, 1, 32), (33, 3, 30), (1, 1, 0), (2, 3, 0), (1, 0, 1)],
    ids=["no-backoff-all", "mamba-one-short", "mtp-window-short", "one-token-mamba-none",
         "shorter-than-window-none", "one-token-attention-all"],
)  # fmt: skip
def test_one_count_for_both_sides(num_prompt_tokens: int, backoff: int, expected: int) -> None:
    assert transferred_prompt_tokens(num_prompt_tokens, backoff) == expected


NUM_PROMPT_TOKENS = 2 * BLOCK_SIZE + 5  # 37: prefill computes 36, decode computes the 37th


@pytest.mark.parametrize(
    ("prefill_logprobs", "decode_logprobs"),
    [(1, None), (None, None), (1, 1)],
    ids=["only-prefill-asks-prompt-logprobs", "neither-asks", "both-ask"],
)
def test_decode_loads_exactly_the_state_prefill_leased(
    hybrid: Any, prefill_logprobs: int | None, decode_logprobs: int | None
) -> None:
    """A state is the state after exactly its tokens: prefill's lease and decode's load count
    the same tokens whatever the prefill request asked (prompt logprobs skip the prefix cache,
    which once also skipped the back-off: decode took the state of 37 tokens as 36's)."""
    prefill, decode = hybrid()
    request, params = _prefill(prefill, NUM_PROMPT_TOKENS, prompt_logprobs=prefill_logprobs)
    assert request.num_prompt_tokens == params["remote_num_tokens"] == NUM_PROMPT_TOKENS - 1
    _fill_every_block(prefill, seed=3)
    (expected_state,) = h.block_bytes(prefill, 0, 1, params["remote_block_ids"][1])

    decode.add(h.make_request("r", NUM_PROMPT_TOKENS, block_size=BLOCK_SIZE, kv_transfer_params=params,
                              prompt_logprobs=decode_logprobs))  # fmt: skip
    loaded = h.run_until_loaded(decode, "r", timeout_s=30)
    if decode_logprobs is not None:  # vLLM does not read a cache for it: decode computes all
        assert decode.load_specs == [] and decode.stats.get("loads_finished", 0) == 0
        return
    (load,) = decode.load_specs
    assert load.num_tokens == params["remote_num_tokens"]
    assert decode.stats["loads_failed"] == 0 and decode.stats["loads_finished"] == 1
    assert _kernel_state(decode, loaded) == expected_state


def test_a_prompt_no_longer_than_the_backoff_is_computed_by_decode(hybrid: Any) -> None:
    """One token with a Mamba back-off of one: no state could be loaded that decode would not
    then apply the token to again, so decode loads nothing and prefill's lease is released.
    (Prefill is asked for one token, as routers ask: asked for more, it computes past the
    prompt and offers nothing, test_a_hybrid_prefill_past_its_prompt_never_lends_a_later_state.)"""
    prefill, decode = hybrid()
    request, params = _prefill(prefill, 1, max_tokens=1)
    assert request.num_prompt_tokens == 1
    num_free_before = prefill.num_free_blocks()
    decode.add(h.make_request("r", 1, block_size=BLOCK_SIZE, kv_transfer_params=params))
    decode.run_until(lambda e: e.finished("r") is not None, timeout_s=30)
    assert decode.load_specs == []
    prefill.run_until(lambda e: e.num_free_blocks() > num_free_before, timeout_s=30)


def test_speculative_scratch_slots_never_travel(hybrid: Any) -> None:
    prefill, decode = hybrid(scratch=2)
    _, params = _prefill(prefill, BLOCK_SIZE + 3)
    _, state_blocks = params["remote_block_ids"]
    assert len(state_blocks) == 1, "prefill offered scratch slots as state"
    _fill_every_block(prefill, seed=9)  # prefill's scratch slots hold other bytes than its state
    (expected_state,) = h.block_bytes(prefill, 0, 1, state_blocks)
    decode.add(h.make_request("r", BLOCK_SIZE + 3, block_size=BLOCK_SIZE, kv_transfer_params=params))  # fmt: skip
    loaded = h.run_until_loaded(decode, "r", timeout_s=30)
    assert decode.stats["loads_failed"] == 0 and decode.stats["loads_finished"] == 1
    assert _kernel_state(decode, loaded, scratch=2) == expected_state
    scratch_slots = h.block_bytes(decode, 0, 1, loaded[1][1:])
    assert scratch_slots == [bytes(len(expected_state))] * 2, "a READ wrote a scratch slot"


def test_mamba_across_tp_sizes_is_refused_saying_why(
    hybrid: Any, caplog: pytest.LogCaptureFixture
) -> None:
    prefill, decode = hybrid(tp_sizes=(2, 1))
    _, params = _prefill(prefill, BLOCK_SIZE + 3)
    decode.add(h.make_request("r", BLOCK_SIZE + 3, block_size=BLOCK_SIZE, kv_transfer_params=params))  # fmt: skip
    decode.run_until(lambda e: e.finished("r") is not None, timeout_s=30)
    assert decode.stats["loads_failed"] == 1
    assert "holds recurrent (SSM/Mamba) state in format 'MAMBA_STATE'" in caplog.text
    assert "decode TP 1 cannot read from prefill TP 2" in caplog.text
    assert "models" not in caplog.text.split("holds recurrent")[1].split("\n")[0]


def test_a_plain_request_is_not_truncated(hybrid: Any) -> None:
    prefill, _ = hybrid()
    request = h.make_request("plain", 20, block_size=BLOCK_SIZE)
    assert not truncate_for_prefill(request, 1)
    assert request.num_prompt_tokens == 20


def test_a_prompt_of_embeddings_backs_off_like_one_of_ids() -> None:
    """Decode counts an embeddings prompt as any other (transferred_prompt_tokens), so prefill
    must stop short of it too: the state it leases is the one decode loads."""
    request = Request(
        request_id="embeds",
        prompt_token_ids=None,
        prompt_embeds=torch.ones(20, 8),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
    )
    request.kv_transfer_params = {"do_remote_decode": True}
    assert truncate_for_prefill(request, 1)
    assert request.num_prompt_tokens == len(request.all_token_ids) == 19
    assert request.prompt_embeds is not None and request.prompt_embeds.shape[0] == 19


def test_decode_context_parallel_is_refused_at_start(tmp_path: Path) -> None:
    model = h.model_config(h.write_tiny_model(tmp_path))
    config = h.vllm_config(model, kv_role="kv_consumer", block_size=BLOCK_SIZE)
    config.parallel_config.decode_context_parallel_size = 2
    cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=8)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(UnsupportedConfiguration, match="decode_context_parallel_size=2: .* use decode_context_parallel_size 1"):  # fmt: skip
        NixlPDConnector(config, KVConnectorRole.SCHEDULER, cache)


WINDOW = 16  # tokens a sliding-window layer attends to


@pytest.fixture
def windowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """(prefill, decode) of a model with a full-attention layer and a sliding-window one."""
    model = h.model_config(h.write_tiny_model(tmp_path))
    built: list[h.Engine] = []
    for role in ("kv_producer", "kv_consumer"):
        config = h.vllm_config(model, kv_role=role, block_size=BLOCK_SIZE)
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=32, window=WINDOW)
        built.append(h.build_engine(role, config, cache, port=h.free_port(), env=monkeypatch))
    yield built
    for engine in built:
        engine.shutdown()


def _token_bytes(
    engine: h.Engine, group: int, block_ids: Sequence[int], tokens: range
) -> list[bytes]:
    """Each token's K|V bytes in every layer of an attention group ([block, head, token, C])."""
    layers = engine.scheduler.kv_cache_config.kv_cache_groups[group].layer_names
    return [
        engine.kv_caches[0][name][block_ids[token // BLOCK_SIZE]][:, token % BLOCK_SIZE].numpy().tobytes()
        for name in layers
        for token in tokens
    ]  # fmt: skip


def _start_prefill(prefill: h.Engine, num_tokens: int, max_tokens: int) -> list[list[int]]:
    """Prefill's first step of a do_remote_decode request (its whole prompt), whose blocks
    then get seeded bytes: the prompt's KV. Returns the request's blocks per group."""
    prefill.add(h.make_request("r", num_tokens, block_size=BLOCK_SIZE, max_tokens=max_tokens,
                               kv_transfer_params={"do_remote_decode": True}))  # fmt: skip
    prefill.step()
    request = prefill.scheduler.requests["r"]  # backed off, its prompt is num_tokens - backoff
    assert request.num_computed_tokens == request.num_prompt_tokens <= num_tokens
    blocks = [list(group) for group in prefill.scheduler.kv_cache_manager.get_block_ids("r")]
    h.fill_blocks(prefill, blocks, seed=11)
    return blocks


def _write_state(engine: h.Engine, block: int, num_tokens: int) -> None:
    """Every byte of the Mamba group's ``block``: ``num_tokens``, standing for the state after
    that many tokens."""
    for name in engine.scheduler.kv_cache_config.kv_cache_groups[1].layer_names:
        engine.kv_caches[0][name][block].fill_(num_tokens)


def test_a_hybrid_prefill_past_its_prompt_never_lends_a_later_state(hybrid: Any) -> None:
    """A one-token prompt is not backed off (test above), so prefill computes the answer's
    tokens too when asked for four, and its Mamba state moves on with each. Decode, sent the
    prompt and prefill's first token (as `nixl-pd route` does), would load the state of the
    one-token prompt: what it loads must be that state, not the later one. Prefill offers
    nothing, frees its blocks, and decode computes the prompt itself."""
    prefill, decode = hybrid()
    num_free_before = prefill.num_free_blocks()
    (state,) = _start_prefill(prefill, 1, max_tokens=4)[1]
    _write_state(prefill, state, 1)
    prompt_state = h.block_bytes(prefill, 0, 1, [state])
    for num_tokens in range(2, 6):  # each later step moves the state on by its token
        prefill.step()
        _write_state(prefill, state, num_tokens)
        if prefill.finished("r") is not None:
            break
    params = prefill.finished("r").kv_transfer_params
    decode.add(h.make_request("r", 2, block_size=BLOCK_SIZE, token_ids=[1, h.SAMPLED_TOKEN],
                              kv_transfer_params=params and dict(params)))  # fmt: skip
    loaded = h.run_until_loaded(decode, "r", timeout_s=30)
    if decode.stats.get("loads_finished", 0):  # never wrong: a load holds the prompt's state
        assert h.block_bytes(decode, 0, 1, loaded[1][-1:]) == prompt_state, "a later state loaded"
    assert params is None and decode.load_specs == []
    assert prefill.num_free_blocks() == num_free_before


def test_a_windowed_prefill_asked_for_more_tokens_is_backed_off_and_lends_its_window(
    windowed: Any,
) -> None:
    """46 tokens, a 16-token window, three tokens asked of prefill. The back-off (1 with a
    sliding window) stops prefill at 45 prompt tokens and one answer token, so vLLM frees
    only what token 45 no longer attends to: decode loads 45 and computes token 45, and the
    window it attends to, [30, 45), holds prefill's KV (before the back-off, prefill ran on,
    vLLM freed the block of tokens [16, 32), and the offer had to be withdrawn)."""
    prefill, decode = windowed
    num_tokens = 46
    window_blocks = _start_prefill(prefill, num_tokens, max_tokens=3)[1]
    window = range(num_tokens - 1 - (WINDOW - 1), num_tokens - 1)
    prompt_window = _token_bytes(prefill, 1, window_blocks, window)
    prefill.run_until(lambda e: e.finished("r") is not None, timeout_s=30)
    params = prefill.finished("r").kv_transfer_params
    assert params is not None
    decode.add(h.make_request("r", num_tokens, block_size=BLOCK_SIZE,
                              kv_transfer_params=dict(params)))  # fmt: skip
    loaded = h.run_until_loaded(decode, "r", timeout_s=30)
    assert [spec.num_tokens for spec in decode.load_specs] == [num_tokens - 1]
    assert decode.stats.get("loads_finished", 0) == 1
    assert _token_bytes(decode, 1, loaded[1], window) == prompt_window, "a freed block loaded"


def test_a_windowed_prefill_past_its_prompt_never_lends_a_freed_block(windowed: Any) -> None:
    """A one-token prompt is not backed off, so prefill computes the answer's tokens too when
    asked for 40; by its last step (40 tokens computed) vLLM has freed the window's first
    block (tokens [0, 16)), which a decode sent the prompt and more would attend to. Prefill
    offers nothing, frees its blocks, and decode computes the prompt itself."""
    prefill, decode = windowed
    num_free_before = prefill.num_free_blocks()
    _start_prefill(prefill, 1, max_tokens=40)
    prefill.run_until(lambda e: e.finished("r") is not None, timeout_s=30)
    params = prefill.finished("r").kv_transfer_params
    decode.add(h.make_request("r", 2, block_size=BLOCK_SIZE, token_ids=[1, h.SAMPLED_TOKEN],
                              kv_transfer_params=params and dict(params)))  # fmt: skip
    h.run_until_loaded(decode, "r", timeout_s=30)
    assert params is None and decode.load_specs == []
    assert prefill.num_free_blocks() == num_free_before


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 2, 5, 16, 17, 32])
def test_decodes_first_token_attends_only_to_loaded_tokens_prefill_kept(
    block_size: int, window: int
) -> None:
    """For every prompt length T: prefill computes the transferred tokens L and frees, at its
    finish, the blocks wholly before L - window + 1 (vLLM's
    SlidingWindowManager.get_num_skipped_tokens(L)). Decode loads L; the first token it
    computes is L, or L - 1 when it loaded the whole prompt (vLLM rewinds a full hit,
    Scheduler._update_waiting_for_remote_kv). That token's window must lie inside what the
    reader reads, and what it reads inside the blocks prefill kept."""
    cache = h.kv_cache_config(block_size=block_size, num_blocks=8, window=window)
    backoff = prefill_backoff_tokens(SimpleNamespace(), cache)
    for num_tokens in range(1, 3 * window + 2 * block_size + 2):
        loaded = transferred_prompt_tokens(num_tokens, backoff)
        if loaded == 0:
            continue
        first_kept = max(0, loaded - window + 1) // block_size * block_size
        first_computed = loaded - 1 if loaded == num_tokens else loaded
        attends = range(max(0, first_computed - window + 1), first_computed)
        reads = range(window_read_start(loaded, window), loaded)
        assert set(attends) <= set(reads), (num_tokens, "decode attends to a token not loaded")
        assert reads.start >= first_kept, (num_tokens, "a read of a block prefill freed")


NULL_BLOCK = 0  # vLLM's null block: the placeholder for freed blocks, shared by every request


def test_a_window_start_vllm_freed_is_never_lent_nor_read_into_the_null_block(
    windowed: Any,
) -> None:
    """47 tokens, a 16-token window, one token asked of prefill. Without a back-off, prefill's
    finish freed the window's blocks for its next token (47, window [32, 47]): the block of
    tokens [16, 32) became the null block in both sides' lists, yet decode, loading all 47,
    recomputed token 46, whose window [31, 46] holds token 31, and our READ of [31, 47) copied
    null into null with the load reporting success. Backed off by one, prefill computes 46
    tokens and keeps token 46's window [31, 46]; decode loads those 46 and computes token 46
    itself: the window it attends to, [31, 46), holds prefill's KV, and no READ touches the
    null block."""
    prefill, decode = windowed
    num_tokens = 47
    prefill.add(h.make_request("r", num_tokens, block_size=BLOCK_SIZE, max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True}))  # fmt: skip
    prefill.run_until(lambda e: e.finished("r") is not None, timeout_s=30)
    params = prefill.finished("r").kv_transfer_params
    assert params is not None
    every_block = range(prefill.scheduler.kv_cache_config.num_blocks)
    h.fill_blocks(prefill, [every_block, every_block], seed=13)  # prefill's null block too
    null_bytes = h.block_bytes(decode, 0, 1, [NULL_BLOCK])
    decode.add(h.make_request("r", num_tokens, block_size=BLOCK_SIZE,
                              kv_transfer_params=dict(params)))  # fmt: skip
    loaded = h.run_until_loaded(decode, "r", timeout_s=30)
    (spec,) = decode.load_specs
    first_computed = spec.num_tokens  # the first token decode computes itself
    assert first_computed == num_tokens - 1
    window = range(first_computed - (WINDOW - 1), first_computed)  # what it attends to: [31, 46)
    remote_window_blocks = params["remote_block_ids"][1]
    assert NULL_BLOCK not in {remote_window_blocks[t // BLOCK_SIZE] for t in window}
    assert NULL_BLOCK not in {loaded[1][t // BLOCK_SIZE] for t in window}
    assert h.block_bytes(decode, 0, 1, [NULL_BLOCK]) == null_bytes, "a READ wrote the null block"
    assert decode.stats.get("loads_finished", 0) == 1
    assert _token_bytes(decode, 1, loaded[1], window) == _token_bytes(
        prefill, 1, remote_window_blocks, window
    ), "decode's window is not prefill's"
