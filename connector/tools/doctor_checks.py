"""The doctor's verdicts: facts gathered by connector.tools.doctor in, one Check per finding out.

Pure: no sockets, processes, clocks or NIXL. Each Check says what was found and, when it is
not ok, the one-line fix. ``fail`` means a deployment cannot work (no NIXL, no UCX backend, an
unreachable or incompatible side channel); ``warn`` means it works but not as it should (bytes
over TCP, UCX lanes on every interface).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from connector.config import ENV_SIDE_CHANNEL_SECRET
from connector.errors import ConnectorError
from connector.tools.doctor_ucx import TransportClass
from worker.handshake import Fingerprint, check_compatible
from worker.topology import tp_ratio

Status = Literal["ok", "warn", "fail", "info"]

# The replay window of signed side-channel requests (scheduler/auth.py's default).
REPLAY_WINDOW_S = 60.0
SPINNING_CPU_FRACTION = 0.5  # an idle agent above half a core is spinning, not waiting


class Check(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    status: Status
    summary: str
    fix: str | None = None


class NixlProbe(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What importing NIXL in the doctor's own process showed."""

    loaded: bool
    version: str | None = None
    module: str | None = None  # the wheel NIXL dispatched to, e.g. "nixl_cu13"
    plugins: tuple[str, ...] = ()  # plugin libraries NIXL found
    backends: tuple[str, ...] = ()  # backends the doctor could instantiate (UCX)
    error: str | None = None


class Loopback(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The two-process loopback READ: how the bytes moved and how fast."""

    ok: bool
    ucx_net_devices: str
    net_devices_from_env: bool  # False: unset in the environment, the doctor used "lo"
    ucx_tls: str | None = None
    num_bytes: int = 0  # per READ
    num_reads: int = 0  # timed READs (after one warm-up)
    num_descriptors: int = 0  # per READ
    seconds: float = 0.0  # for the timed READs
    gbps: float = 0.0
    bytes_matched: bool = False
    read_lanes: tuple[str, ...] = ()  # e.g. ("cma/memory",)
    transport_class: TransportClass = "unknown"
    message_lanes: tuple[str, ...] = ()  # notifications, e.g. ("tcp/lo",)
    idle_cpu_fraction: float | None = None  # of one core, by the idle target agent
    error: str | None = None


class SideChannelProbe(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One side channel: did it answer a real handshake, and what did its engine say?"""

    address: str
    reachable: bool
    engine_id: str | None = None
    protocol_version: int | None = None
    tp_size: int | None = None
    ranks_answered: int = 0
    fingerprint: str | None = None
    compat_facts: dict[str, str] = {}
    round_trip_ms: float | None = None
    signed: bool = False  # the requests carried an HMAC (a secret was configured)
    error: str | None = None


def check_nixl(probe: NixlProbe) -> list[Check]:
    if not probe.loaded:
        fix = "pip install 'nixl>=1.5' into this Python environment (see pyproject.toml)"
        return [Check("nixl", "fail", f"NIXL does not load: {probe.error}", fix)]
    plugins = ", ".join(probe.plugins) or "none"
    checks = [
        Check("nixl", "ok", f"nixl {probe.version} ({probe.module}) loads; plugins: {plugins}")
    ]
    if "UCX" in probe.backends:
        checks.append(Check("backend", "ok", "UCX backend created (DRAM)"))
    elif "UCX" in probe.plugins:
        fix = (
            "UCX could not start (its own error is on stderr above): check that UCX_NET_DEVICES "
            "and UCX_TLS name devices and transports this host has, or unset them"
        )
        checks.append(Check("backend", "fail", f"no UCX backend: {probe.error}", fix))
    else:
        fix = (
            "reinstall nixl (its wheel ships the UCX plugin), or point NIXL_PLUGIN_DIR at the "
            "directory holding libplugin_UCX.so"
        )
        summary = f"no UCX backend: UCX is not among the plugins found ({plugins})"
        checks.append(Check("backend", "fail", summary, fix))
    return checks


_WHAT_MOVED: dict[TransportClass, str] = {
    "tcp": "bytes moved over tcp (slow path)",
    "shared-memory": "bytes moved by cma/shared memory (same host, no network)",
    "rdma": "bytes moved by RDMA",
    "gpu": "bytes moved by a GPU copy transport",
    "unknown": "UCX did not say which transport moved the bytes",
}


def check_loopback(loopback: Loopback) -> list[Check]:
    devices = f"UCX_NET_DEVICES={loopback.ucx_net_devices}" + (
        "" if loopback.net_devices_from_env else " (unset in your environment; doctor default)"
    )
    if not loopback.ok:
        summary = f"loopback READ failed ({devices}): {loopback.error}"
        fix = (
            "run with NIXL_LOG_LEVEL=DEBUG UCX_LOG_LEVEL=info to see why UCX "
            "cannot connect two processes on this host"
        )
        return [Check("transfer", "fail", summary, fix)]
    if not loopback.bytes_matched:
        summary = "loopback READ completed but the bytes differ"
        return [Check("transfer", "fail", summary, "report this: NIXL or UCX delivered wrong data")]
    moved = _WHAT_MOVED[loopback.transport_class]
    lanes = ", ".join(loopback.read_lanes) or "?"
    messages = ", ".join(loopback.message_lanes) or "?"
    summary = (
        f"{moved}: {lanes} at {loopback.gbps:.2f} GB/s ({loopback.num_reads} READs of "
        f"{loopback.num_bytes / 2**20:.0f} MiB, two processes; notifications over {messages}; "
        f"{devices})"
    )
    transport_fix = _transport_fix(loopback.transport_class, loopback.ucx_tls)
    status: Status = "ok" if transport_fix is None else "warn"
    return [Check("transfer", status, summary, transport_fix)]


def _transport_fix(kind: TransportClass, ucx_tls: str | None) -> str | None:
    tls = f"UCX_TLS={ucx_tls!r} " if ucx_tls else ""
    if kind == "tcp":
        return (
            f"UCX chose TCP for one-sided READs: {tls}must allow cma (same host) or "
            "rc/dc (RDMA), e.g. unset UCX_TLS; between hosts also set UCX_NET_DEVICES "
            "to the RDMA device (e.g. mlx5_0:1)"
        )
    if kind == "unknown":
        return (
            "UCX printed no protocol table for the READ (UCX older than 1.15, or "
            "UCX_PROTO_ENABLE=n): run with UCX_PROTO_INFO=y and read the 'remote memory "
            "read' table yourself"
        )
    return None


def check_progress(idle_cpu_fraction: float | None) -> list[Check]:
    if idle_cpu_fraction is None:
        return []
    used = f"an idle nixl-pd agent used {idle_cpu_fraction:.0%} of a core"
    if idle_cpu_fraction > SPINNING_CPU_FRACTION:
        fix = (
            "give the progress thread a delay: RealNixlAgent(progress_delay_us=1000); "
            "agents made with nixl_agent() defaults poll with no delay"
        )
        return [Check("progress", "warn", f"{used}: its progress thread spins", fix)]
    return [Check("progress", "ok", f"{used} (progress thread polls with a delay, no spinning)")]


def check_side_channel(probe: SideChannelProbe) -> Check:
    name = f"side channel {probe.address}"
    if not probe.reachable:
        return Check(name, "fail", f"no handshake: {probe.error}", _side_channel_fix(probe))
    summary = (
        f"engine {probe.engine_id}: protocol {probe.protocol_version}, TP {probe.tp_size} "
        f"({probe.ranks_answered}/{probe.tp_size} ranks answered), fingerprint "
        f"{(probe.fingerprint or '?')[:12]}, handshake in {probe.round_trip_ms or 0.0:.1f} ms"
    )
    if probe.error is not None:
        fix = "every TP rank of that engine must register with its side channel; check its log"
        return Check(name, "fail", f"{summary}; but {probe.error}", fix)
    return Check(name, "ok", summary)


def _side_channel_fix(probe: SideChannelProbe) -> str:
    error = probe.error or ""
    if "authentication" in error or "secret" in error:
        return f"export {ENV_SIDE_CHANNEL_SECRET} with the engines' side_channel_secret"
    if "protocol version" in error:
        return "run the same nixl-pd-connector version here and on that engine"
    return (
        "start the engine, or pass the address it prints (its VLLM_NIXL_SIDE_CHANNEL_HOST:"
        "PORT); check firewalls between here and there"
    )


def check_pair(first: SideChannelProbe, second: SideChannelProbe) -> Check:
    """Can these two engines serve each other? Protocol version, model fingerprint, TP sizes."""
    name = f"pair {first.engine_id} / {second.engine_id}"
    if first.engine_id == second.engine_id:
        fix = "pass the prefill engine's and the decode engine's side channels"
        return Check(name, "warn", f"{first.address} and {second.address} are one engine", fix)
    fix = (
        "serve the same model and dtypes with the same nixl-pd-connector version on both, "
        "with TP sizes that divide each other"
    )
    if first.protocol_version != second.protocol_version:
        summary = (
            f"incompatible: protocol version {first.protocol_version} at {first.address}, "
            f"{second.protocol_version} at {second.address}"
        )
        return Check(name, "fail", summary, fix)
    try:
        check_compatible(
            Fingerprint(first.fingerprint or "", first.compat_facts),
            Fingerprint(second.fingerprint or "", second.compat_facts),
        )
        tp_ratio(first.tp_size or 1, second.tp_size or 1)
    except ConnectorError as exc:
        where = f"{first.address} as local, {second.address} as remote"
        return Check(name, "fail", f"incompatible ({where}): {exc}", fix)
    summary = (
        f"compatible: protocol {first.protocol_version}, same model fingerprint "
        f"{(first.fingerprint or '?')[:12]}, TP {first.tp_size} and {second.tp_size}"
    )
    return Check(name, "ok", summary)


def check_clocks(probes: Sequence[SideChannelProbe]) -> Check:
    """The side channel's replies carry no timestamp, so clocks are compared only indirectly:
    with a secret, the server refuses a request whose timestamp is outside its replay window."""
    if probes and all(probe.signed for probe in probes):
        return Check(
            "clocks",
            "ok",
            f"{len(probes)} engine(s) accepted requests signed with this machine's clock: each "
            f"is within the ±{REPLAY_WINDOW_S:.0f} s replay window of it",
        )
    return Check(
        "clocks",
        "info",
        "not checked: side-channel replies carry no timestamp (with "
        f"{ENV_SIDE_CHANNEL_SECRET} set, a signed handshake proves ±{REPLAY_WINDOW_S:.0f} s)",
    )


def exit_code(checks: Sequence[Check], *, strict: bool = False) -> int:
    """0 when a deployment has what it needs; 1 on any fail (or, with ``strict``, any warn)."""
    bad: set[Status] = {"fail", "warn"} if strict else {"fail"}
    return 1 if any(check.status in bad for check in checks) else 0
