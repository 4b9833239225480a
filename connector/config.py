"""The connector's configuration: one frozen Struct, built from kv_connector_extra_config + env.

Every key is type-checked when the engine starts; a bad key or value raises
UnsupportedConfiguration with one line naming the key, the value seen and what is accepted.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from connector.errors import UnsupportedConfiguration, clipped

ENV_SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
# The secret may come from the environment so it stays out of command lines and logged configs.
ENV_SIDE_CHANNEL_SECRET = "NIXL_PD_SIDE_CHANNEL_SECRET"
# UCX backend threads of a NIXL agent (vLLM's NixlConnector default too). The reader's threads
# share a READ's descriptors, which about doubles fragmented READs' throughput, and an idle
# agent costs no more (benchmarks/README.md, "wire").
DEFAULT_NIXL_THREADS = 4


class ConnectorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Connector settings. Build it with ``from_sources``; the constructor does not validate.

    ``side_channel_port`` 0 asks the side channel for a free ephemeral port (tests, examples);
    ``from_sources`` only accepts 1..65535 from the environment.
    """

    backends: tuple[str, ...] = ("UCX",)  # extra_config key "backends"
    num_threads: int = DEFAULT_NIXL_THREADS  # "num_threads" (NIXL backend threads)
    kv_lease_duration_s: float = 30.0  # "kv_lease_duration" (seconds)
    enforce_handshake_compat: bool = True  # "enforce_handshake_compat"
    side_channel_host: str = "127.0.0.1"  # env VLLM_NIXL_SIDE_CHANNEL_HOST
    side_channel_port: int = 5600  # env VLLM_NIXL_SIDE_CHANNEL_PORT
    handshake_timeout_s: float = 10.0  # "handshake_timeout"
    handshake_retries: int = 3  # "handshake_retries"
    heartbeat_interval_s: float = 5.0  # "heartbeat_interval"
    # "lease_precheck_skip": a load skips the lease check before its READs when that prefill
    # boot's side channel answered one within this many seconds (worker/lease_proof.py); the
    # check after the READs still decides. 0: check before every load's READs.
    lease_precheck_skip_s: float = 10.0
    side_channel_secret: str | None = None  # "side_channel_secret"
    max_message_bytes: int = 16 * 2**20  # "max_message_bytes"
    # "kv_buffer_device": "cpu" stages KV through a host buffer (the NIC reads host memory
    # only); None follows vLLM's own kv_transfer_config.kv_buffer_device (connector/vllm/staging.py)
    kv_buffer_device: str | None = None
    # "verify_kv": prefill digests each leased block, decode checks what it READ against
    # them before it reports a load (worker/kv_digest.py); costs time, off by default
    verify_kv: bool = False
    # Multi-turn (vLLM 0.33's bidirectional mode, same keys): a decode engine holds a finished
    # request's blocks under a lease for "decoder_kv_blocks_ttl" seconds and returns params
    # the next turn's prefill passes back; prefill then pulls the covered prompt tokens from
    # decode when at least "kv_recompute_threshold" of them are not cached locally.
    bidirectional_kv_xfer: bool = False  # "bidirectional_kv_xfer"
    kv_recompute_threshold: int = 64  # "kv_recompute_threshold" (tokens; 0: pull any)
    decoder_kv_blocks_ttl_s: float = 480.0  # "decoder_kv_blocks_ttl" (seconds)
    # "overlap_wait_timeout": overlapped dispatch (docs/overlap.md), how long a decode load
    # waits for prefill to announce its lease before it fails (prefill_timeout)
    overlap_wait_timeout_s: float = 30.0
    # "chunked_pull": overlapped dispatch with chunked prefill (docs/overlap.md): prefill
    # announces each chunk's whole blocks and decode READs them while later chunks compute
    chunked_pull: bool = False

    def __repr__(self) -> str:
        """Every field, with the secret masked: configs get logged."""
        shown = msgspec.structs.asdict(self)
        if self.side_channel_secret is not None:
            shown["side_channel_secret"] = "<hidden>"
        return f"ConnectorConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_sources(
        cls,
        extra_config: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ConnectorConfig:
        """Validate ``extra_config`` (kv_connector_extra_config) and ``env`` (default os.environ).

        Raises UnsupportedConfiguration naming the key, the value seen and the accepted values.
        """
        fields: dict[str, Any] = {}
        for key, value in (extra_config or {}).items():
            field_name, value_type, accepted = _extra_key_rule(key)
            where = f"kv_connector_extra_config[{key!r}]"
            shown = "<hidden>" if key == "side_channel_secret" and value is not None else None
            fields[field_name] = _convert(where, value, value_type, accepted, shown=shown)
        env_fields = _env_fields(os.environ if env is None else env)
        if "side_channel_secret" in env_fields and "side_channel_secret" in fields:
            raise UnsupportedConfiguration(
                f"side_channel_secret is set both in kv_connector_extra_config and in env "
                f"{ENV_SIDE_CHANNEL_SECRET}; set it in one place"
            )
        fields.update(env_fields)
        config = cls(**fields)
        _check_cross_field(config)
        return config


PositiveSeconds = Annotated[float, msgspec.Meta(gt=0.0)]
_SECONDS = "a number of seconds > 0"
_FLAG = "true or false"

# extra_config key -> (ConnectorConfig field, msgspec type, accepted values for the error message)
_EXTRA_KEYS: dict[str, tuple[str, Any, str]] = {
    "backends": (
        "backends",
        Annotated[
            tuple[Annotated[str, msgspec.Meta(min_length=1)], ...], msgspec.Meta(min_length=1)
        ],
        'a non-empty list of NIXL backend names, e.g. ["UCX"]',
    ),
    "num_threads": (
        "num_threads",
        Annotated[int, msgspec.Meta(ge=1, le=1024)],
        "an integer in 1..1024",
    ),
    "kv_lease_duration": ("kv_lease_duration_s", PositiveSeconds, _SECONDS),
    "enforce_handshake_compat": ("enforce_handshake_compat", bool, _FLAG),
    "handshake_timeout": ("handshake_timeout_s", PositiveSeconds, _SECONDS),
    "handshake_retries": (
        "handshake_retries",
        Annotated[int, msgspec.Meta(ge=0, le=100)],
        "an integer in 0..100",
    ),
    "heartbeat_interval": ("heartbeat_interval_s", PositiveSeconds, _SECONDS),
    "lease_precheck_skip": (
        "lease_precheck_skip_s",
        Annotated[float, msgspec.Meta(ge=0.0)],
        "a number of seconds >= 0 (0: check every lease before its READs)",
    ),
    "side_channel_secret": (
        "side_channel_secret",
        Annotated[str, msgspec.Meta(min_length=16)] | None,
        "null or a string of at least 16 characters",
    ),
    "max_message_bytes": (
        "max_message_bytes",
        Annotated[int, msgspec.Meta(ge=2**16, le=2**31 - 1)],
        f"an integer number of bytes in {2**16}..{2**31 - 1}",
    ),
    "verify_kv": ("verify_kv", bool, _FLAG),
    "bidirectional_kv_xfer": ("bidirectional_kv_xfer", bool, _FLAG),
    "kv_recompute_threshold": (
        "kv_recompute_threshold",
        Annotated[int, msgspec.Meta(ge=0, le=2**40)],
        "an integer number of tokens >= 0 (0: pull whatever decode holds)",
    ),
    "overlap_wait_timeout": ("overlap_wait_timeout_s", PositiveSeconds, _SECONDS),
    "chunked_pull": ("chunked_pull", bool, _FLAG),
    "decoder_kv_blocks_ttl": ("decoder_kv_blocks_ttl_s", PositiveSeconds, _SECONDS),
    "kv_buffer_device": (
        "kv_buffer_device",
        Literal["cpu", "cuda", "xpu"],
        '"cpu" (stage KV through a host buffer) or "cuda"/"xpu" (register device memory)',
    ),
}


def _extra_key_rule(key: object) -> tuple[str, Any, str]:
    rule = _EXTRA_KEYS.get(key) if isinstance(key, str) else None
    if rule is not None:
        return rule
    close = difflib.get_close_matches(str(key), list(_EXTRA_KEYS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UnsupportedConfiguration(
        f"kv_connector_extra_config: unknown key {key!r}{hint}; "
        f"accepted keys: {', '.join(sorted(_EXTRA_KEYS))}"
    )


def _convert(
    where: str, value: object, value_type: Any, accepted: str, *, shown: str | None = None
) -> Any:
    seen = shown if shown is not None else clipped(repr(value), 80)
    try:
        converted = msgspec.convert(value, value_type)
    except msgspec.ValidationError as exc:
        raise UnsupportedConfiguration(
            f"{where}: value {seen} is not accepted ({exc}); expected {accepted}"
        ) from None
    if isinstance(converted, float) and not math.isfinite(converted):
        raise UnsupportedConfiguration(f"{where}: value {seen} is not finite; expected {accepted}")
    return converted


def _env_fields(env: Mapping[str, str]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    host = env.get(ENV_SIDE_CHANNEL_HOST)
    if host is not None:
        if not host.strip() or host != host.strip():
            raise UnsupportedConfiguration(
                f"env {ENV_SIDE_CHANNEL_HOST}: value {host!r} is not accepted; "
                "expected a host name or IP address without spaces, e.g. 127.0.0.1"
            )
        fields["side_channel_host"] = host
    port = env.get(ENV_SIDE_CHANNEL_PORT)
    if port is not None:
        if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
            raise UnsupportedConfiguration(
                f"env {ENV_SIDE_CHANNEL_PORT}: value {port!r} is not accepted; "
                "expected an integer TCP port in 1..65535"
            )
        fields["side_channel_port"] = int(port)
    secret = env.get(ENV_SIDE_CHANNEL_SECRET)
    if secret is not None:
        where = f"env {ENV_SIDE_CHANNEL_SECRET}"
        accepted = "a string of at least 16 characters"
        fields["side_channel_secret"] = _convert(
            where, secret, _EXTRA_KEYS["side_channel_secret"][1], accepted, shown="<hidden>"
        )
    return fields


def _check_cross_field(config: ConnectorConfig) -> None:
    if config.heartbeat_interval_s >= config.kv_lease_duration_s:
        raise UnsupportedConfiguration(
            f"kv_connector_extra_config['heartbeat_interval']: value {config.heartbeat_interval_s} "
            f"is not shorter than kv_lease_duration ({config.kv_lease_duration_s}); leases would "
            "expire between heartbeats: choose a heartbeat interval below the lease duration"
        )
