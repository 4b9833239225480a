"""Translation of vLLM 0.33's KV cache config and tensors into our KVCacheSpec and regions."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None and not os.environ.get("NIXL_PD_REQUIRE_VLLM"):
    pytest.skip(
        "vllm is not installed (scripts/install_vllm.sh); CI sets NIXL_PD_REQUIRE_VLLM",
        allow_module_level=True,
    )

from vllm.config import CacheConfig, DeviceConfig, VllmConfig  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from connector.errors import UnsupportedConfiguration  # noqa: E402
from connector.geometry import build_rank_layout  # noqa: E402
from connector.layout import GroupKind, MemoryLayout  # noqa: E402
from connector.vllm.layout import (  # noqa: E402
    kernel_block_sizes_of,
    kv_cache_spec_from_vllm,
    memory_layout_of,
    region_addresses,
)

pytestmark = pytest.mark.vllm


_F32 = torch.float32


def _cache(*specs: Any, num_blocks: int = 8) -> Any:
    groups = [KVCacheGroupSpec([f"g{i}.l0", f"g{i}.l1"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _translate(cache: Any, *, tp_size: int = 1, kernels: tuple[int, ...] | None = None) -> Any:
    return kv_cache_spec_from_vllm(
        cache,
        model="m",
        dtype="float32",
        cache_dtype="float32",
        model_kv_heads=4,
        tp_size=tp_size,
        memory_layout=MemoryLayout.NHD_PACKED,
        kernel_block_sizes=kernels,
    )


_FULL = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=_F32)


@pytest.mark.parametrize(
    ("vllm_spec", "kind", "heads", "head_dim", "planes", "window"),
    [
        (_FULL, GroupKind.FULL, 4, 8, 2, None),
        (
            SlidingWindowSpec(
                block_size=16, num_kv_heads=4, head_size=8, dtype=_F32, sliding_window=64
            ),
            GroupKind.SLIDING_WINDOW,
            4,
            8,
            2,
            64,
        ),
        (
            MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=24, dtype=_F32),
            GroupKind.MLA,
            1,
            24,
            1,
            None,
        ),
        (
            MambaSpec(block_size=16, shapes=((3, 4), (5,)), dtypes=(_F32, _F32)),
            GroupKind.SSM,
            1,
            68,
            1,
            None,
        ),
    ],
    ids=["full-attention", "sliding-window", "mla-latent", "mamba-state-as-bytes"],
)
def test_group_kinds_translate(
    vllm_spec: Any, kind: GroupKind, heads: int, head_dim: int, planes: int, window: Any
) -> None:
    (group,) = _translate(_cache(vllm_spec)).groups
    assert (group.kind, group.window, group.num_blocks) == (kind, window, 8)
    shapes = {(layer.num_kv_heads, layer.head_dim, layer.num_planes) for layer in group.layers}
    if kind is GroupKind.SSM:
        assert shapes == {(1, 68, 1)}  # 3*4 + 5 float32 elements = 68 bytes; tp 1: one "head"
    else:
        assert shapes == {(heads, head_dim, planes)}


def test_per_rank_heads_become_model_heads_and_kernel_sizes_apply() -> None:
    per_rank = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=_F32)
    (group,) = _translate(_cache(per_rank), tp_size=2, kernels=(8,)).groups
    assert {layer.num_kv_heads for layer in group.layers} == {4}
    assert (group.block_size, group.kernel_block_size) == (16, 8)


@pytest.mark.parametrize(
    ("rank_heads", "model_heads", "tp_size", "model_wide"),
    [(2, 4, 2, 4), (1, 2, 4, 2), (4, 12, 1, 4), (1, 12, 2, 2), (2, 2, 4, 8)],
    ids=[
        "sharded: 2 per rank over TP 2",
        "replicated: TP 4 over 2 model heads, 1 per rank",
        "a hand-made cache with fewer heads than the model (vLLM's unit tests)",
        "a hand-made cache with 1 head per rank over TP 2",
        "more than 1 head per rank although TP exceeds the model's heads",
    ],
)
def test_the_cache_spec_is_the_truth_for_heads(
    rank_heads: int, model_heads: int, tp_size: int, model_wide: int
) -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=rank_heads, head_size=8, dtype=_F32)
    translated = kv_cache_spec_from_vllm(
        _cache(spec),
        model="m",
        dtype="float32",
        cache_dtype="float32",
        model_kv_heads=model_heads,
        tp_size=tp_size,
        memory_layout=MemoryLayout.NHD_PACKED,
    )
    assert {layer.num_kv_heads for layer in translated.groups[0].layers} == {model_wide}


@pytest.mark.parametrize(
    ("vllm_spec", "tp_size", "message"),
    [
        (
            FullAttentionSpec(
                block_size=16, num_kv_heads=4, head_size=8, head_size_v=4, dtype=_F32
            ),
            1,
            "head_size_v=4 differs from head_size=8",
        ),
        (
            ChunkedLocalAttentionSpec(
                block_size=16, num_kv_heads=4, head_size=8, dtype=_F32, attention_chunk_size=32
            ),
            1,
            "ChunkedLocalAttentionSpec, which NixlPDConnector cannot transfer",
        ),
    ],
    ids=["different-k-and-v-head-sizes", "unsupported-spec-class"],
)
def test_unsupported_vllm_configs_are_refused(vllm_spec: Any, tp_size: int, message: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=re.escape(message)):
        _translate(_cache(vllm_spec), tp_size=tp_size)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("LBNHC", MemoryLayout.NHD_PACKED),
        ("LBHNC", MemoryLayout.HND_PACKED),
        ("BLNHC", MemoryLayout.BLOCK_NHD_PACKED),
        ("BLHNC", MemoryLayout.BLOCK_HND_PACKED),
        (None, None),
    ],
    ids=["tokens-outer", "heads-outer", "blocks-outer-tokens", "blocks-outer-heads", "default"],
)
def test_vllm_layout_names(name: str | None, expected: MemoryLayout | None) -> None:
    assert memory_layout_of(name) is (expected or MemoryLayout.NHD_PACKED)


@pytest.mark.parametrize("name", ["BHLNC", "LHBNC"])
def test_layouts_with_heads_outside_layers_or_blocks_are_refused(name: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=f"layout '{name}' is not supported"):
        memory_layout_of(name)


@pytest.mark.parametrize(
    ("num_kernel_blocks", "expected"),
    [(8, (16,)), (16, (8,)), (32, (4,))],
    ids=["kernel-equals-block", "two-kernel-blocks-per-block", "four-kernel-blocks-per-block"],
)
def test_kernel_block_size_read_off_tensors(num_kernel_blocks: int, expected: tuple) -> None:
    tensors = {name: torch.zeros(num_kernel_blocks, 4) for name in ("g0.l0", "g0.l1")}
    assert kernel_block_sizes_of(_cache(_FULL), tensors) == expected


def test_kernel_block_size_that_is_not_a_split_is_refused() -> None:
    tensors = {name: torch.zeros(12, 4) for name in ("g0.l0", "g0.l1")}
    with pytest.raises(UnsupportedConfiguration, match="12 kernel blocks for 8 blocks"):
        kernel_block_sizes_of(_cache(_FULL), tensors)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"g0.l0": torch.zeros(8, 4096, dtype=torch.uint8)}, "no tensor for layer 'g0.l1'"),
        (
            {name: torch.zeros(8, 100, dtype=torch.uint8) for name in ("g0.l0", "g0.l1")},
            "spans 800 bytes",
        ),
    ],
    ids=["missing-layer", "wrong-size-region"],
)
def test_region_addresses_check_the_tensors(tensors: dict, message: str) -> None:
    spec = _translate(_cache(_FULL))
    with pytest.raises(UnsupportedConfiguration, match=message):
        region_addresses(build_rank_layout(spec, 0, 1), spec, tensors)


@pytest.mark.parametrize("vllm_layout", ["LBNHC", "LBHNC"])
def test_our_packed_geometry_matches_vllm_kv_cache_views(vllm_layout: str) -> None:
    """Write K and V through vLLM's own per-layer views; read them back through our planes."""
    block_size, kernel, num_blocks = 16, 8, 4
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=4, dtype=_F32)
    page_bytes = spec.page_size_bytes
    raw = torch.zeros(2 * page_bytes * num_blocks, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=["g0.l0", "g0.l1"],
        layer_stride=page_bytes * num_blocks,
        block_stride=page_bytes,
    )
    views = create_kv_cache_views(
        raw, spec, num_blocks, KVCacheLayout[vllm_layout], tensor, kernel_block_size=kernel
    )
    for layer, view in enumerate(views):  # [kernel blocks, heads, tokens, K|V]
        values = torch.arange(view.numel(), dtype=_F32).reshape(view.shape) + 1000 * layer
        view.copy_(values)
    ours = kv_cache_spec_from_vllm(
        _cache(spec, num_blocks=num_blocks),
        model="m",
        dtype="float32",
        cache_dtype="float32",
        model_kv_heads=2,
        tp_size=1,
        memory_layout=memory_layout_of(vllm_layout),
        kernel_block_sizes=(kernel,),
    )
    layout = build_rank_layout(ours, 0, 1)
    base = raw.data_ptr()
    addresses = [view.data_ptr() - base for view in views]
    flat = raw.view(_F32)
    for plane in layout.groups[0].planes:
        view = views[plane.layer]
        for block, head, token in [(0, 0, 0), (1, 1, 3), (7, 1, 7), (5, 0, 2)]:
            offset = (
                addresses[plane.region]
                + plane.offset_bytes
                + block * plane.kernel_block_stride_bytes
                + token * plane.token_stride_bytes
                + head * plane.head_stride_bytes
            )
            ours_value = flat[offset // 4 : offset // 4 + 4]
            theirs = view[block, head, token, plane.plane * 4 : plane.plane * 4 + 4]
            assert torch.equal(ours_value, theirs), (plane, block, head, token)


def _fp8(
    spec_class: Any = FullAttentionSpec,
    mode: KVQuantMode = KVQuantMode.FP8_PER_TENSOR,
    **fields: Any,
) -> Any:
    """A vLLM cache spec as its FP8 attention layers publish it: uint8 elements."""
    return spec_class(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.uint8, kv_quant_mode=mode, **fields)  # fmt: skip


def _translate_fp8(
    vllm_spec: Any, cache_dtype: str = "fp8", kv_scales: Any = None, **options: Any
) -> Any:
    return kv_cache_spec_from_vllm(
        _cache(vllm_spec, num_blocks=options.pop("num_blocks", 8)),
        model="m",
        dtype="float32",
        cache_dtype=cache_dtype,
        model_kv_heads=2,
        tp_size=1,
        memory_layout=options.pop("memory_layout", MemoryLayout.HND_PACKED),
        kv_scales=kv_scales,
        **options,
    )


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_per_tensor_translates_to_one_byte_elements_with_scales(cache_dtype: str) -> None:
    scales = {"g0.l0": (0.5, 2.0), "g0.l1": (1.0, 1.0)}
    spec = _translate_fp8(_fp8(), cache_dtype, scales)
    assert spec.cache_dtype == cache_dtype
    layers = spec.groups[0].layers
    assert [(layer.dtype_bytes, layer.kv_scales) for layer in layers] == [
        (1, (0.5, 2.0)),
        (1, (1.0, 1.0)),
    ]
    assert build_rank_layout(spec, 0, 1).groups[0].planes[0].head_bytes == 32


def test_fp8_scales_unknown_on_the_scheduler_and_required_on_workers() -> None:
    assert {layer.kv_scales for layer in _translate_fp8(_fp8()).groups[0].layers} == {None}
    with pytest.raises(UnsupportedConfiguration, match=r"layers \['g0.l1'\] have no k_scale"):
        _translate_fp8(_fp8(), kv_scales={"g0.l0": (1.0, 1.0)})


@pytest.mark.parametrize(
    ("vllm_spec", "cache_dtype", "message"),
    [
        (_fp8(mode=KVQuantMode.FP8_PER_TOKEN_HEAD), "fp8_per_token_head", "KV cache quantization FP8_PER_TOKEN_HEAD (--kv-cache-dtype fp8_per_token_head), whose scales or packed codes live beside the K/V values"),
        (_fp8(mode=KVQuantMode.INT8_PER_TOKEN_HEAD), "int8_per_token_head", "INT8_PER_TOKEN_HEAD"),
        (_fp8(mode=KVQuantMode.NVFP4), "nvfp4", "NVFP4"),
        (_fp8(mode=KVQuantMode.TURBOQUANT_K8V4), "turboquant_k8v4", "TURBOQUANT_K8V4"),
        (_fp8(MLAAttentionSpec), "fp8_ds_mla", "KV cache dtype 'fp8_ds_mla' (FP8_PER_TENSOR), not one of fp8, fp8_e4m3, fp8_e5m2"),
    ],
    ids=["fp8-per-token-head", "int8-per-token-head", "nvfp4-block-scales", "turboquant-packed", "fp8-ds-mla-scales-in-page"],
)  # fmt: skip
def test_quantized_modes_with_scales_beside_pages_are_refused_by_name(
    vllm_spec: Any, cache_dtype: str, message: str
) -> None:
    with pytest.raises(UnsupportedConfiguration, match=re.escape(message)):
        _translate_fp8(vllm_spec, cache_dtype)


def test_fp8_geometry_matches_vllm_kv_cache_views_byte_for_byte() -> None:
    """vLLM's CPU layout (LBHNC) of a uint8 cache: our planes address its K|V bytes."""
    num_blocks, kernel = 4, 8
    spec = _fp8()
    page_bytes = spec.page_size_bytes
    raw = torch.zeros(page_bytes * num_blocks, dtype=torch.uint8)
    tensor = KVCacheTensor(size=raw.numel(), layers=["g0.l0"], layer_stride=raw.numel(), block_stride=page_bytes)  # fmt: skip
    (view,) = create_kv_cache_views(
        raw, spec, num_blocks, KVCacheLayout.LBHNC, tensor, kernel_block_size=kernel
    )
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))  # fmt: skip
    ours = _translate_fp8(spec, num_blocks=num_blocks, kernel_block_sizes=(kernel,))
    for plane in build_rank_layout(ours, 0, 1).groups[0].planes[:2]:
        for block, head, token in [(0, 0, 0), (1, 1, 3), (7, 1, 7), (5, 0, 2)]:
            offset = (
                plane.offset_bytes
                + block * plane.kernel_block_stride_bytes
                + token * plane.token_stride_bytes
                + head * plane.head_stride_bytes
            )
            theirs = view[block, head, token, plane.plane * 32 : (plane.plane + 1) * 32]
            assert torch.equal(raw[offset : offset + plane.head_bytes], theirs)


def _vllm_planned(
    layout_name: str, groups: list[Any], *, num_blocks: int = 6, kernel: int | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The cache config and per-layer views vLLM's own planner and allocator make."""
    config = VllmConfig(
        cache_config=CacheConfig(block_size=16, num_gpu_blocks_override=num_blocks),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.kv_cache_layout = layout_name
    cache = get_kv_cache_config_from_groups(config, groups, 1 << 30)
    cache.kv_cache_layout = layout_name  # as vLLM's engine core records it
    kernels = None if kernel is None else [kernel] * len(groups)
    tensors = allocate_kv_cache(cache, torch.device("cpu"), KVCacheLayout[layout_name], kernels)
    return cache, tensors


def _our_view(cache: Any, tensors: dict[str, torch.Tensor], layout_name: str) -> Any:
    spec = kv_cache_spec_from_vllm(
        cache,
        model="m",
        dtype="float32",
        cache_dtype="float32",
        model_kv_heads=2,
        tp_size=1,
        memory_layout=memory_layout_of(layout_name),
        kernel_block_sizes=kernel_block_sizes_of(cache, tensors),
    )
    layout = build_rank_layout(spec, 0, 1)
    return spec, layout, region_addresses(layout, spec, tensors)


_HYBRID = [
    KVCacheGroupSpec(
        ["full.0", "full.1", "full.2"],
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=4, dtype=_F32),
    ),
    KVCacheGroupSpec(
        ["window.0"],
        SlidingWindowSpec(
            block_size=16, num_kv_heads=2, head_size=4, dtype=_F32, sliding_window=32
        ),
    ),
]


@pytest.mark.parametrize("layout_name", ["BLNHC", "BLHNC"])
def test_block_outermost_geometry_matches_vllm_planned_rows(layout_name: str) -> None:
    """vLLM plans one buffer whose row per block holds all 3 full-attention pages; the
    one-layer sliding-window group aliases the same rows, padded to the same stride. Values
    written through vLLM's views are found where our planes say, in both groups."""
    cache, tensors = _vllm_planned(layout_name, _HYBRID)
    spec, layout, addresses = _our_view(cache, tensors, layout_name)
    row_bytes = 3 * 16 * 2 * 8 * 4  # 3 layers x 16 tokens x 2 heads x (K|V of 4 floats)
    assert spec.block_stride_bytes == row_bytes
    # One region for both groups (registering aliased memory twice crashes real NIXL's
    # deregistration): vLLM's buffer, whose rows both groups' views stride over.
    assert layout.region_bytes == (6 * row_bytes,)
    assert addresses == (tensors["full.0"].data_ptr(),) == (tensors["window.0"].data_ptr(),)
    for name, view in tensors.items():
        values = torch.arange(view.numel(), dtype=_F32).reshape(view.shape)
        view.copy_(values + 1000 * list(tensors).index(name))
    for group_index, group in enumerate(spec.groups):
        for plane in layout.groups[group_index].planes:
            view = tensors[group.layers[plane.layer].name]
            for block, head, token in [(0, 0, 0), (1, 1, 3), (5, 1, 15), (3, 0, 9)]:
                address = (
                    addresses[plane.region]
                    + plane.offset_bytes
                    + block * plane.kernel_block_stride_bytes
                    + token * plane.token_stride_bytes
                    + head * plane.head_stride_bytes
                )
                ours = _floats_at(address, 4)
                theirs = view[block, head, token, plane.plane * 4 : plane.plane * 4 + 4]
                assert torch.equal(ours, theirs), (group_index, plane, block, head, token)


def _floats_at(address: int, count: int) -> torch.Tensor:
    buffer = (ctypes.c_float * count).from_address(address)
    return torch.tensor(list(buffer), dtype=_F32)


def test_block_outermost_kernel_split_of_a_single_layer() -> None:
    """vLLM splits blocks into kernel blocks in a block-outermost layout only when a row is
    one layer's dense page: kernel block k of the row sits k * page / ratio further."""
    single = [
        KVCacheGroupSpec(
            ["full.0"], FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=4, dtype=_F32)
        )
    ]
    cache, tensors = _vllm_planned("BLHNC", single, kernel=8)
    spec, layout, _ = _our_view(cache, tensors, "BLHNC")
    (plane, _) = layout.groups[0].planes
    assert spec.groups[0].kernel_block_size == 8
    assert plane.kernel_block_stride_bytes == tensors["full.0"].stride(0) * 4 == 8 * 2 * 8 * 4


@pytest.mark.parametrize(
    ("layout_name", "message"),
    [("BLNHC", "view does not stride as our block-outermost layout"), ("LBNHC", "spans")],
    ids=["rows-expected-layer-tensors-given", "dense-expected-rows-given"],
)
def test_views_that_disagree_with_the_reported_layout_are_refused(
    layout_name: str, message: str
) -> None:
    """The engine says one layout but its tensors are laid out in the other."""
    other = "LBNHC" if layout_name == "BLNHC" else "BLNHC"
    cache, _ = _vllm_planned(layout_name, _HYBRID[:1])
    _, tensors = _vllm_planned(other, _HYBRID[:1])
    with pytest.raises(UnsupportedConfiguration, match=message):
        _our_view(cache, tensors, layout_name)


def test_device_tensors_are_not_refused_by_the_layout() -> None:
    """Which memory a region is (host or GPU) is decided elsewhere (connector/vllm/devices.py);
    the layout translation takes any device's tensor as its data_ptr()."""
    spec = _translate(_cache(_FULL))
    layout = build_rank_layout(spec, 0, 1)
    dense = {
        name: torch.empty(layout.region_bytes[0] // 4, dtype=_F32, device="meta")
        for name in ("g0.l0", "g0.l1")
    }
    assert region_addresses(layout, spec, dense) == (0, 0)  # meta tensors have no address


def test_block_outermost_mla_latents_sit_in_rows() -> None:
    """An MLA group in BLNHC: each row holds every layer's latent page, one "head" each."""
    mla = [
        KVCacheGroupSpec(
            ["mla.0", "mla.1"],
            MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=12, dtype=_F32),
        )
    ]
    cache, tensors = _vllm_planned("BLNHC", mla)
    spec, layout, addresses = _our_view(cache, tensors, "BLNHC")
    assert spec.groups[0].kind is GroupKind.MLA
    first, second = layout.groups[0].planes
    assert (first.offset_bytes, second.offset_bytes) == (0, 16 * 12 * 4)
    assert first.kernel_block_stride_bytes == 2 * 16 * 12 * 4
    tensors["mla.1"][4, 0, 7] = torch.arange(12, dtype=_F32)
    address = addresses[0] + second.offset_bytes + 4 * second.kernel_block_stride_bytes
    assert torch.equal(_floats_at(address + 7 * second.token_stride_bytes, 12), torch.arange(12.0))


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4, 8, 16])
def test_model_wide_heads_follow_the_planners_head_placement(tp_size: int) -> None:
    """One head-placement rule: for every model head count vLLM can shard or replicate, the
    model-wide count the adapter reports puts back on each rank exactly what vLLM gave it."""
    from connector.geometry import heads_per_rank
    from connector.vllm.layout import _model_wide_heads

    for model_heads in range(1, 65):
        if model_heads % tp_size and tp_size % model_heads:
            continue  # vLLM refuses such a TP size itself
        rank_heads = max(model_heads // tp_size, 1)  # what vLLM's cache spec holds per rank
        wide = _model_wide_heads(rank_heads, model_heads, tp_size)
        assert heads_per_rank(wide, tp_size) == rank_heads, (model_heads, wide)
        assert wide == (model_heads if tp_size > model_heads else rank_heads * tp_size)


def _padded_mamba_views(num_blocks: int) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
    """vLLM's own views of a Mamba group whose 68-byte states sit in 128-byte padded pages."""
    spec = MambaSpec(
        block_size=16, shapes=((3, 4), (5,)), dtypes=(_F32, _F32), page_size_padded=128
    )
    raw = torch.zeros(2 * 128 * num_blocks, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=raw.numel(), layers=["g0.l0", "g0.l1"], layer_stride=128 * num_blocks, block_stride=128
    )
    views = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBNHC, tensor)
    return _cache(spec, num_blocks=num_blocks), dict(zip(tensor.layers, views, strict=True)), raw


def test_padded_state_pages_translate_to_content_and_page_stride() -> None:
    """Each block's 68 bytes of state, 128 bytes apart: our plane addresses exactly vLLM's
    view of block k, and the 60 bytes of padding after it are no part of the state."""
    cache, views, raw = _padded_mamba_views(num_blocks=4)
    spec = _translate(cache)
    layout = build_rank_layout(spec, 0, 1)
    addresses = region_addresses(layout, spec, views)

    assert spec.groups[0].page_stride_bytes == 128
    assert {layer.head_dim for layer in spec.groups[0].layers} == {68}
    assert layout.region_bytes == (4 * 128, 4 * 128)
    for view in views.values():
        view.copy_(torch.randint(-128, 127, view.shape, dtype=torch.int8))
    base = raw.data_ptr()
    flat = raw.view(torch.uint8)
    for plane in layout.groups[0].planes:
        view = views[spec.groups[0].layers[plane.layer].name]
        for block in range(4):
            start = addresses[plane.region] - base + block * plane.kernel_block_stride_bytes
            ours = flat[start : start + plane.head_bytes]
            assert torch.equal(ours, view[block].reshape(-1).view(torch.uint8)), (plane, block)


def test_padded_pages_split_into_kernel_blocks_are_refused() -> None:
    padded = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=8, dtype=_F32, page_size_padded=8192
    )
    with pytest.raises(UnsupportedConfiguration, match="padded pages .* split into kernel"):
        _translate(_cache(padded), kernels=(8,))


def test_a_view_that_strides_past_its_padded_page_is_refused() -> None:
    cache, views, _ = _padded_mamba_views(num_blocks=4)
    spec = _translate(cache)
    dense = {name: torch.zeros(4, 1, 1, 68, dtype=torch.int8) for name in views}  # no padding
    with pytest.raises(UnsupportedConfiguration, match="block stride 68 != 128 bytes"):
        region_addresses(build_rank_layout(spec, 0, 1), spec, dense)


def test_vllms_own_fp8_attention_layers_translate_with_their_scales(tmp_path: Any) -> None:
    """Attention layers vLLM builds for --kv-cache-dtype fp8 (the CPU backend): their cache
    spec is uint8 FP8_PER_TENSOR, and the worker reads each layer's host scales."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from connector.vllm.scales import kv_scales_of
    from tests import vllm_harness as h

    model = h.model_config(h.write_tiny_model(tmp_path))
    config = h.vllm_config(model, kv_role="kv_producer", tp_size=1, block_size=16)
    config.cache_config.cache_dtype = "fp8"
    with set_current_vllm_config(config):
        layers = [
            Attention(
                4,
                32,
                0.1,
                num_kv_heads=2,
                cache_config=config.cache_config,
                prefix=f"g0.l{i}",
                attn_backend=CPUAttentionBackend,
            )  # fmt: skip
            for i in range(2)
        ]
    layers[1]._k_scale_float = 0.5  # as a checkpoint's k_scale would set it
    cache = _cache(layers[0].get_kv_cache_spec(config))

    spec = _translate_fp8(
        cache.kv_cache_groups[0].kv_cache_spec, kv_scales=kv_scales_of(config, cache)
    )

    assert [(layer.dtype_bytes, layer.kv_scales) for layer in spec.groups[0].layers] == [
        (1, (1.0, 1.0)),
        (1, (0.5, 1.0)),
    ]
