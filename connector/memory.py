"""Where registered KV bytes live: host DRAM or one GPU's memory (NIXL's DRAM and VRAM)."""

from __future__ import annotations

import enum

import msgspec


class MemoryKind(enum.Enum):
    HOST = "host"  # NIXL DRAM: plain or pinned host memory
    GPU = "gpu"  # NIXL VRAM: device memory, addressed with its device index

    @property
    def nixl_name(self) -> str:
        return "VRAM" if self is MemoryKind.GPU else "DRAM"


class Memory(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The memory a rank registers: one kind and, for GPU memory, one device index."""

    kind: MemoryKind = MemoryKind.HOST
    device: int = 0  # CUDA device index for GPU memory; 0 for host memory

    def describe(self) -> str:
        return f"GPU {self.device}" if self.kind is MemoryKind.GPU else "host memory"


HOST_MEMORY = Memory()
