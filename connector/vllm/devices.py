"""Which memory vLLM's KV tensors live in: host DRAM, or one GPU (NIXL's DRAM or VRAM)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from connector.errors import UnsupportedConfiguration
from connector.memory import HOST_MEMORY, Memory, MemoryKind


def memory_of(tensors: Iterable[torch.Tensor]) -> Memory:
    """The one Memory holding every tensor: cpu -> host memory, cuda:N -> GPU N.

    A rank registers one kind on one device, as its handshake tells peers; tensors on more
    than one device, or on a device NIXL cannot register here, raise UnsupportedConfiguration.
    """
    devices = sorted({_device_name(tensor.device) for tensor in tensors})
    if not devices:
        raise UnsupportedConfiguration("register_kv_caches got no KV tensors; nothing to register")
    if len(devices) > 1:
        raise UnsupportedConfiguration(
            f"this rank's KV tensors live on {len(devices)} devices ({', '.join(devices)}); "
            "a worker rank registers one device's memory: give each rank one device"
        )
    device = torch.device(devices[0])
    if device.type == "cpu":
        return HOST_MEMORY
    if device.type == "cuda":
        return Memory(MemoryKind.GPU, int(device.index or 0))
    raise UnsupportedConfiguration(
        f"KV tensors on {device} cannot be registered with NIXL by this connector (host and "
        'CUDA memory only); set kv_connector_extra_config {"kv_buffer_device": "cpu"} to '
        "stage KV through host memory"
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return f"cuda:{index}"
    return device.type
