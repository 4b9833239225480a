"""The example model: deterministic whatever the cache layout, and really reading its cache."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from connector.errors import UnsupportedConfiguration
from connector.layout import MemoryLayout
from examples.kv_cache import BlockManager, PagedRequestCache, RankBuffers, build_spec
from examples.model import MAX_POSITIONS, ModelKind, TinyModel, check_tp

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 64, 29)]


def _cache(
    kind: ModelKind,
    *,
    block_size: int = 16,
    kernel_block_size: int = 16,
    tp_size: int = 1,
    layout: MemoryLayout = MemoryLayout.NHD,
    num_tokens: int = 64,
) -> PagedRequestCache:
    spec = build_spec(
        kind,
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        num_blocks=16,
        memory_layout=layout,
    )
    ranks = [RankBuffers(spec, rank, tp_size) for rank in range(tp_size)]
    blocks = BlockManager(spec)
    blocks.allocate("r", PROMPT, 0, num_tokens)
    return PagedRequestCache(spec, kind, ranks, blocks.tables["r"])


def _generate(
    model: TinyModel, cache: PagedRequestCache, prompt: Sequence[int], num_tokens: int
) -> list[int]:
    tokens = list(prompt)
    next_token = -1
    for position, token in enumerate(tokens):
        next_token = model.step(token, position, cache)
    output = []
    for _ in range(num_tokens):
        output.append(next_token)
        next_token = model.step(next_token, len(prompt) + len(output) - 1, cache)
    return output


LAYOUTS = {
    "block8-kernel4-tp2-hnd": dict(
        block_size=8, kernel_block_size=4, tp_size=2, layout=MemoryLayout.HND
    ),
    "block32-kernel8-tp4-nhd": dict(block_size=32, kernel_block_size=8, tp_size=4),
    "block16-kernel16-tp2-nhd": dict(block_size=16, kernel_block_size=16, tp_size=2),
}


@pytest.mark.parametrize("kind", list(ModelKind), ids=[k.value for k in ModelKind])
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_tokens_do_not_depend_on_block_layout_or_tp(kind: ModelKind, layout: dict) -> None:
    model = TinyModel(kind)
    expected = _generate(model, _cache(kind), PROMPT, 6)

    assert _generate(model, _cache(kind, **layout), PROMPT, 6) == expected


@pytest.mark.parametrize("kind", list(ModelKind), ids=[k.value for k in ModelKind])
def test_seed_changes_the_output(kind: ModelKind) -> None:
    outputs = {
        tuple(_generate(TinyModel(kind, seed), _cache(kind), PROMPT, 8)) for seed in (0, 1, 2)
    }

    assert len(outputs) > 1


@pytest.mark.parametrize("kind", list(ModelKind), ids=[k.value for k in ModelKind])
def test_decode_reads_the_prompt_kv_from_the_cache(kind: ModelKind) -> None:
    model = TinyModel(kind)
    expected = _generate(model, _cache(kind), PROMPT, 8)
    cache = _cache(kind)
    _generate(model, cache, PROMPT, 0)
    for rank in cache.ranks:  # garbage in every region: decoding must notice
        for region in rank.regions:
            region.view(np.float32)[:] = (
                np.random.default_rng(3).standard_normal(region.nbytes // 4).astype(np.float32)
            )

    corrupted = [model.step(PROMPT[-1], len(PROMPT) - 1, cache)]
    for _ in range(7):
        corrupted.append(model.step(corrupted[-1], len(PROMPT) + len(corrupted) - 1, cache))

    assert corrupted != expected


class _RecordingCache(PagedRequestCache):
    def __init__(self, base: PagedRequestCache) -> None:
        super().__init__(base.spec, ModelKind.HYBRID_SWA, base.ranks, [list(t) for t in base.table])
        self.reads: list[tuple[int, int, int]] = []

    def read(self, layer: int, start: int, end: int, tp_rank: int) -> tuple:
        self.reads.append((layer, start, end))
        return super().read(layer, start, end, tp_rank)


def test_sliding_window_layers_read_only_the_window() -> None:
    cache = _RecordingCache(_cache(ModelKind.HYBRID_SWA))
    model = TinyModel(ModelKind.HYBRID_SWA)
    for position, token in enumerate(PROMPT[:21]):
        cache.reads.clear()
        model.step(token, position, cache)

    # position 20: full layers 0 and 2 read [0, 21); window-6 layers 1 and 3 read [15, 21)
    assert cache.reads == [(0, 0, 21), (1, 15, 21), (2, 0, 21), (3, 15, 21)]


TP_ERRORS = {
    "dense-tp3": (
        ModelKind.DENSE,
        3,
        "model dense cannot run with tensor-parallel size 3: it "
        "has 8 query heads and 4 KV heads; use a TP size dividing both",
    ),
    "dense-tp8-more-ranks-than-kv-heads": (ModelKind.DENSE, 8, "tensor-parallel size 8"),
    "mla-tp8-more-ranks-than-query-heads": (ModelKind.MLA, 8, "it has 4 query heads"),
}


@pytest.mark.parametrize("kind, tp_size, message", list(TP_ERRORS.values()), ids=list(TP_ERRORS))
def test_unsplittable_tp_is_refused(kind: ModelKind, tp_size: int, message: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=message):
        check_tp(kind, tp_size)


def test_position_beyond_the_model_is_refused() -> None:
    model = TinyModel(ModelKind.DENSE)

    with pytest.raises(UnsupportedConfiguration, match=f"position {MAX_POSITIONS} is outside"):
        model.step(1, MAX_POSITIONS, _cache(ModelKind.DENSE))
