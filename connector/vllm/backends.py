"""What each vLLM attention backend keeps inside a kernel block: the block-format table.

A KV tensor's shape does not say where a token's bytes are: the attention kernel does. vLLM
hands every backend a tensor shaped ``[blocks, heads, tokens, K|V]`` (in the layout's stride
order), and a backend whose cache-write and attention kernels index that tensor by (block,
slot, head) is token-addressable. The CPU backend is not: per (kernel block, head) it stores
K transposed (``[head_dim, block_size]`` for the ``vec`` ISA, other tiles for AMX and NEON)
followed by V, so only whole (block, head) chunks mean the same thing on two engines.
A backend missing from the table is opaque with no known head structure: the safe default.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from connector.layout import TOKEN_ADDRESSABLE, BlockFormat

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Backends (AttentionBackend.get_name()) whose kernels address each (block, slot, head) of
# the tensor as its shape says: their bytes may be copied token by token.
TOKEN_ADDRESSABLE_BACKENDS = frozenset(
    {"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLASHMLA", "TRITON_MLA"}
)
# Opaque backends whose blocks are one independent chunk per head (head-major tensors).
HEAD_CHUNK_BACKENDS = frozenset({"CPU_ATTN"})


def block_format_for(backend_name: str, variant: str | None = None) -> BlockFormat:
    """The format of a backend's blocks; ``variant`` (the CPU ISA) is part of an opaque name."""
    if backend_name in TOKEN_ADDRESSABLE_BACKENDS:
        return TOKEN_ADDRESSABLE
    name = f"{backend_name}:{variant}" if variant else backend_name
    return BlockFormat(
        name, token_addressable=False, head_chunks=backend_name in HEAD_CHUNK_BACKENDS
    )


def merge_formats(formats: Sequence[BlockFormat]) -> BlockFormat:
    """One group's format: its layers' format if they agree, else opaque under both names."""
    distinct = sorted(set(formats), key=lambda found: found.name)
    if len(distinct) == 1:
        return distinct[0]
    return BlockFormat("+".join(found.name for found in distinct), token_addressable=False)


def block_formats_of(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[BlockFormat, ...]:
    """Each transfer group's block format, read off the attention layers vLLM built.

    A group with no attention layer known to vLLM's config (state groups, or a worker with no
    model) is opaque under the name "unknown".
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layer_type = cast(type[Any], AttentionLayerBase)
    formats = []
    for group in kv_cache_config.transfer_groups:
        layers = get_layers_from_vllm_config(vllm_config, layer_type, list(group.layer_names))
        found = [_layer_format(layer, vllm_config) for layer in layers.values()]
        formats.append(merge_formats(found) if found else block_format_for("unknown"))
    return tuple(formats)


def _layer_format(layer: Any, vllm_config: VllmConfig) -> BlockFormat:
    name = str(layer.get_attn_backend().get_name())
    variant = _cpu_isa(layer, vllm_config) if name in HEAD_CHUNK_BACKENDS else None
    return block_format_for(name, variant)


def _cpu_isa(layer: Any, vllm_config: VllmConfig) -> str:
    """The CPU kernel's ISA (vec, vec16, amx, neon...): it decides the tiling inside a block."""
    isa = getattr(layer, "isa", None)  # set by the CPU metadata builder, when it ran
    if isinstance(isa, str):
        return isa
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return "unknown-isa"
    known: dict[str, Any] = {
        "dtype": vllm_config.model_config.dtype,
        "block_size": vllm_config.cache_config.block_size,
        "head_size": vllm_config.model_config.get_head_size(),
        "kv_cache_dtype": vllm_config.cache_config.cache_dtype,
    }
    accepted = inspect.signature(_get_attn_isa).parameters
    return str(_get_attn_isa(**{key: value for key, value in known.items() if key in accepted}))
