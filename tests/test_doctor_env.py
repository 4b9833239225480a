"""The doctor's environment verdicts: UCX devices and transports, side-channel settings."""

from __future__ import annotations

import pytest

from connector.tools.doctor_env import EnvFacts, check_env


def facts(env: dict[str, str], **fields: object) -> EnvFacts:
    base: dict[str, object] = {"env": env, "interfaces_up": ("eth0", "lo"), "rdma_devices": ()}
    return EnvFacts(**{**base, **fields})  # type: ignore[arg-type]


ENV_CASES = [
    ("UCX_NET_DEVICES unset with two interfaces", facts({}),
     [("UCX_NET_DEVICES", "warn", "unset on a machine with eth0, lo: UCX opens lanes on every one")]),
    ("UCX_NET_DEVICES unset with only lo", facts({}, interfaces_up=("lo",)), []),
    ("UCX_NET_DEVICES=lo", facts({"UCX_NET_DEVICES": "lo"}), [("UCX_NET_DEVICES", "ok", "UCX_NET_DEVICES=lo")]),
    ("an RDMA device with its port", facts({"UCX_NET_DEVICES": "mlx5_0:1"}, rdma_devices=("mlx5_0",)),
     [("UCX_NET_DEVICES", "ok", "UCX_NET_DEVICES=mlx5_0:1")]),
    ("a device this host lacks", facts({"UCX_NET_DEVICES": "mlx5_3:1"}),
     [("UCX_NET_DEVICES", "warn", "UCX_NET_DEVICES=mlx5_3:1 names mlx5_3, not an up interface")]),
    ("UCX_TLS=tcp", facts({"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}),
     [("UCX_NET_DEVICES", "ok", ""), ("UCX_TLS", "warn", "UCX_TLS=tcp allows neither cma nor RDMA: READs go over TCP")]),
    ("UCX_TLS=^cma rules out the same-host path", facts({"UCX_NET_DEVICES": "lo", "UCX_TLS": "^cma"}),
     [("UCX_NET_DEVICES", "ok", ""), ("UCX_TLS", "warn", "UCX_TLS=^cma rules out cma: READs between engines on one host go over TCP")]),
    ("UCX_TLS=^ud is fine", facts({"UCX_NET_DEVICES": "lo", "UCX_TLS": "^ud"}), [("UCX_NET_DEVICES", "ok", "")]),
    ("UCX_TLS=rc_x,tcp is fine between hosts", facts({"UCX_NET_DEVICES": "lo", "UCX_TLS": "rc_x,tcp"}),
     [("UCX_NET_DEVICES", "ok", "")]),
    ("UCX_TLS=rc,cma,tcp is fine", facts({"UCX_NET_DEVICES": "lo", "UCX_TLS": "rc,cma,tcp"}),
     [("UCX_NET_DEVICES", "ok", "")]),
    ("a bad side-channel port variable", facts({"UCX_NET_DEVICES": "lo"}, config_error="env VLLM_NIXL_SIDE_CHANNEL_PORT: value 'x' is not accepted"),
     [("UCX_NET_DEVICES", "ok", ""), ("config", "fail", "env VLLM_NIXL_SIDE_CHANNEL_PORT: value 'x'")]),
    ("binding every interface with no secret", facts({"UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0"}),
     [("UCX_NET_DEVICES", "ok", ""), ("side channel", "warn", "binds 0.0.0.0 (every interface) with no shared secret")]),
    ("the port is held by something else", facts({"UCX_NET_DEVICES": "lo"}, port_taken=True),
     [("UCX_NET_DEVICES", "ok", ""), ("side channel port", "warn", "127.0.0.1:5600 is taken by a process that does not answer")]),
    ("the port is this host's engine", facts({"UCX_NET_DEVICES": "lo"}, port_taken=True, port_engine="prefill-0"),
     [("UCX_NET_DEVICES", "ok", ""), ("side channel port", "info", "served by engine prefill-0, running here")]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("env_facts", "expected"), [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES]
)
def test_check_env(env_facts: EnvFacts, expected: list[tuple[str, str, str]]) -> None:
    checks = check_env(env_facts)
    assert [(c.name, c.status) for c in checks] == [(name, status) for name, status, _ in expected]
    for check, (_, status, text) in zip(checks, expected, strict=True):
        assert text in check.summary
        assert status in ("ok", "info") or check.fix
