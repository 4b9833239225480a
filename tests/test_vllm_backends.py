"""Block formats from vLLM's attention backends: the table, and whole blocks through vLLM."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.layout import TOKEN_ADDRESSABLE, BlockFormat
from connector.vllm.backends import block_format_for, merge_formats

CPU_VEC = BlockFormat("CPU_ATTN:vec", token_addressable=False, head_chunks=True)


@pytest.mark.parametrize(
    ("backend", "variant", "expected"),
    [
        ("FLASH_ATTN", None, TOKEN_ADDRESSABLE),
        ("FLASHINFER", None, TOKEN_ADDRESSABLE),
        ("TRITON_ATTN", None, TOKEN_ADDRESSABLE),
        ("CPU_ATTN", "vec", CPU_VEC),
        ("CPU_ATTN", "amx", BlockFormat("CPU_ATTN:amx", token_addressable=False, head_chunks=True)),
        ("SOMETHING_NEW", None, BlockFormat("SOMETHING_NEW", token_addressable=False)),
    ],
    ids=["flash-attn", "flashinfer", "triton", "cpu-vec-opaque-head-chunks", "cpu-amx-other-name", "unknown-is-opaque"],
)  # fmt: skip
def test_backend_table(backend: str, variant: str | None, expected: BlockFormat) -> None:
    assert block_format_for(backend, variant) == expected


def test_a_group_of_mixed_backends_is_opaque_under_both_names() -> None:
    assert merge_formats([CPU_VEC, CPU_VEC]) == CPU_VEC
    mixed = merge_formats([TOKEN_ADDRESSABLE, CPU_VEC])
    assert mixed == BlockFormat("CPU_ATTN:vec+tokens", token_addressable=False)


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"),
    reason="vllm is not installed (scripts/install_vllm.sh); CI sets NIXL_PD_REQUIRE_VLLM",
)
BLOCK_SIZE = 16


@pytest.fixture
def engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from tests import vllm_harness as h

    model = h.model_config(h.write_tiny_model(tmp_path))
    built: list[Any] = []

    def make(block_format: BlockFormat, tp_sizes: tuple[int, int] = (1, 1)) -> list[Any]:
        for role, tp_size in zip(("kv_producer", "kv_consumer"), tp_sizes, strict=True):
            config = h.vllm_config(model, kv_role=role, tp_size=tp_size, block_size=BLOCK_SIZE)
            cache = h.kv_cache_config(block_size=BLOCK_SIZE, num_blocks=32, tp_size=tp_size)
            port = h.free_port()
            built.append(
                h.build_engine(role, config, cache, port=port, env=monkeypatch, block_format=block_format)
            )  # fmt: skip
        return built[-2:]

    yield make
    for engine in built:
        engine.shutdown()


def _transfer(prefill: Any, decode: Any, num_tokens: int) -> tuple[list[bytes], list[bytes]]:
    """Prefill a request, fill its whole blocks with noise, load it on decode: both blocks."""

    from tests import vllm_harness as h

    prefill.add(
        h.make_request("r", num_tokens, block_size=BLOCK_SIZE, max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True})
    )  # fmt: skip
    prefill.run_until(lambda e: e.finished("r") is not None)
    params = dict(prefill.finished("r").kv_transfer_params)
    remote = params["remote_block_ids"]
    h.fill_blocks(prefill, remote, seed=3)
    decode.add(h.make_request("r", num_tokens, block_size=BLOCK_SIZE, kv_transfer_params=params))
    loaded = h.run_until_loaded(decode, "r")
    assert decode.stats["loads_failed"] == 0
    return h.block_bytes(prefill, 0, 0, remote[0]), h.block_bytes(decode, 0, 0, loaded[0])


@needs_vllm
@pytest.mark.vllm
def test_an_opaque_format_moves_the_partial_last_block_whole(engines: Any) -> None:
    """CPU_ATTN keeps its own order inside a block: every byte of the last block must move."""
    prefill, decode = engines(CPU_VEC)
    expected, loaded = _transfer(prefill, decode, BLOCK_SIZE + 5)
    assert loaded == expected


@needs_vllm
@pytest.mark.vllm
def test_a_token_addressable_format_moves_only_the_prompt_tokens(engines: Any) -> None:
    """The control: with FLASH_ATTN-like blocks the slots past the prompt stay decode's own."""
    prefill, decode = engines(TOKEN_ADDRESSABLE)
    expected, loaded = _transfer(prefill, decode, BLOCK_SIZE + 5)
    assert loaded[0] == expected[0] and loaded[1] != expected[1]


@needs_vllm
@pytest.mark.vllm
def test_an_unknown_format_refuses_other_tp_sizes_with_the_reason(
    engines: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from tests import vllm_harness as h

    prefill, decode = engines(BlockFormat("unknown", token_addressable=False), tp_sizes=(2, 1))
    prefill.add(
        h.make_request("r", 20, block_size=BLOCK_SIZE, max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True})
    )  # fmt: skip
    prefill.run_until(lambda e: e.finished("r") is not None)
    params = dict(prefill.finished("r").kv_transfer_params)
    decode.add(h.make_request("r", 20, block_size=BLOCK_SIZE, kv_transfer_params=params))
    decode.run_until(lambda e: e.finished("r") is not None)
    assert decode.stats["loads_failed"] == 1
    assert "'unknown' are opaque and cannot be split by head, so decode TP 1" in caplog.text
