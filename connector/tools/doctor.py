"""`nixl-pd doctor`: gather facts about this host and the given engines, judge them, report.

The facts: NIXL loads and creates a UCX backend (in this process); a real loopback READ
between two processes, with the transport UCX names for it (connector.tools.doctor_loopback); a
real handshake with each ``--side-channel HOST:PORT``; the environment. In two-host mode
(``--listen`` on one host, ``--peer`` on the other: connector.tools.doctor_remote) a READ between
the hosts replaces the loopback READ. The verdicts live in
connector.tools.doctor_checks and connector.tools.doctor_env (pure); this module only does the
I/O and prints. Every network call and child process is bounded in time.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import msgspec

from connector.config import ENV_SIDE_CHANNEL_SECRET, ConnectorConfig
from connector.errors import ConnectorError, UnsupportedConfiguration
from connector.net.side_channel_client import fetch_handshake
from connector.tools.doctor_checks import (
    Check,
    Loopback,
    NixlProbe,
    SideChannelProbe,
    check_clocks,
    check_loopback,
    check_nixl,
    check_pair,
    check_progress,
    check_side_channel,
    exit_code,
)
from connector.tools.doctor_env import EnvFacts, check_env
from connector.tools.doctor_hosts import RemoteRead, check_remote_read, check_tls_across_hosts
from connector.tools.doctor_loopback import run_loopback
from connector.tools.doctor_remote import run_listener, run_peer

MAX_RANKS_PROBED = 64  # an engine's TP ranks asked for their handshake, at most
PORT_PROBE_TIMEOUT_S = 1.0
TRANSFER_TIMEOUT_S = 120.0  # for the whole READ test (loopback or two hosts), start-up included
READ_BYTES = 32 * 2**20  # per READ
NUM_READS = 4  # timed, after one warm-up
NAME_COLUMN_CHARS = 16  # longer check names push their line's summary right
_ENV_PREFIXES = ("UCX_", "VLLM_NIXL_", "NIXL_")


class DoctorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    side_channels: Sequence[str] = ()  # "HOST:PORT" of engines to check
    timeout_s: float = 3.0  # per side-channel exchange
    transfer: bool = True  # run the loopback READ
    strict: bool = False  # warnings fail too
    listen: str | None = None  # two-host mode: serve a READ target on HOST:PORT
    peer: str | None = None  # two-host mode: READ the target of a listener at HOST:PORT


class DoctorReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ok: bool
    exit_code: int
    nixl: NixlProbe
    loopback: Loopback | None
    side_channels: tuple[SideChannelProbe, ...]
    checks: tuple[Check, ...]
    remote: RemoteRead | None = None  # two-host mode's READ


def run_doctor(options: DoctorOptions, env: Mapping[str, str] | None = None) -> DoctorReport:
    """Gather every fact ``options`` asks for and judge them. Raises UnsupportedConfiguration
    for a malformed ``--side-channel`` address (before doing anything slow)."""
    if not options.timeout_s > 0:
        raise UnsupportedConfiguration(
            f"--timeout {options.timeout_s} is not accepted; give a number of seconds > 0"
        )
    env = dict(os.environ if env is None else env)
    addresses = [parse_address(address) for address in options.side_channels]
    two_hosts = _two_hosts_address(options)
    secret = env.get(ENV_SIDE_CHANNEL_SECRET) or None
    nixl = probe_nixl()
    checks = check_nixl(nixl)
    loopback = remote = None
    if two_hosts is not None:  # the READ between the hosts replaces the loopback READ
        remote, remote_checks = _two_hosts_read(options, two_hosts, env, "UCX" in nixl.backends)
        checks += remote_checks
    elif options.transfer and "UCX" in nixl.backends:
        loopback = run_loopback(
            env, num_bytes=READ_BYTES, num_reads=NUM_READS, timeout_s=TRANSFER_TIMEOUT_S
        )
        checks += check_loopback(loopback) + check_progress(loopback.idle_cpu_fraction)
    elif options.transfer:
        checks.append(Check("transfer", "info", "loopback READ not run: no UCX backend"))
    env_checks = check_env(gather_env(env, secret))
    if two_hosts is not None:  # UCX_TLS's same-host advice (allow cma) does not apply here
        env_checks = [check for check in env_checks if check.name != "UCX_TLS"]
    checks += env_checks
    probes = tuple(probe_side_channel(h, p, secret, options.timeout_s) for h, p in addresses)
    checks += [check_side_channel(probe) for probe in probes]
    reachable = [probe for probe in probes if probe.reachable]
    checks += [check_pair(reachable[0], other) for other in reachable[1:]]
    if reachable:
        checks.append(check_clocks(reachable))
    code = exit_code(checks, strict=options.strict)
    return DoctorReport(code == 0, code, nixl, loopback, probes, tuple(checks), remote)


def _two_hosts_address(options: DoctorOptions) -> tuple[str, int] | None:
    if options.listen is not None and options.peer is not None:
        raise UnsupportedConfiguration(
            "--listen and --peer are the two ends of one test: give one of them here and the "
            "other on the other host"
        )
    if options.listen:
        return parse_address(options.listen, "--listen")
    return None if options.peer is None else parse_address(options.peer, "--peer")


def _two_hosts_read(
    options: DoctorOptions, address: tuple[str, int], env: Mapping[str, str], have_ucx: bool
) -> tuple[RemoteRead | None, list[Check]]:
    """The READ between this host and the other one: listener or peer, and its verdicts."""
    checks = check_tls_across_hosts(env.get("UCX_TLS"))
    if not have_ucx or checks:
        return None, checks
    host, port = address
    if options.listen is not None:
        read = run_listener(host, port, env, num_bytes=READ_BYTES, timeout_s=TRANSFER_TIMEOUT_S)
    else:
        read = run_peer(host, port, env, num_reads=NUM_READS, timeout_s=TRANSFER_TIMEOUT_S)
    return read, checks + check_remote_read(read, _rdma_devices())


def parse_address(address: str, flag: str = "--side-channel") -> tuple[str, int]:
    """ "HOST:PORT" (or "[v6]:PORT") -> (host, port); anything else: UnsupportedConfiguration."""
    host, colon, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UnsupportedConfiguration(
            f"{flag} {address!r} is not HOST:PORT with a port in 1..65535; "
            "pass what the engine prints, e.g. 127.0.0.1:5600"
        )
    return host, int(port_text)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what C libraries print to stdout (UCX logs there) to stderr: stdout is the report."""
    sys.stdout.flush()
    saved_fd = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)


def probe_nixl() -> NixlProbe:
    """Import NIXL, list its plugins, and create a UCX backend on an agent with no thread."""
    try:
        import nixl
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as exc:  # ImportError, OSError for a missing .so, anything NIXL raises
        return NixlProbe(loaded=False, error=f"{type(exc).__name__}: {exc}")
    # NIXL logs INFO lines to stdout; its warnings still come, through our fd redirection.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    try:
        version = importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    module = nixl._api.__name__.split(".")[0]
    config = nixl_agent_config(enable_prog_thread=False, backends=[])
    agent = nixl_agent(f"doctor-probe-{uuid.uuid4().hex[:8]}", config)
    plugins = tuple(sorted(agent.get_plugin_list()))
    if "UCX" not in plugins:
        return NixlProbe(True, version, module, plugins)
    try:
        agent.create_backend("UCX", {})
    except Exception as exc:  # NIXL raises its own exception classes, without a base
        error = f"creating the UCX backend failed: {type(exc).__name__}: {exc}"
        return NixlProbe(True, version, module, plugins, error=error)
    return NixlProbe(True, version, module, plugins, backends=("UCX",))


def probe_side_channel(
    host: str, port: int, secret: str | None, timeout_s: float
) -> SideChannelProbe:
    """A real handshake with rank 0, then every other rank of that engine (bounded)."""
    address = f"{host}:{port}"
    start_s = time.monotonic()
    try:
        first = fetch_handshake(host, port, 0, secret=secret, timeout_s=timeout_s)
    except ConnectorError as exc:
        return SideChannelProbe(address, reachable=False, error=str(exc))
    round_trip_ms = (time.monotonic() - start_s) * 1000
    answered, error = 1, None
    for tp_rank in range(1, min(first.tp_size, MAX_RANKS_PROBED)):
        try:
            fetch_handshake(host, port, tp_rank, secret=secret, timeout_s=timeout_s)
        except ConnectorError as exc:
            error = f"TP rank {tp_rank} of {first.tp_size}: {exc}"
            break
        answered += 1
    return SideChannelProbe(
        address,
        reachable=True,
        engine_id=first.engine_id,
        protocol_version=first.protocol_version,
        tp_size=first.tp_size,
        ranks_answered=answered,
        fingerprint=first.fingerprint,
        compat_facts=dict(first.compat_facts),
        round_trip_ms=round(round_trip_ms, 2),
        signed=secret is not None,
        error=error,
    )


def gather_env(env: Mapping[str, str], secret: str | None) -> EnvFacts:
    """The variables that matter (secrets masked), network devices, and the configured port."""
    shown = {
        key: "<set>" if "SECRET" in key else value
        for key, value in sorted(env.items())
        if key.startswith(_ENV_PREFIXES)
    }
    try:
        config = ConnectorConfig.from_sources({}, env)
    except ConnectorError as exc:
        return EnvFacts(shown, _interfaces_up(), _rdma_devices(), config_error=str(exc))
    host, port = config.side_channel_host, config.side_channel_port
    taken = _port_taken(host, port)
    engine = None
    if taken:
        with contextlib.suppress(ConnectorError):
            reply = fetch_handshake(host, port, 0, secret=secret, timeout_s=PORT_PROBE_TIMEOUT_S)
            engine = reply.engine_id
    return EnvFacts(shown, _interfaces_up(), _rdma_devices(), None, taken, engine)


def _port_taken(host: str, port: int) -> bool:
    """Is something listening on host:port here? (False when host is not a local address.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _interfaces_up() -> tuple[str, ...]:
    """Network interfaces whose IFF_UP flag is set (lo included), from /sys/class/net."""
    up = []
    for path in sorted(Path("/sys/class/net").glob("*")):
        with contextlib.suppress(OSError, ValueError):
            if int((path / "flags").read_text().strip(), 16) & 0x1:
                up.append(path.name)
    return tuple(up)


def _rdma_devices() -> tuple[str, ...]:
    return tuple(sorted(path.name for path in Path("/sys/class/infiniband").glob("*")))


def render(report: DoctorReport) -> str:
    """The human report: a verdict line, then one line per check and a fix under each problem."""
    fails = sum(check.status == "fail" for check in report.checks)
    warns = sum(check.status == "warn" for check in report.checks)
    verdict = "OK" if report.ok else "PROBLEMS FOUND"
    counts = f"{fails} failed, {warns} warning{'s' * (warns != 1)}"
    lines = [f"nixl-pd doctor: {verdict} ({counts})"]
    width = min(NAME_COLUMN_CHARS, max((len(check.name) for check in report.checks), default=0))
    for check in report.checks:
        lines.append(f"  {check.status:<4}  {check.name:<{width}}  {check.summary}")
        if check.fix and check.status != "ok":
            lines.append(f"        {'':<{width}}  fix: {check.fix}")
    return "\n".join(lines)


def main(options: DoctorOptions, *, as_json: bool) -> int:
    """The `nixl-pd doctor` command: 0 when a deployment has what it needs, 1 if not; a bad
    argument raises UnsupportedConfiguration (connector.tools.cli prints it, exit code 2)."""
    try:
        with _stdout_to_stderr():  # whatever a library prints must not corrupt the report
            report = run_doctor(options)
    except KeyboardInterrupt:
        print("nixl-pd doctor: interrupted", file=sys.stderr)
        return 130
    print(msgspec.json.encode(report).decode() if as_json else render(report), flush=True)
    return report.exit_code
