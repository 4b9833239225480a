"""vLLM's block-outermost KV layouts (BLNHC, BLHNC) through vLLM 0.33's real Scheduler path.

Each engine's KV cache is planned by vLLM's own planner (``get_kv_cache_config_from_groups``:
one buffer, a row per block holding every layer's page, groups aliasing the same rows) and
allocated by vLLM's own allocator (``allocate_kv_cache``: one strided view per layer), then
registered through NixlPDConnector.register_kv_caches as a model runner would. Bytes move with
FakeNixl. Block contents are compared through the views, in vLLM's logical [H, N, C] order, so
engines of different layouts compare equal when they hold the same KV.

What this does not prove: vLLM's CPU attention backend supports only LBHNC, so no attention
kernel reads these layouts here (FLASH_ATTN and FlashInfer on GPUs do); the views are vLLM's.
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

import torch  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from connector.layout import MemoryLayout  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
NUM_BLOCKS = 48


def _vllm_allocation(cache_config: Any) -> dict[str, torch.Tensor]:
    """What vLLM's model runner hands register_kv_caches: its own allocator's views."""
    layout = KVCacheLayout[cache_config.kv_cache_layout]
    return allocate_kv_cache(cache_config, torch.device("cpu"), layout)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return h.model_config(h.write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama"))))


@pytest.fixture
def make_pair(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """(prefill, decode) engines whose caches vLLM planned and allocated in the named layouts."""
    monkeypatch.setattr(h, "allocate_kv_caches", _vllm_allocation)
    engines: list[h.Engine] = []

    def make(
        layouts: tuple[str, str],
        *,
        tp_sizes: tuple[int, int] = (1, 1),
        window: int | None = None,
        real_nixl: bool = False,
    ) -> tuple[h.Engine, h.Engine]:
        if real_nixl:  # the harness names its agent class; real NIXL stands in for it
            from worker.nixl_real import RealNixlAgent

            monkeypatch.setattr(h, "RecordingFakeNixl", RealNixlAgent)
        roles = (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        for (name, role), layout, tp_size in zip(roles, layouts, tp_sizes, strict=True):
            config = h.vllm_config(model, kv_role=role, tp_size=tp_size)
            config.cache_config.kv_cache_layout = layout  # resolved, as the engine core records
            config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
            groups = h.kv_cache_config(
                block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, window=window, tp_size=tp_size
            ).kv_cache_groups
            cache = get_kv_cache_config_from_groups(config, groups, 1 << 30)
            cache.kv_cache_layout = layout
            engines.append(h.build_engine(name, config, cache, port=h.free_port(), env=monkeypatch))
        return engines[-2], engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


def _prefill(prefill: h.Engine, request_id: str, num_tokens: int) -> dict[str, Any]:
    return h.prefill_for_decode(prefill, request_id, num_tokens, block_size=BLOCK_SIZE)


def _load(decode: h.Engine, request_id: str, num_tokens: int, params: dict) -> list[list[int]]:
    """Decode loads the request; returns its block ids once the KV arrived."""
    decode.add(
        h.make_request(
            request_id, num_tokens, block_size=BLOCK_SIZE, kv_transfer_params=params, max_tokens=2
        )
    )
    loaded = h.run_until_loaded(decode, request_id)
    return loaded


@pytest.mark.parametrize(
    "layouts",
    [
        ("BLNHC", "BLNHC"),
        ("BLHNC", "BLHNC"),
        ("LBNHC", "BLHNC"),
        ("BLNHC", "LBHNC"),
    ],
    ids=[
        "blnhc-to-blnhc",
        "blhnc-to-blhnc",
        "layer-outermost-prefill-to-block-outermost-decode",
        "block-outermost-prefill-to-layer-outermost-decode",
    ],
)
def test_decode_holds_the_prefill_bytes_and_both_sides_free(
    make_pair: Any, layouts: tuple[str, str]
) -> None:
    prefill, decode = make_pair(layouts)
    expected_layouts = [MemoryLayout.BLOCK_NHD_PACKED, MemoryLayout.BLOCK_HND_PACKED]
    if layouts[1].startswith("BL"):
        assert decode.connector.kv_cache_spec().memory_layout in expected_layouts
    num_tokens = 3 * BLOCK_SIZE - 5  # a partial last block
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    params = _prefill(prefill, "req-1", num_tokens)
    h.fill_blocks(prefill, params["remote_block_ids"], seed=5)
    expected = h.block_bytes(prefill, 0, 0, params["remote_block_ids"][0][:2])
    loaded = _load(decode, "req-1", num_tokens, params)
    assert h.block_bytes(decode, 0, 0, loaded[0][:2]) == expected
    decode.run_until(lambda e: e.finished("req-1") is not None)
    assert decode.stats["loads_finished"] == 1 and decode.stats["loads_failed"] == 0
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


@pytest.mark.parametrize(
    "tp_sizes", [(1, 2), (2, 1)], ids=["prefill-tp1-decode-tp2", "prefill-tp2-decode-tp1"]
)
@pytest.mark.parametrize("layout", ["BLNHC", "BLHNC"])
def test_tensor_parallel_pairs_move_every_head(
    make_pair: Any, layout: str, tp_sizes: tuple[int, int]
) -> None:
    prefill, decode = make_pair((layout, layout), tp_sizes=tp_sizes)
    num_tokens = 2 * BLOCK_SIZE
    params = _prefill(prefill, "req-tp", num_tokens)
    blocks = params["remote_block_ids"][0][:2]
    h.fill_blocks(prefill, [blocks], seed=3)
    expected = h.heads_bytes(prefill, blocks)
    loaded = _load(decode, "req-tp", num_tokens, params)
    assert h.heads_bytes(decode, loaded[0][:2]) == expected


# One more than a block: with the back-off (1 for a sliding window) decode loads 64 of 65
# tokens and reads the window of token 64, [48, 64): block 3 whole, blocks 0-2 freed.
WINDOW = BLOCK_SIZE + 1


def test_hybrid_groups_share_block_rows(make_pair: Any) -> None:
    """Full attention and sliding window groups alias one buffer's rows (vLLM's HMA with a
    block-outermost layout): each group's bytes land in its own blocks, nothing else moves."""
    prefill, decode = make_pair(("BLNHC", "BLNHC"), window=WINDOW)
    views = decode.kv_caches[0]
    assert views["layers.0"].data_ptr() == views["layers.1"].data_ptr(), "groups share rows"
    assert views["layers.0"].stride(0) * 4 == 2 * BLOCK_SIZE * h.MODEL_KV_HEADS * h.HEAD_SIZE * 4
    num_tokens = 4 * BLOCK_SIZE + 1  # backed off by one: 64 loaded, token 64 sees [48, 64]
    params = _prefill(prefill, "req-h", num_tokens)
    full, sliding = params["remote_block_ids"]
    h.fill_blocks(prefill, [full, sliding[3:]], seed=9)
    assert sliding[:3] == [0, 0, 0], "blocks before the window are vLLM's null"
    expected = [h.block_bytes(prefill, 0, 0, full[:4]), h.block_bytes(prefill, 0, 1, sliding[3:4])]
    loaded = _load(decode, "req-h", num_tokens, params)
    got = [h.block_bytes(decode, 0, 0, loaded[0][:4]), h.block_bytes(decode, 0, 1, loaded[1][3:4])]
    assert got == expected


@pytest.mark.real_nixl
def test_hybrid_rows_over_real_nixl(make_pair: Any) -> None:
    """The same hybrid engines with real NIXL agents (UCX on loopback): the aliased group
    regions register and the READs land in both groups."""
    prefill, decode = make_pair(("BLHNC", "BLHNC"), window=WINDOW, real_nixl=True)
    num_tokens = 4 * BLOCK_SIZE + 1
    free_prefill, free_decode = prefill.num_free_blocks(), decode.num_free_blocks()
    params = _prefill(prefill, "req-r", num_tokens)
    full, sliding = params["remote_block_ids"]
    h.fill_blocks(prefill, [full, sliding[3:]], seed=21)
    expected = [h.block_bytes(prefill, 0, 0, full[:3]), h.block_bytes(prefill, 0, 1, sliding[3:4])]
    loaded = _load(decode, "req-r", num_tokens, params)
    got = [h.block_bytes(decode, 0, 0, loaded[0][:3]), h.block_bytes(decode, 0, 1, loaded[1][3:4])]
    assert got == expected
    decode.run_until(lambda e: e.finished("req-r") is not None)
    prefill.run_until(lambda e: e.num_free_blocks() == free_prefill)
    decode.run_until(lambda e: e.num_free_blocks() == free_decode)


def test_prefix_hit_reads_only_the_uncached_suffix(make_pair: Any) -> None:
    prefill, decode = make_pair(("BLHNC", "BLHNC"))
    num_tokens = 3 * BLOCK_SIZE
    first = _prefill(prefill, "first", num_tokens)
    h.fill_blocks(prefill, first["remote_block_ids"], seed=11)
    _load(decode, "first", num_tokens, first)
    decode.run_until(lambda e: e.finished("first") is not None)

    second = _prefill(prefill, "second", num_tokens)  # the same prompt, new bytes everywhere
    h.fill_blocks(prefill, second["remote_block_ids"], seed=12)
    prefill_bytes = h.block_bytes(prefill, 0, 0, second["remote_block_ids"][0])
    decode_bytes = h.block_bytes(decode, 0, 0, _load(decode, "second", num_tokens, second)[0][:3])
    assert decode_bytes[2] == prefill_bytes[2], "the uncached last block was not loaded"
    assert decode_bytes[:2] != prefill_bytes[:2], "cached blocks were overwritten by a READ"
