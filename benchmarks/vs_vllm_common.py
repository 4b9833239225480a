"""What every part of benchmarks/vs_vllm shares: the model shape and vLLM configs for each side.

32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks, heads outermost in a block
(vLLM's LBHNC). "vLLM" is vLLM 0.33's NixlConnector, "ours" NixlPDConnector loaded the way
a deployment loads it (``kv_connector_module_path: connector.vllm``).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_LAYERS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
POOL_BLOCKS = 4096  # per side: room for a 32k-token request, fragmented ids drawn from it
MAX_MODEL_LEN = 40000
SIDES = ("vLLM", "ours")


@functools.cache
def model_config() -> Any:
    """A config-only llama of the shape above (vLLM inspects it in a subprocess: built once)."""
    from vllm.config import ModelConfig

    folder = Path(tempfile.mkdtemp(prefix="vs-vllm-model-"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 128, "num_attention_heads": 32,
        "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": NUM_LAYERS, "vocab_size": 256, "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return ModelConfig(
        model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip


def vllm_config(
    side: str = "vLLM", *, max_num_seqs: int = 16, max_num_batched_tokens: int = 512
) -> Any:
    """A decode-capable (kv_both) engine config with ``side``'s connector."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        SchedulerConfig,
        VllmConfig,
    )

    if side == "vLLM":
        transfer = KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu"
        )
    else:
        transfer = KVTransferConfig(
            kv_connector="NixlPDConnector", kv_connector_module_path="connector.vllm",
            kv_role="kv_both", kv_buffer_device="cpu",
        )  # fmt: skip
    made = VllmConfig(
        model_config=model_config(),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),  # fmt: skip
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    made.cache_config.kv_cache_layout = "LBHNC"
    return made


def kv_cache_config(num_blocks: int = POOL_BLOCKS, num_kv_heads: int = NUM_KV_HEADS) -> Any:
    """One full-attention group of every layer, ``num_blocks`` blocks, no tensors."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads, head_size=HEAD_DIM,
        dtype=torch.bfloat16,
    )  # fmt: skip
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names(), spec)], kv_cache_layout="LBHNC",
    )  # fmt: skip


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def reserve_side_channel_port() -> None:
    """Point VLLM_NIXL_SIDE_CHANNEL_PORT at a free port (our scheduler side may bind it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(probe.getsockname()[1])
