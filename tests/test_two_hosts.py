"""Prefill and decode on two "hosts": network namespaces joined by a veth, UCX over TCP only.

Each host is a namespace this module makes (tests/netns.py) with its own loopback and one end
of a veth pair; the engines bind their request socket and side channel to their host's veth
address, and UCX may use only TCP on the veth. Nothing but the veth joins the two: a side
channel bound to 127.0.0.1, or a UCX lane on lo or through shared memory, would not connect.

- The example engine: `nixl-pd serve` in each host, `nixl-pd route --check` on the decode
  host; tokens equal a single engine's, the KV digests agree, and decode's UCX log names the
  transport that carried its READs: tcp on the veth.
- `nixl-pd doctor --listen` in one host and `--peer` in the other: the READ crosses the veth
  over tcp; with UCX_TLS unrestricted the same pair moves the bytes by CMA, which the doctor
  flags as impossible between real hosts.

Skipped where namespaces cannot be made (not root), unless NIXL_PD_REQUIRE_NETNS=1 (CI).
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.tools.doctor_ucx import all_read_lanes, parse_proto_tables, read_scopes
from tests.netns import (
    NETNS_DIR,
    Host,
    HostPair,
    host_pair,
    our_namespaces,
    require_or_skip_reason,
    threads_in,
)

pytestmark = pytest.mark.real_nixl

_SKIP_REASON = require_or_skip_reason()
if _SKIP_REASON is not None:
    pytest.skip(f"network namespaces cannot be made: {_SKIP_REASON}", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
ROUTE_TIMEOUT_S = 120.0
DOCTOR_TIMEOUT_S = 150.0
DOCTOR_PORT = 5700
READY = re.compile(r"ready: requests on \S+:(\d+), side channel")


def host_env(host: Host, **extra: str) -> dict[str, str]:
    """The test's environment, this checkout's code, and the host's UCX and side-channel
    settings; ``UCX_TLS=""`` removes the TCP-only restriction."""
    env = {**os.environ, **host.env(), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **extra}
    return {key: value for key, value in env.items() if value != ""}


@pytest.fixture(scope="module")
def hosts() -> Iterator[HostPair]:
    with host_pair() as pair:
        yield pair
    assert our_namespaces() == [], "a namespace outlived its host pair"


class ServedEngine:
    """`nixl-pd serve` inside one host, bound to its veth address, UCX's log kept."""

    def __init__(self, host: Host, role: str, log_dir: Path) -> None:
        self.ucx_log = log_dir / f"{role}-ucx.log"
        self._stderr = open(log_dir / f"{role}.log", "wb")  # noqa: SIM115 - closed in stop()
        argv = [sys.executable, "-m", "connector.tools.cli", "serve", "--role", role]
        argv += ["--host", host.address, "--port", "0"]
        env = host_env(host, UCX_PROTO_INFO="y", UCX_LOG_FILE=str(self.ucx_log))
        self.process = subprocess.Popen(
            host.command(argv), stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env
        )
        self.address = f"{host.address}:{self._wait_ready(role, log_dir)}"

    def _wait_ready(self, role: str, log_dir: Path) -> str:
        lines: queue.Queue[str] = queue.Queue()
        stdout = self.process.stdout
        assert stdout is not None
        threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline_s and self.process.poll() is None:
            try:
                match = READY.search(lines.get(timeout=0.2))
            except queue.Empty:
                continue
            if match:
                return match.group(1)
        tail = (log_dir / f"{role}.log").read_text(errors="replace")[-2000:]
        raise AssertionError(f"{role} engine in its namespace did not start: {tail}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)
        self._stderr.close()


def test_example_engines_on_two_hosts_match_a_single_engine_over_tcp(
    hosts: HostPair, tmp_path: Path
) -> None:
    engines: list[ServedEngine] = []
    try:
        engines.append(ServedEngine(hosts.prefill, "prefill", tmp_path))
        engines.append(ServedEngine(hosts.decode, "decode", tmp_path))
        prefill, decode = engines
        route = [sys.executable, "-m", "connector.tools.cli", "route", "--prefill", prefill.address]
        route += ["--decode", decode.address, "--requests", "4", "--prompt-len", "40"]
        route += ["--max-tokens", "5", "--check", "--json"]
        routed = subprocess.run(
            hosts.decode.command(route),  # the router runs on the decode host
            capture_output=True,
            text=True,
            timeout=ROUTE_TIMEOUT_S,
            env=host_env(hosts.decode),
        )
    finally:
        for engine in engines:
            engine.stop()

    assert routed.returncode == 0, routed.stderr[-3000:]
    result = json.loads(routed.stdout)
    assert (result["ok"], result["tokens_match"], result["kv_match"]) == (True, True, True)
    assert (result["completed_requests"], result["failed_requests"]) == (4, 0)
    assert all(r["num_external_tokens"] == 40 for r in result["results"])  # all KV READ
    tables = parse_proto_tables(decode.ucx_log.read_text(errors="replace"))
    assert all_read_lanes(tables) == (f"tcp/{hosts.decode.device}",)
    assert read_scopes(tables) == ("inter-node",)


def run_doctor_pair(hosts: HostPair, **env_changes: str) -> tuple[dict, dict, str]:
    """`doctor --listen` on the prefill host, `doctor --peer` on the decode host, at once;
    both JSON reports and the peer's human-readable one."""
    listen = f"{hosts.prefill.address}:{DOCTOR_PORT}"
    doctor = [sys.executable, "-m", "connector.tools.cli", "doctor"]
    listener = subprocess.Popen(
        hosts.prefill.command([*doctor, "--listen", listen, "--json"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=host_env(hosts.prefill, **env_changes),
    )
    try:
        peer = subprocess.run(
            hosts.decode.command([*doctor, "--peer", listen, "--json"]),
            capture_output=True,
            text=True,
            timeout=DOCTOR_TIMEOUT_S,
            env=host_env(hosts.decode, **env_changes),
        )
        listener_out, listener_err = listener.communicate(timeout=DOCTOR_TIMEOUT_S)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait(timeout=STOP_TIMEOUT_S)
    assert peer.stdout, peer.stderr[-3000:]
    assert listener_out, listener_err[-3000:]
    peer_report = json.loads(peer.stdout)
    return peer_report, json.loads(listener_out), peer.stderr


def two_hosts_check(report: dict) -> dict:
    (check,) = [check for check in report["checks"] if check["name"] == "two hosts"]
    return check


def test_doctor_two_host_mode_names_tcp_on_the_veth(hosts: HostPair) -> None:
    peer, listener, _ = run_doctor_pair(hosts)

    for report in (peer, listener):  # the listener prints the verdict the peer sent back
        assert report["remote"]["transport_class"] == "tcp"
        assert report["remote"]["read_lanes"] == [f"tcp/{hosts.decode.device}"]
        assert report["remote"]["scopes"] == ["inter-node"]
        assert report["remote"]["bytes_matched"] is True
        assert two_hosts_check(report)["status"] == "ok"
        assert "bytes moved over the network by tcp" in two_hosts_check(report)["summary"]
        assert report["loopback"] is None
    assert (peer["exit_code"], listener["exit_code"]) == (0, 0)


def test_doctor_two_host_mode_flags_cma_between_namespaces_of_one_machine(
    hosts: HostPair,
) -> None:
    peer, listener, _ = run_doctor_pair(hosts, UCX_TLS="")  # UCX may pick anything

    for report in (peer, listener):
        assert report["remote"]["transport_class"] == "shared-memory"
        check = two_hosts_check(report)
        assert check["status"] == "fail"
        assert "CMA/shm cannot cross hosts" in check["summary"]
        assert "UCX_TLS=tcp" in check["fix"]
        assert report["exit_code"] == 1


def test_the_hosts_reach_each_other_only_over_the_veth(hosts: HostPair) -> None:
    """Decode's namespace reaches prefill's address, and its only route is the veth's /30
    (no default route: nothing sent inside can leave the machine)."""
    import socket

    def connect(address: str) -> str:
        with socket.socket() as client:
            client.settimeout(2.0)
            try:
                client.connect((address, DOCTOR_PORT))
            except ConnectionRefusedError:
                return "refused"  # reached the host: nothing listens there
            except OSError as exc:
                return type(exc).__name__
        return "connected"

    with threads_in(hosts.decode) as on_decode:
        from_decode = on_decode.submit(connect, hosts.prefill.address).result()
    routes = subprocess.run(
        ["ip", "-n", hosts.decode.namespace, "-4", "route", "show"],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout.splitlines()  # fmt: skip

    assert from_decode == "refused"
    network = ipaddress.ip_interface(f"{hosts.decode.address}/30").network
    assert [route.split()[:3] for route in routes] == [[str(network), "dev", hosts.decode.device]]


def test_a_failure_inside_still_removes_both_namespaces() -> None:
    with pytest.raises(RuntimeError, match="boom"), host_pair() as pair:
        assert (NETNS_DIR / pair.prefill.namespace).exists()
        raise RuntimeError("boom")

    assert not (NETNS_DIR / pair.prefill.namespace).exists()
    assert not (NETNS_DIR / pair.decode.namespace).exists()
