"""The doctor's environment verdicts: UCX device and transport settings, side-channel config.

Pure: facts gathered by connector.tools.doctor in (variables, interfaces, who holds the configured
port), Checks out, each with its one-line fix.
"""

from __future__ import annotations

import msgspec

from connector.tools.doctor_checks import Check
from connector.tools.doctor_ucx import transport_class


class EnvFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The environment as the doctor saw it (secrets masked), and who holds the side-channel port
    an engine started here would bind (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT)."""

    env: dict[str, str]  # the UCX_*, VLLM_NIXL_* and NIXL_* variables that are set
    interfaces_up: tuple[str, ...]
    rdma_devices: tuple[str, ...]
    config_error: str | None = None  # ConnectorConfig.from_sources' complaint, if any
    port_taken: bool = False
    port_engine: str | None = None  # the nixl-pd engine answering on that port, if one does


def check_env(facts: EnvFacts) -> list[Check]:
    checks = _net_devices_checks(facts)
    tls_problem = _tls_problem(facts.env.get("UCX_TLS"))
    if tls_problem is not None:
        fix = "unset UCX_TLS, or include cma (same host) and rc/dc (RDMA)"
        checks.append(Check("UCX_TLS", "warn", tls_problem, fix))
    if facts.config_error is not None:
        checks.append(Check("config", "fail", facts.config_error, "fix that environment variable"))
    checks.extend(_side_channel_env_checks(facts))
    return checks


def _net_devices_checks(facts: EnvFacts) -> list[Check]:
    value = facts.env.get("UCX_NET_DEVICES")
    interfaces = ", ".join(facts.interfaces_up + facts.rdma_devices)
    if value is None:
        if len(facts.interfaces_up) + len(facts.rdma_devices) <= 1:
            return []
        summary = (
            f"unset on a machine with {interfaces}: UCX "
            "opens lanes on every one and may pick a slow or unreachable one"
        )
        fix = (
            "export UCX_NET_DEVICES=<the device linking prefill and decode> "
            "(e.g. mlx5_0:1; lo for one host) in both engines' environment"
        )
        return [Check("UCX_NET_DEVICES", "warn", summary, fix)]
    known = set(facts.interfaces_up) | set(facts.rdma_devices)
    missing = [dev for dev in _devices(value) if dev not in known and dev != "all"]
    if missing:
        summary = (
            f"UCX_NET_DEVICES={value} names "
            f"{', '.join(missing)}, not an up interface or RDMA device here "
            f"({interfaces})"
        )
        fix = "name devices that exist on this host (ip link; ibv_devices)"
        return [Check("UCX_NET_DEVICES", "warn", summary, fix)]
    return [Check("UCX_NET_DEVICES", "ok", f"UCX_NET_DEVICES={value}")]


def _devices(value: str) -> list[str]:
    """ "mlx5_0:1,eth0" -> ["mlx5_0", "eth0"] (the port after ':' is not a device)."""
    return [item.strip().split(":")[0] for item in value.split(",") if item.strip()]


def _tls_problem(tls: str | None) -> str | None:
    """What UCX_TLS rules out, if it rules out a fast path for one-sided READs.

    Measured here: without cma, a same-host READ is "software emulation" over TCP (sysv and
    posix do not serve it); without rc/dc/ud, a READ between hosts is TCP too.
    """
    if tls is None:
        return None
    items = {item.strip() for item in tls.lstrip("^").split(",") if item.strip()}
    shared = {"cma", "sm", "all"}
    if tls.startswith("^"):
        if items & shared:
            return f"UCX_TLS={tls} rules out cma: READs between engines on one host go over TCP"
        return None
    if not items & shared and not any(transport_class(i) == "rdma" for i in items):
        return f"UCX_TLS={tls} allows neither cma nor RDMA: READs go over TCP"
    return None


def _side_channel_env_checks(facts: EnvFacts) -> list[Check]:
    checks: list[Check] = []
    host = facts.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    port = facts.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    if host in ("0.0.0.0", "::", "*") and "NIXL_PD_SIDE_CHANNEL_SECRET" not in facts.env:
        summary = (
            f"binds {host} (every interface) with no "
            "shared secret: anyone who reaches the port can read KV memory"
        )
        fix = (
            "bind the interface decode engines use, and set "
            "NIXL_PD_SIDE_CHANNEL_SECRET on every engine"
        )
        checks.append(Check("side channel", "warn", summary, fix))
    fix = "give each engine on this host its own VLLM_NIXL_SIDE_CHANNEL_PORT"
    if facts.port_engine is not None:
        summary = f"{host}:{port} is served by engine {facts.port_engine}, running here"
        checks.append(Check("side channel port", "info", summary, fix))
    elif facts.port_taken:
        summary = (
            f"{host}:{port} is taken by a process that does not answer the side-channel "
            "protocol: an engine started here with this port will fail to start"
        )
        checks.append(Check("side channel port", "warn", summary, fix))
    return checks
