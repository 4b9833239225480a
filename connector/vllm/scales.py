"""Read each attention layer's per-tensor KV cache scales off the model vLLM built.

A cache quantized per tensor (``--kv-cache-dtype fp8``) stores each K element as
``k / k_scale`` (V likewise), with one ``k_scale`` and one ``v_scale`` per layer that vLLM
loads from the checkpoint (1.0 without one) before it allocates the KV cache. The scales are
not in the pages, so two engines' bytes mean the same values only when their scales are equal:
the handshake compares them (worker/handshake.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def kv_scales_of(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> dict[str, tuple[float, float]]:
    """(k_scale, v_scale) per attention layer name of the transfer groups, as the kernels use
    them (the host copies ``_k_scale_float`` and ``_v_scale_float``). Layers vLLM's config does
    not know (state groups, a worker with no model) are absent."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    names = [name for group in kv_cache_config.transfer_groups for name in group.layer_names]
    layers = get_layers_from_vllm_config(vllm_config, cast(type[Any], AttentionLayerBase), names)
    return {
        name: scales for name, layer in layers.items() if (scales := _scales(layer)) is not None
    }


def _scales(layer: Any) -> tuple[float, float] | None:
    k_scale = getattr(layer, "_k_scale_float", None)
    v_scale = getattr(layer, "_v_scale_float", None)
    if isinstance(k_scale, int | float) and isinstance(v_scale, int | float):
        return float(k_scale), float(v_scale)
    return None
