"""Translate vLLM 0.33's KV cache configuration and tensors into our KVCacheSpec and regions.

vLLM describes the cache as groups of layers sharing a block table (``KVCacheConfig``), each
with a spec class (full attention, sliding window, MLA, Mamba) whose head counts are already
per TP rank. Each layer's tensor is a logical ``[kernel blocks, H, N, C]`` view in which the
cell C packs K then V (``head_size + head_size_v`` elements); the engine's layout says whether
tokens or heads come first in memory (LBNHC, LBHNC: one dense region per layer) and whether
blocks are outermost (BLNHC, BLHNC: one buffer whose row per block holds every layer's page,
each layer's view striding over the rows). Only vLLM's own modules import this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from connector.errors import UnsupportedConfiguration
from connector.geometry import heads_per_rank
from connector.layout import (
    TOKEN_ADDRESSABLE,
    BlockFormat,
    GroupGeometry,
    GroupKind,
    GroupSpec,
    KVCacheSpec,
    LayerSpec,
    MemoryLayout,
    PlaneGeometry,
    RankLayout,
)

# vLLM layout name -> ours. Not translated: LHBNC (heads outside blocks) and BHLNC (heads
# outside layers inside a block row), which no backend prefers.
VLLM_LAYOUTS: dict[str, MemoryLayout] = {
    "LBNHC": MemoryLayout.NHD_PACKED,
    "LBHNC": MemoryLayout.HND_PACKED,
    "BLNHC": MemoryLayout.BLOCK_NHD_PACKED,
    "BLHNC": MemoryLayout.BLOCK_HND_PACKED,
}
DEFAULT_VLLM_LAYOUT = "LBNHC"  # what vLLM picks when the backend has no preference


def memory_layout_of(vllm_layout: str | None) -> MemoryLayout:
    """Our MemoryLayout for vLLM's layout name (None: vLLM's default, LBNHC)."""
    name = vllm_layout or DEFAULT_VLLM_LAYOUT
    layout = VLLM_LAYOUTS.get(name)
    if layout is None:
        raise UnsupportedConfiguration(
            f"vLLM KV cache layout {name!r} is not supported by NixlPDConnector; supported: "
            f"{', '.join(sorted(VLLM_LAYOUTS))}; set VLLM_KV_CACHE_LAYOUT to one of them "
            "(BLNHC or BLHNC keep a block of every layer in one span: the fewest descriptors)"
        )
    return layout


def block_stride_bytes_of(
    kv_cache_config: KVCacheConfig, memory_layout: MemoryLayout
) -> int | None:
    """Block-outermost layouts: the bytes between logical block rows that vLLM planned.

    vLLM sizes every group's row like its largest group's (and rounds it to the kernels'
    alignment), so the row can be longer than a group's own pages. None where the layout is
    layer-outermost or the config carries no tensors (the scheduler's hand-made configs).
    """
    if not memory_layout.block_outermost:
        return None
    strides = {t.block_stride for t in kv_cache_config.kv_cache_tensors if t.block_stride}
    if len(strides) > 1:
        raise UnsupportedConfiguration(
            f"vLLM planned block rows of {sorted(strides)} bytes for one block-outermost KV "
            "cache; NixlPDConnector needs one row size per engine"
        )
    return strides.pop() if strides else None


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; strings pass through."""
    return str(dtype).removeprefix("torch.")


def _group_kind(spec: Any, index: int) -> tuple[GroupKind, int | None]:
    # Order matters: MLAAttentionSpec and the HMA-off sliding-window merge subclass
    # FullAttentionSpec.
    if isinstance(spec, MLAAttentionSpec):
        return GroupKind.MLA, None
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING_WINDOW, int(spec.sliding_window)
    if isinstance(spec, FullAttentionSpec):
        return GroupKind.FULL, None
    if isinstance(spec, MambaSpec):
        return GroupKind.SSM, None
    raise UnsupportedConfiguration(
        f"KV cache group {index} uses {type(spec).__name__}, which NixlPDConnector cannot "
        "transfer; supported: FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec, MambaSpec"
    )


# vLLM's KV cache dtypes quantized per tensor: each element is one FP8 byte, one K and one V
# scale per layer live on the attention layer (compared at handshake), so pages hold plain
# per-token K/V bytes and move like any other cache. Other FP8 names are refused: fp8_inc and
# fp8_ds_mla are formats of other platforms' kernels (fp8_ds_mla keeps scales in the page).
PER_TENSOR_FP8_CACHE_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})


def _quantization_problem(spec: AttentionSpec, cache_dtype: str) -> str | None:
    """Why this cache's quantization cannot move as plain pages, or None when it can."""
    mode = KVQuantMode(spec.kv_quant_mode)
    if mode is KVQuantMode.NONE:
        return None
    if mode is KVQuantMode.FP8_PER_TENSOR and cache_dtype in PER_TENSOR_FP8_CACHE_DTYPES:
        return None
    if mode is KVQuantMode.FP8_PER_TENSOR:
        return (
            f"KV cache dtype {cache_dtype!r} ({mode.name}), not one of "
            f"{', '.join(sorted(PER_TENSOR_FP8_CACHE_DTYPES))}"
        )
    return (
        f"KV cache quantization {mode.name} (--kv-cache-dtype {cache_dtype}), whose scales "
        "or packed codes live beside the K/V values in the pages"
    )


def _check_attention(spec: AttentionSpec, index: int, cache_dtype: str) -> None:
    problems = []
    if spec.head_size_v not in (spec.head_size, 0):
        problems.append(f"head_size_v={spec.head_size_v} differs from head_size={spec.head_size}")
    if (quantized := _quantization_problem(spec, cache_dtype)) is not None:
        problems.append(quantized)
    if spec.num_head_slots is not None:
        problems.append(f"packed heads ({spec.num_head_slots} head slots)")
    if spec.tokens_per_state != 1:
        problems.append(f"tokens_per_state={spec.tokens_per_state}")
    if problems:
        raise UnsupportedConfiguration(
            f"KV cache group {index} ({type(spec).__name__}) has {'; '.join(problems)}: "
            "NixlPDConnector transfers plain per-token K/V pages only (unquantized, or FP8 "
            "with per-tensor scales: --kv-cache-dtype fp8, fp8_e4m3 or fp8_e5m2)"
        )


def _attention_layers(
    spec: AttentionSpec, names: Sequence[str], kind: GroupKind, model_kv_heads: int, tp_size: int
) -> tuple[LayerSpec, ...]:
    dtype_bytes = torch.empty((), dtype=spec.dtype).element_size()
    if kind is GroupKind.MLA:
        return tuple(
            LayerSpec(name, 1, spec.head_size, dtype_bytes, num_planes=1) for name in names
        )
    total_heads = _model_wide_heads(spec.num_kv_heads, model_kv_heads, tp_size)
    return tuple(LayerSpec(name, total_heads, spec.head_size, dtype_bytes) for name in names)


def _with_scales(
    layers: tuple[LayerSpec, ...], kv_scales: Mapping[str, tuple[float, float]], index: int
) -> tuple[LayerSpec, ...]:
    """A per-tensor quantized group's layers with their scales: every layer must have them,
    or the handshake could not prove that two engines' bytes mean the same values."""
    missing = [layer.name for layer in layers if layer.name not in kv_scales]
    if missing:
        raise UnsupportedConfiguration(
            f"KV cache group {index} is FP8 with per-tensor scales, but layers {missing[:3]} "
            "have no k_scale/v_scale on this worker; NixlPDConnector cannot tell a peer which "
            "scales its bytes need"
        )
    return tuple(
        msgspec.structs.replace(layer, kv_scales=kv_scales[layer.name]) for layer in layers
    )


def _model_wide_heads(rank_heads: int, model_kv_heads: int, tp_size: int) -> int:
    """The model-wide KV head count behind one rank's cache spec.

    The cache spec (what vLLM allocated, per rank) is the truth for bytes; the model's count
    only says whether vLLM replicated heads. vLLM shards heads over TP ranks (8 heads, TP 2:
    4 per rank, 8 model-wide) or, when TP exceeds them, gives every rank one copy (2 heads,
    TP 4: 1 per rank, 2 model-wide): the same rule as connector.geometry.heads_per_rank, which
    is used here so the adapter and the planner cannot disagree. A cache whose count differs from the model's (a
    hand-made cache config) is described as it is; peers compare the result at handshake.
    """
    if rank_heads < 1:
        raise UnsupportedConfiguration(
            f"vLLM's cache spec gives each rank {rank_heads} KV heads; an attention layer "
            "needs at least 1: check the model's num_key_value_heads"
        )
    with contextlib.suppress(UnsupportedConfiguration):  # the rule cannot place the heads
        if model_kv_heads > 0 and heads_per_rank(model_kv_heads, tp_size) == rank_heads:
            return model_kv_heads  # the one head-placement rule (geometry) gives what vLLM did
    return rank_heads * tp_size


def _mamba_layers(spec: MambaSpec, names: Sequence[str], tp_size: int) -> tuple[LayerSpec, ...]:
    # One opaque state per rank: tp_size "heads" of the state's content bytes, one head per
    # rank, so a rank reads exactly its peer rank's state (SSM state cannot be re-sharded
    # byte-wise). The page's padding is not the state's: _page_stride_bytes describes it.
    content_bytes = spec.real_page_size_bytes
    return tuple(LayerSpec(name, tp_size, content_bytes, 1, num_planes=1) for name in names)


def _page_stride_bytes(spec: AttentionSpec | MambaSpec, index: int, kernel: int) -> int | None:
    """A padded page's bytes per kernel block on this rank, or None for a dense page.

    vLLM pads a hybrid's state pages (and may pad attention pages) so that every group's
    page has one size; a padded page is never split into kernel blocks (vLLM refuses too).
    """
    padded = spec.page_size_padded
    if padded is None or padded == spec.real_page_size_bytes:
        return None
    if kernel != spec.block_size:
        raise UnsupportedConfiguration(
            f"KV cache group {index} has padded pages ({padded} bytes for "
            f"{spec.real_page_size_bytes} of content) split into kernel blocks of {kernel} "
            f"tokens; a padded page holds one block of {spec.block_size} tokens"
        )
    return int(padded)


def kv_cache_spec_from_vllm(
    kv_cache_config: KVCacheConfig,
    *,
    model: str,
    dtype: str,
    cache_dtype: str,
    model_kv_heads: int,
    tp_size: int,
    memory_layout: MemoryLayout,
    kernel_block_sizes: Sequence[int] | None = None,
    block_formats: Sequence[BlockFormat] | None = None,
    kv_scales: Mapping[str, tuple[float, float]] | None = None,
) -> KVCacheSpec:
    """Our model-wide spec for vLLM's transferable cache groups (in ``transfer_groups`` order).

    ``kernel_block_sizes`` and ``block_formats`` (one per transfer group) and ``kv_scales``
    (per layer name) are known on workers only, from their tensors and attention layers
    (connector/vllm/backends.py, connector/vllm/scales.py); without them (the scheduler
    process, which plans nothing) each group's kernel block is its logical block, its format
    token-addressable and its layers' scales unknown.
    """
    groups = []
    for index, group in enumerate(kv_cache_config.transfer_groups):
        spec = group.kv_cache_spec
        kind, window = _group_kind(spec, index)
        if isinstance(spec, MambaSpec):
            layers = _mamba_layers(spec, group.layer_names, tp_size)
        elif isinstance(spec, AttentionSpec):
            _check_attention(spec, index, cache_dtype)
            layers = _attention_layers(spec, group.layer_names, kind, model_kv_heads, tp_size)
            if kv_scales is not None and spec.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR:
                layers = _with_scales(layers, kv_scales, index)
        else:  # _group_kind already refused every other spec type
            raise UnsupportedConfiguration(f"KV cache group {index}: unexpected {type(spec)}")
        block_size = int(spec.block_size)
        kernel = kernel_block_sizes[index] if kernel_block_sizes is not None else block_size
        kernel = block_size if kind is GroupKind.SSM else kernel
        groups.append(
            GroupSpec(
                kind=kind,
                block_size=block_size,
                kernel_block_size=kernel,
                num_blocks=kv_cache_config.num_blocks,
                layers=layers,
                window=window,
                block_format=block_formats[index] if block_formats else TOKEN_ADDRESSABLE,
                page_stride_bytes=_page_stride_bytes(spec, index, kernel),
            )
        )
    if not groups:
        raise UnsupportedConfiguration(
            "the vLLM KV cache config has no transferable cache group; nothing to transfer"
        )
    return KVCacheSpec(
        model,
        dtype,
        cache_dtype,
        tuple(groups),
        memory_layout,
        block_stride_bytes=block_stride_bytes_of(kv_cache_config, memory_layout),
    )


def kernel_block_sizes_of(
    kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, torch.Tensor]
) -> tuple[int, ...]:
    """Each transfer group's kernel block size, read off its first layer's tensor.

    A layer tensor's dim 0 counts kernel blocks: ``num_blocks * (block_size // kernel)``.
    """
    sizes = []
    for index, group in enumerate(kv_cache_config.transfer_groups):
        tensor = _layer_tensor(kv_caches, group.layer_names[0], index)
        block_size = int(group.kv_cache_spec.block_size)
        num_kernel_blocks = int(tensor.shape[0])
        ratio, remainder = divmod(num_kernel_blocks, kv_cache_config.num_blocks)
        if isinstance(group.kv_cache_spec, MambaSpec) or ratio == 0:
            sizes.append(block_size)
        elif remainder or block_size % ratio:
            raise UnsupportedConfiguration(
                f"layer {group.layer_names[0]!r}: {num_kernel_blocks} kernel blocks for "
                f"{kv_cache_config.num_blocks} blocks of {block_size} tokens is not a whole "
                "split; cannot tell the kernel block size"
            )
        else:
            sizes.append(block_size // ratio)
    return tuple(sizes)


def region_addresses(
    layout: RankLayout, spec: KVCacheSpec, kv_caches: Mapping[str, torch.Tensor]
) -> tuple[int, ...]:
    """One base address per region of ``layout``, each layer's tensor checked against it.

    Layer-outermost: a region is one layer's dense tensor, or with padded pages its pages
    from the first to the last one's padding (inside the tensor's storage). Block-outermost: a region is a
    group's rows; each layer's view must start at its page's offset in the rows and stride
    as our geometry says, and the rows must lie inside the views' storage. Host or device
    memory alike: a region's address is its tensor's data_ptr() (the memory kind is decided
    with the tensors' devices, connector/vllm/devices.py).
    """
    if spec.memory_layout.block_outermost:
        return _block_outermost_addresses(layout, spec, kv_caches)
    addresses: list[int] = []
    for group_index, group in enumerate(spec.groups):
        geometry = layout.groups[group_index]
        regions = sorted({plane.region for plane in geometry.planes})
        for layer, region in zip(group.layers, regions, strict=True):
            tensor = _layer_tensor(kv_caches, layer.name, group_index)
            region_bytes = layout.region_bytes[region]
            if group.page_stride_bytes is None:
                _check_span(tensor, layer.name, region_bytes)
            else:
                plane = next(p for p in geometry.planes if p.region == region)
                _check_padded_pages(tensor, layer.name, plane, geometry, region_bytes)
            addresses.append(int(tensor.data_ptr()))
    return tuple(addresses)


def _block_outermost_addresses(
    layout: RankLayout, spec: KVCacheSpec, kv_caches: Mapping[str, torch.Tensor]
) -> tuple[int, ...]:
    bases: dict[int, int] = {}
    for group_index, group in enumerate(spec.groups):
        geometry = layout.groups[group_index]
        first_planes = {plane.layer: plane for plane in reversed(geometry.planes)}
        for layer_index, layer in enumerate(group.layers):
            plane = first_planes[layer_index]
            tensor = _layer_tensor(kv_caches, layer.name, group_index)
            base = int(tensor.data_ptr()) - plane.offset_bytes
            expected = bases.setdefault(plane.region, base)
            if base != expected:
                raise UnsupportedConfiguration(
                    f"layer {layer.name!r} starts {base - expected:+d} bytes away from where "
                    f"its page sits in cache group {group_index}'s block rows (byte "
                    f"{plane.offset_bytes} of each row); the KV cache layout does not match"
                )
            _check_row_view(tensor, layer.name, plane, geometry)
            _check_rows_inside(tensor, layer.name, base, layout.region_bytes[plane.region])
    return tuple(bases[region] for region in range(len(layout.region_bytes)))


def _check_row_view(
    tensor: torch.Tensor, name: str, plane: PlaneGeometry, group: GroupGeometry
) -> None:
    """The view ``[kernel blocks, H, N, C]`` strides over rows exactly as ``plane`` says."""
    element_bytes = tensor.element_size()
    seen = tuple(stride * element_bytes for stride in tensor.stride())
    problems = []
    if tensor.dim() != 4 or tensor.shape[0] != group.num_kernel_blocks:
        problems.append(f"shape {tuple(tensor.shape)} is not [{group.num_kernel_blocks}, H, N, C]")
    elif seen[0] != plane.kernel_block_stride_bytes:
        problems.append(f"block stride {seen[0]} != {plane.kernel_block_stride_bytes} bytes")
    elif group.kind is not GroupKind.SSM:
        cell_bytes = tensor.shape[3] * element_bytes
        expected = (plane.num_heads, group.kernel_block_size)
        if (tensor.shape[1], tensor.shape[2]) != expected or seen[3] != element_bytes:
            problems.append(f"a block is {tuple(tensor.shape[1:])}, not {expected} cells")
        elif cell_bytes % plane.head_bytes:
            problems.append(f"a {cell_bytes}-byte cell holds no whole {plane.head_bytes}-byte head")
        else:
            for what, size, ours, theirs in (
                ("head", plane.num_heads, plane.head_stride_bytes, seen[1]),
                ("token", group.kernel_block_size, plane.token_stride_bytes, seen[2]),
            ):
                if size > 1 and ours != theirs:
                    problems.append(f"{what} stride {theirs} != {ours} bytes")
    if problems:
        raise UnsupportedConfiguration(
            f"layer {name!r}: its KV cache view does not stride as our block-outermost layout "
            f"expects ({'; '.join(problems)}; strides {tuple(tensor.stride())}); the engine's "
            "KV cache layout does not match the one it reported"
        )


def _check_rows_inside(tensor: torch.Tensor, name: str, base: int, region_bytes: int) -> None:
    """The rows we register (every block of the group) must be memory the tensor owns."""
    storage = tensor.untyped_storage()
    start = int(storage.data_ptr())
    if base < start or base + region_bytes > start + storage.nbytes():
        raise UnsupportedConfiguration(
            f"layer {name!r}: the block rows [{base:#x}, {base + region_bytes:#x}) are not "
            f"inside its tensor's storage [{start:#x}, {start + storage.nbytes():#x}); "
            "the KV cache layout does not match"
        )


def _layer_tensor(kv_caches: Mapping[str, torch.Tensor], name: str, group: int) -> torch.Tensor:
    tensor = kv_caches.get(name)
    if tensor is None:
        raise UnsupportedConfiguration(
            f"register_kv_caches has no tensor for layer {name!r} of cache group {group} "
            f"(got {len(kv_caches)} layers, e.g. {sorted(kv_caches)[:3]})"
        )
    return tensor


def _check_span(tensor: torch.Tensor, name: str, region_bytes: int) -> None:
    """The tensor must cover exactly the region: dense bytes from its data pointer."""
    shape, strides = tensor.shape, tensor.stride()
    last_element = sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
    span_bytes = tensor.element_size() * (last_element + 1)
    if tensor.numel() * tensor.element_size() != region_bytes or span_bytes != region_bytes:
        raise UnsupportedConfiguration(
            f"layer {name!r}: its tensor spans {span_bytes} bytes ({tuple(tensor.shape)}, "
            f"strides {tuple(tensor.stride())}) but our layout expects a dense {region_bytes}-"
            "byte region; the KV cache layout does not match (is VLLM_KV_CACHE_LAYOUT LBNHC?)"
        )


def _check_padded_pages(
    tensor: torch.Tensor, name: str, plane: PlaneGeometry, group: GroupGeometry, region_bytes: int
) -> None:
    """A padded layer's view: one dense page of content per kernel block, blocks a padded page
    apart, and the whole padded region (the last page's padding too) inside its storage."""
    element_bytes = tensor.element_size()
    block_stride = tensor.stride(0) * element_bytes if tensor.dim() else 0
    page_content = tensor[0].numel() * element_bytes if tensor.dim() and len(tensor) else 0
    slots = 1 if group.kind is GroupKind.SSM else group.kernel_block_size
    ours = sum(slots * p.num_heads * p.head_bytes for p in group.planes if p.region == plane.region)
    problems = []
    if tensor.dim() != 4 or tensor.shape[0] != group.num_kernel_blocks:
        problems.append(f"shape {tuple(tensor.shape)} is not [{group.num_kernel_blocks}, H, N, C]")
    elif block_stride != plane.kernel_block_stride_bytes:
        problems.append(f"block stride {block_stride} != {plane.kernel_block_stride_bytes} bytes")
    elif not tensor[0].is_contiguous():
        problems.append(f"a page's content is not dense (strides {tuple(tensor.stride())})")
    elif page_content != ours:
        problems.append(f"a page holds {page_content} bytes of content, not {ours}")
    if problems:
        raise UnsupportedConfiguration(
            f"layer {name!r}: its padded KV cache pages are not laid out as our layout expects "
            f"({'; '.join(problems)}); the engine's KV cache layout does not match its spec"
        )
    _check_rows_inside(tensor, name, int(tensor.data_ptr()), region_bytes)
