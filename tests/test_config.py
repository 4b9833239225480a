"""ConnectorConfig.from_sources: defaults, accepted keys, and one clear line for every bad value."""

from __future__ import annotations

from typing import Any

import pytest

from connector.config import ConnectorConfig
from connector.errors import UnsupportedConfiguration


def test_defaults_without_sources() -> None:
    assert ConnectorConfig.from_sources(None, {}) == ConnectorConfig()


def test_every_key_maps_to_its_field() -> None:
    config = ConnectorConfig.from_sources(
        {
            "backends": ["UCX", "POSIX"],
            "num_threads": 2,
            "kv_lease_duration": 60,
            "enforce_handshake_compat": False,
            "handshake_timeout": 2.5,
            "handshake_retries": 0,
            "heartbeat_interval": 1,
            "side_channel_secret": "0123456789abcdef",
            "max_message_bytes": 2**20,
            "kv_buffer_device": "cpu",
        },
        {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "6100"},
    )
    assert config == ConnectorConfig(
        backends=("UCX", "POSIX"),
        num_threads=2,
        kv_lease_duration_s=60.0,
        enforce_handshake_compat=False,
        side_channel_host="10.1.2.3",
        side_channel_port=6100,
        handshake_timeout_s=2.5,
        handshake_retries=0,
        heartbeat_interval_s=1.0,
        side_channel_secret="0123456789abcdef",
        max_message_bytes=2**20,
        kv_buffer_device="cpu",
    )


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5999")
    assert ConnectorConfig.from_sources().side_channel_port == 5999


BAD_EXTRA: list[tuple[str, dict[str, Any], str]] = [
    (
        "an unknown key, with a suggestion",
        {"backend": ["UCX"]},
        "unknown key 'backend'.*did you mean 'backends'",
    ),
    ("an unknown key lists the accepted keys", {"zzz": 1}, "accepted keys: backends,"),
    ("backends as a string", {"backends": "UCX"}, r"\['backends'\]: value 'UCX'.*non-empty list"),
    ("an empty backends list", {"backends": []}, r"'backends'\]: value \[\]"),
    ("an empty backend name", {"backends": [""]}, "'backends'"),
    ("kv_buffer_device gpu", {"kv_buffer_device": "gpu"}, r"'kv_buffer_device'.*\"cpu\""),
    ("num_threads as a bool", {"num_threads": True}, "'num_threads'.*got `bool`"),
    ("num_threads 0", {"num_threads": 0}, "'num_threads'.*value 0.*1..1024"),
    ("num_threads as a float", {"num_threads": 2.0}, "'num_threads'.*got `float`"),
    ("a zero lease", {"kv_lease_duration": 0}, "'kv_lease_duration'.*> 0"),
    ("a lease of infinity", {"kv_lease_duration": float("inf")}, "'kv_lease_duration'.*not finite"),
    ("a lease as a string", {"kv_lease_duration": "30"}, "'kv_lease_duration'.*got `str`"),
    (
        "enforce_handshake_compat as 1",
        {"enforce_handshake_compat": 1},
        "'enforce_handshake_compat'.*true or false",
    ),
    ("a negative handshake timeout", {"handshake_timeout": -1}, "'handshake_timeout'"),
    ("negative retries", {"handshake_retries": -1}, "'handshake_retries'.*0..100"),
    ("a negative heartbeat interval", {"heartbeat_interval": -5}, "'heartbeat_interval'"),
    (
        "a heartbeat slower than the lease",
        {"heartbeat_interval": 30, "kv_lease_duration": 10},
        "not shorter than kv_lease_duration",
    ),
    ("a short secret", {"side_channel_secret": "abc"}, "'side_channel_secret'.*at least 16"),
    ("a numeric secret", {"side_channel_secret": 1234567890123456789}, "'side_channel_secret'"),
    ("a tiny max_message_bytes", {"max_message_bytes": 100}, "'max_message_bytes'.*value 100"),
]


@pytest.mark.parametrize(
    ("extra", "message"), [c[1:] for c in BAD_EXTRA], ids=[c[0] for c in BAD_EXTRA]
)
def test_bad_extra_config_is_one_clear_line(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=message) as info:
        ConnectorConfig.from_sources(extra, {})
    assert "\n" not in str(info.value)


def test_a_bad_secret_is_not_echoed() -> None:
    with pytest.raises(UnsupportedConfiguration) as info:
        ConnectorConfig.from_sources({"side_channel_secret": "hunter2"}, {})
    assert "hunter2" not in str(info.value)
    assert "<hidden>" in str(info.value)


BAD_ENV = [
    ("port 0", {"VLLM_NIXL_SIDE_CHANNEL_PORT": "0"}, "PORT: value '0'.*1..65535"),
    ("port 65536", {"VLLM_NIXL_SIDE_CHANNEL_PORT": "65536"}, "PORT: value '65536'"),
    ("a negative port", {"VLLM_NIXL_SIDE_CHANNEL_PORT": "-1"}, "PORT: value '-1'"),
    ("a non-numeric port", {"VLLM_NIXL_SIDE_CHANNEL_PORT": "http"}, "PORT: value 'http'"),
    ("a port with spaces", {"VLLM_NIXL_SIDE_CHANNEL_PORT": " 5600"}, "PORT: value ' 5600'"),
    ("a float port", {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600.0"}, "PORT: value '5600.0'"),
    ("an empty host", {"VLLM_NIXL_SIDE_CHANNEL_HOST": ""}, "HOST: value ''"),
    (
        "a host with spaces",
        {"VLLM_NIXL_SIDE_CHANNEL_HOST": " 127.0.0.1"},
        "HOST: value ' 127.0.0.1'",
    ),
]


@pytest.mark.parametrize(("env", "message"), [c[1:] for c in BAD_ENV], ids=[c[0] for c in BAD_ENV])
def test_bad_env_is_one_clear_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=message):
        ConnectorConfig.from_sources({}, env)


def test_ipv6_host_is_accepted() -> None:
    assert (
        ConnectorConfig.from_sources({}, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "::1"}).side_channel_host
        == "::1"
    )


def test_the_secret_may_come_from_the_environment() -> None:
    env = {"NIXL_PD_SIDE_CHANNEL_SECRET": "0123456789abcdef"}
    assert ConnectorConfig.from_sources({}, env).side_channel_secret == "0123456789abcdef"


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        ({}, {"NIXL_PD_SIDE_CHANNEL_SECRET": "short"}, "SECRET: value <hidden>.*at least 16"),
        (
            {"side_channel_secret": "0123456789abcdef"},
            {"NIXL_PD_SIDE_CHANNEL_SECRET": "0123456789abcdef"},
            "set both in kv_connector_extra_config and in env",
        ),
    ],
    ids=["a short secret from env", "a secret in two places"],
)
def test_bad_secret_sources(extra: dict[str, Any], env: dict[str, str], message: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=message) as info:
        ConnectorConfig.from_sources(extra, env)
    assert "short" not in str(info.value)


def test_repr_masks_the_secret() -> None:
    text = repr(ConnectorConfig(side_channel_secret="0123456789abcdef"))
    assert "0123456789abcdef" not in text
    assert "side_channel_secret='<hidden>'" in text and "num_threads=4" in text
