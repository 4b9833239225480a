"""What callers hand the example engine and get back: its config, requests and outputs.

Kept apart from the engine loop (examples/engine.py, which re-exports them) so routers and
servers can build and decode these messages without reading the loop.
"""

from __future__ import annotations

from typing import Any

import msgspec

from connector.errors import UnsupportedConfiguration
from connector.layout import MemoryLayout
from examples.model import ModelKind


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine's shape. ``role``: "prefill", "decode" or "local" (no connector)."""

    engine_id: str
    role: str = "local"
    model: str = "dense"
    tp_size: int = 1
    block_size: int = 16
    kernel_block_size: int | None = None  # None: same as block_size
    num_blocks: int = 256  # logical blocks per cache group, block 0 is the null block
    layout: str = "nhd"
    seed: int = 0
    staged: bool = False  # host staging: NIXL reads a host mirror (examples/staging.py)


class EngineRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request as the router sends it. A decode request's last prompt token is the first
    output token prefill produced; the KV of every token before it arrives from prefill."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None = None


class RequestOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    token_ids: list[int]
    error: str | None = None
    error_kind: str | None = None  # a failed KV load's kind (connector/metadata.py FailureKind)
    kv_transfer_params: dict[str, Any] | None = None
    kv_digest: str | None = None  # hash of the prompt KV when the first token was produced
    num_cached_tokens: int = 0  # local prefix-cache hit
    num_external_tokens: int = 0  # tokens whose KV arrived from a remote engine


def parse_engine_config(config: EngineConfig) -> tuple[ModelKind, MemoryLayout]:
    """The model kind and memory layout named in ``config``; UnsupportedConfiguration if unknown."""
    try:
        kind = ModelKind(config.model)
    except ValueError:
        raise UnsupportedConfiguration(
            f"unknown model {config.model!r}; choose one of {[k.value for k in ModelKind]}"
        ) from None
    if config.layout not in ("nhd", "hnd"):
        raise UnsupportedConfiguration(f"unknown layout {config.layout!r}; choose nhd or hnd")
    return kind, MemoryLayout(config.layout)
