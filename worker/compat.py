"""The checks a handshake runs: the remote ranks' handshakes sound, the two engines' KV compatible.

The handshakes must agree with the request and with themselves (``validate_handshakes``).

The fingerprint covers the facts both sides must share for a byte copy to mean the same thing:
model, dtypes, protocol version and, per cache group, its kind, layers, heads, head sizes and
(a cache quantized per tensor) each layer's K and V scales.
Tensor parallelism, block sizes and memory layout are deliberately left out: they may differ
between engines and the transfer planner knows how to serve (or refuse) each difference.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from connector.errors import HandshakeError, UnsupportedConfiguration
from connector.layout import GroupKind, GroupSpec, KVCacheSpec
from connector.memory import HOST_MEMORY, Memory
from connector.protocol import PROTOCOL_VERSION, WorkerHandshake

PROTOCOL_FACT = "protocol_version"


class Fingerprint(NamedTuple):
    """A digest of the compatibility facts, and the facts themselves for error messages."""

    digest: str
    facts: Mapping[str, str]


def _per_layer(values: Sequence[object]) -> str:
    """ "8" when every layer agrees, else "8,8,4" layer by layer (floats exactly, as repr)."""
    texts = [repr(value) if isinstance(value, float) else str(value) for value in values]
    if len(set(texts)) == 1:
        return texts[0]
    return ",".join(texts)


def _scale_facts(prefix: str, group: GroupSpec) -> dict[str, str]:
    """Per-tensor quantized layers' K and V scales: equal bytes mean equal values only under
    equal scales. None where no layer is quantized (or its scales are not known here)."""
    scales = [layer.kv_scales for layer in group.layers]
    if all(scale is None for scale in scales):
        return {}
    return {
        f"{prefix}.k_scale": _per_layer([s[0] if s else None for s in scales]),
        f"{prefix}.v_scale": _per_layer([s[1] if s else None for s in scales]),
    }


def _group_facts(index: int, group: GroupSpec) -> dict[str, str]:
    layers = group.layers
    prefix = f"group{index}"
    facts = {
        f"{prefix}.kind": group.kind.value,
        f"{prefix}.window": str(group.window),
        f"{prefix}.num_layers": str(len(layers)),
        f"{prefix}.num_kv_heads": _per_layer([layer.num_kv_heads for layer in layers] or [0]),
        f"{prefix}.head_dim": _per_layer([layer.head_dim for layer in layers] or [0]),
        f"{prefix}.dtype_bytes": _per_layer([layer.dtype_bytes for layer in layers] or [0]),
        f"{prefix}.num_planes": _per_layer([layer.num_planes for layer in layers] or [0]),
    }
    facts.update(_scale_facts(prefix, group))
    if group.kind is GroupKind.SSM and not group.block_format.token_addressable:
        # An opaque state page is described per rank (its size follows TP): the pairing
        # compares it with both TP sizes in view and says so, instead of "models differ".
        del facts[f"{prefix}.num_kv_heads"], facts[f"{prefix}.head_dim"]
    return facts


def digest_of(facts: Mapping[str, str]) -> str:
    """SHA-256 over the facts in a canonical (sorted JSON) form."""
    canonical = json.dumps(dict(facts), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def fingerprint(spec: KVCacheSpec, protocol_version: int = PROTOCOL_VERSION) -> Fingerprint:
    """The compatibility fingerprint of an engine's KV cache spec."""
    facts: dict[str, str] = {
        PROTOCOL_FACT: str(protocol_version),
        "model": spec.model,
        "dtype": spec.dtype,
        "cache_dtype": spec.cache_dtype,
        "num_groups": str(len(spec.groups)),
    }
    for index, group in enumerate(spec.groups):
        facts.update(_group_facts(index, group))
    return Fingerprint(digest_of(facts), facts)


def _differences(
    local: Mapping[str, str], remote: Mapping[str, str], keys: Sequence[str] | None = None
) -> list[str]:
    """One "key: local 'a', remote 'b'" per differing fact (of ``keys``, if given)."""
    missing = "<missing>"
    return [
        f"{key}: local {local.get(key, missing)!r}, remote {remote.get(key, missing)!r}"
        for key in sorted(set(local) | set(remote) if keys is None else keys)
        if local.get(key) != remote.get(key)
    ]


# Facts that say what a cache byte means. A difference is never tolerated: a load would
# succeed and every value in it would be wrong.
VALUE_FACTS = ("cache_dtype",)
VALUE_FACT_SUFFIXES = (".dtype_bytes", ".k_scale", ".v_scale")


def _is_value_fact(key: str) -> bool:
    return key in VALUE_FACTS or key.endswith(VALUE_FACT_SUFFIXES)


def check_compatible(
    local: Fingerprint, remote: Fingerprint, enforce: bool = True
) -> tuple[str, ...]:
    """Check a remote engine's fingerprint against ours; returns the differences it tolerated.

    Raises HandshakeError when the peer speaks another protocol version or its digest does not
    match its own facts (a corrupt or tampered handshake): these are never tolerated. Raises
    UnsupportedConfiguration naming every differing fact when ``enforce`` is set; otherwise
    the differences are returned for the caller to log, except those of the facts saying what
    a cache byte means (cache dtype, element size, KV scales): they always raise.
    """
    local_version = local.facts.get(PROTOCOL_FACT)
    remote_version = remote.facts.get(PROTOCOL_FACT)
    if local_version != remote_version:
        raise HandshakeError(
            f"protocol version mismatch: local {local_version!r}, remote {remote_version!r}; "
            "run the same nixl-pd-connector version on prefill and decode"
        )
    if digest_of(remote.facts) != remote.digest:
        raise HandshakeError(
            f"the peer's compatibility fingerprint {remote.digest[:16]!r} does not match the "
            "facts it sent; the handshake is corrupt, check the peer's connector version"
        )
    if local.digest == remote.digest:
        return ()
    value_keys = [key for key in set(local.facts) | set(remote.facts) if _is_value_fact(key)]
    value_facts = _differences(local.facts, remote.facts, value_keys)
    if value_facts:
        raise UnsupportedConfiguration(
            "prefill and decode KV caches encode values differently: "
            + "; ".join(value_facts)
            + ". The same bytes would load as other values, so this is refused even with "
            "enforce_handshake_compat=false: serve both with the same --kv-cache-dtype and "
            "the same checkpoint's KV scales"
        )
    reasons = tuple(_differences(local.facts, remote.facts))
    if enforce:
        raise UnsupportedConfiguration(
            "prefill and decode engines are not compatible: "
            + "; ".join(reasons)
            + ". Serve the same model with the same dtypes on both sides, or set "
            "enforce_handshake_compat=false to proceed at your own risk"
        )
    return reasons


def check_transport(
    local_backends: Sequence[str],
    remote_backends: Sequence[str],
    *,
    local_memory: Memory = HOST_MEMORY,
    remote_memory: Memory = HOST_MEMORY,
    backend_memory_types: Mapping[str, Sequence[str]] | None = None,
) -> tuple[str, ...]:
    """The NIXL backends both ranks have, in the local order.

    Raises UnsupportedConfiguration when there is none, or, given what each backend can
    register (NIXL's ``get_backend_mem_types``), when no common backend handles both ranks'
    memory kinds (say a UCX built without CUDA, facing a GPU peer).
    """
    common = tuple(backend for backend in local_backends if backend in remote_backends)
    if not common:
        raise UnsupportedConfiguration(
            f"no NIXL backend in common: this rank has {list(local_backends)}, the peer "
            f"{list(remote_backends)}; list a shared backend (e.g. UCX) in "
            'kv_connector_extra_config["backends"] on both engines'
        )
    if backend_memory_types is None:
        return common
    needed = {local_memory.kind.nixl_name, remote_memory.kind.nixl_name}
    usable = tuple(b for b in common if needed <= set(backend_memory_types.get(b, ())))
    if not usable:
        raise UnsupportedConfiguration(
            f"no common NIXL backend ({', '.join(common)}) handles both this rank's "
            f"{local_memory.describe()} ({local_memory.kind.nixl_name}) and the peer's "
            f"{remote_memory.describe()} ({remote_memory.kind.nixl_name}); use a backend built "
            'with GPU support, or stage through host memory ("kv_buffer_device": "cpu")'
        )
    return usable


def validate_handshakes(
    source_engine_id: str, remote_tp_size: int, handshakes: dict[int, WorkerHandshake]
) -> None:
    """Check what the remote ranks sent agrees with the request and with itself."""
    for remote_rank, handshake in sorted(handshakes.items()):
        where = f"remote rank {remote_rank}"
        if handshake.protocol_version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"{where} speaks protocol version {handshake.protocol_version}, we speak "
                f"{PROTOCOL_VERSION}; run the same connector version on both engines"
            )
        if handshake.engine_id != source_engine_id:
            raise HandshakeError(
                f"{where} belongs to engine {handshake.engine_id!r}, but the request's KV is on "
                f"engine {source_engine_id!r}: the prefill engine restarted and its KV is gone"
            )
        ranks = {
            (handshake.tp_rank, handshake.tp_size),
            (handshake.layout.tp_rank, handshake.layout.tp_size),
        }
        if ranks != {(remote_rank, remote_tp_size)}:
            raise HandshakeError(
                f"{where} says it is rank {handshake.tp_rank} of {handshake.tp_size} (its "
                f"layout: {handshake.layout.tp_rank} of {handshake.layout.tp_size}), but the "
                f"request says the prefill engine has tp_size {remote_tp_size}"
            )
        if len(handshake.region_addresses) != len(handshake.layout.region_bytes):
            raise HandshakeError(
                f"{where} sent {len(handshake.region_addresses)} region addresses for a layout "
                f"of {len(handshake.layout.region_bytes)} regions; its handshake is corrupt"
            )
