"""Two "hosts" on one machine: two network namespaces joined by one veth pair, always removed.

A run gets two namespaces of its own, ``nixlpd-<pid>-<4 hex>-p`` (prefill) and ``...-d``
(decode), each with its own ``lo`` up and one end of a veth pair carrying a private /30
(10.213.X.Y). Nothing else is on that link: the namespaces have no route to the machine's
network or to each other's loopback, so the only way bytes move between them is over the veth.
The addresses live only inside the two namespaces, so parallel runs cannot clash (their names
carry the pid and a random tag). Deleting a namespace deletes its veth end and so the pair; a
run killed before it cleaned up is swept by the next one (its pid is gone).

Engines run in a host with ``host.command(...)`` (``ip netns exec``), with ``host.env()``:
UCX restricted to TCP on the veth, the side channel bound to the host's address. Test code that
must reach a host's addresses runs in a thread that entered the namespace (``threads_in``).

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2. ``NIXL_PD_REQUIRE_NETNS=1`` (CI) turns
"namespaces cannot be made here" from a skip into a failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REQUIRE_ENV = "NIXL_PD_REQUIRE_NETNS"
NAME_PREFIX = "nixlpd-"
NETNS_DIR = Path("/var/run/netns")
IP_TIMEOUT_S = 10.0
CLONE_NEWNET = 0x40000000
# What crosses the veth: UCX's TCP transport only (no CMA/shm, which would bypass the link).
UCX_TLS = "tcp"
_STALE_NAME = re.compile(rf"^{NAME_PREFIX}(\d+)-[0-9a-f]{{4}}-[pd]$")


class NetnsUnavailable(RuntimeError):
    """Namespaces or veth pairs cannot be made here (not root, no iproute2, a sandbox)."""


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its veth end, and that end's IPv4 address."""

    namespace: str
    device: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def env(self) -> dict[str, str]:
        """What an engine in this host needs: UCX over TCP on the veth, and the side channel
        on the host's address (vLLM's variable; our example engine takes ``--host``)."""
        return {
            "UCX_TLS": UCX_TLS,
            "UCX_NET_DEVICES": self.device,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.address,
        }


@dataclass(frozen=True)
class HostPair:
    prefill: Host
    decode: Host


def _ip(*args: str) -> None:
    try:
        subprocess.run(
            ["ip", *args], check=True, capture_output=True, text=True, timeout=IP_TIMEOUT_S
        )
    except FileNotFoundError:
        raise NetnsUnavailable("iproute2's `ip` is not installed") from None
    except subprocess.CalledProcessError as exc:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {exc.stderr.strip()}") from None


def _delete_namespace(name: str) -> None:
    with contextlib.suppress(NetnsUnavailable):
        _ip("netns", "delete", name)


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def sweep_stale() -> list[str]:
    """Delete namespaces a killed run of this module left behind (its pid no longer runs)."""
    swept = []
    for path in NETNS_DIR.glob(f"{NAME_PREFIX}*"):
        match = _STALE_NAME.match(path.name)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(path.name)
            swept.append(path.name)
    return swept


def our_namespaces() -> list[str]:
    """Namespaces of this process that still exist (empty after every ``host_pair``)."""
    return sorted(p.name for p in NETNS_DIR.glob(f"{NAME_PREFIX}{os.getpid()}-*"))


@contextlib.contextmanager
def host_pair() -> Iterator[HostPair]:
    """Make the two hosts and the link between them; delete both namespaces on the way out,
    whatever happened. Raises NetnsUnavailable when they cannot be made."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed")
    sweep_stale()
    tag = f"{os.getpid()}-{random.randrange(16**4):04x}"
    subnet = random.randrange(256 * 64)  # which /30 of 10.213.0.0/16
    network = f"10.213.{subnet // 64}"
    first = subnet % 64 * 4
    # The veth ends are made inside the namespaces and never appear in the machine's own one,
    # so their names cannot clash with another run's.
    pair = HostPair(
        prefill=Host(f"{NAME_PREFIX}{tag}-p", "veth-prefill", f"{network}.{first + 1}"),
        decode=Host(f"{NAME_PREFIX}{tag}-d", "veth-decode", f"{network}.{first + 2}"),
    )
    made: list[str] = []
    try:
        for host in (pair.prefill, pair.decode):
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
        _ip("-n", pair.prefill.namespace, "link", "add", pair.prefill.device, "type", "veth",
            "peer", "name", pair.decode.device, "netns", pair.decode.namespace)  # fmt: skip
        for host in (pair.prefill, pair.decode):
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/30", "dev", host.device)
            _ip("-n", host.namespace, "link", "set", host.device, "up")
        yield pair
    finally:
        for name in made:
            _delete_namespace(name)


def unavailable_reason() -> str | None:
    """None when this machine can make a host pair, else why not (tried, then removed)."""
    try:
        with host_pair():
            return None
    except NetnsUnavailable as exc:
        return str(exc)


def require_or_skip_reason() -> str | None:
    """For test modules: the skip reason, or raise when REQUIRE_ENV=1 says never to skip."""
    reason = unavailable_reason()
    if reason is not None and os.environ.get(REQUIRE_ENV) == "1":
        raise NetnsUnavailable(f"{reason}, and {REQUIRE_ENV}=1: run as root with iproute2")
    return reason


def _enter(namespace: str) -> None:
    """Move the calling thread (only it) into ``namespace``'s network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def threads_in(host: Host, max_workers: int = 8) -> Iterator[ThreadPoolExecutor]:
    """An executor whose threads live in ``host``'s namespace: sockets they open (and threads
    they start, which inherit it) reach that host's addresses. The rest of the process stays
    where it was."""
    with ThreadPoolExecutor(
        max_workers, thread_name_prefix=f"netns-{host.namespace}", initializer=_enter,
        initargs=(host.namespace,),
    ) as executor:  # fmt: skip
        yield executor
