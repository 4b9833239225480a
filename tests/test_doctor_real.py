"""`nixl-pd doctor` for real: NIXL over loopback, live and dead side channels, exit codes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from connector.config import ENV_SIDE_CHANNEL_SECRET
from connector.protocol import WorkerHandshake
from connector.tools.doctor import DoctorOptions, probe_side_channel, run_doctor
from connector.tools.doctor_loopback import PeerProcess, run_loopback
from scheduler.side_channel import SideChannelServer
from tests.test_protocol import make_handshake
from worker.handshake import digest_of

pytestmark = [pytest.mark.real_nixl, pytest.mark.timeout(300)]

HOST = "127.0.0.1"
SECRET = "doctor test shared secret"
ENV = {**os.environ, "UCX_NET_DEVICES": "lo"}


def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """(exit code, stdout, seconds) of `nixl-pd doctor ARGS` in its own process."""
    start_s = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "connector.tools.cli", "doctor", *args],
        env=env or ENV,
        capture_output=True,
        timeout=240,
    )
    return done.returncode, done.stdout.decode(), time.monotonic() - start_s


def load_report(stdout: str) -> dict[str, Any]:
    """The one JSON object that must be the whole of stdout (no NIXL or UCX lines in it)."""
    try:
        report: dict[str, Any] = json.loads(stdout)
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON object: {stdout[:2000]!r}")
    return report


def check_named(report: dict[str, Any], name: str) -> dict[str, Any]:
    (check,) = [c for c in report["checks"] if c["name"] == name]
    return check


def handshake(engine_id: str, model: str) -> WorkerHandshake:
    facts = {"protocol_version": "2", "model": model, "dtype": "float16"}
    return msgspec.structs.replace(
        make_handshake(0), engine_id=engine_id, tp_size=1, fingerprint=digest_of(facts),
        compat_facts=facts,
    )  # fmt: skip


@pytest.fixture
def start_engine() -> Iterator[Any]:
    """Start side-channel servers (as an engine's scheduler would); all stopped afterwards."""
    servers: list[SideChannelServer] = []

    def start(engine_id: str, model: str = "tiny", secret: str | None = None) -> str:
        server = SideChannelServer(
            HOST, 0, {0: handshake(engine_id, model)}, engine_id=engine_id,
            on_heartbeat=len, on_release=len, secret=secret, max_message_bytes=2**16,
        )  # fmt: skip
        server.start()
        servers.append(server)
        return f"{HOST}:{server.port}"

    yield start
    for server in servers:
        server.stop()


def dead_address() -> str:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return f"{HOST}:{probe.getsockname()[1]}"


def test_doctor_json_moves_real_bytes_over_loopback() -> None:
    code, stdout, _ = run_cli("--json")
    report = load_report(stdout)
    assert code == 0, stdout
    assert not [c for c in report["checks"] if c["status"] == "fail"], stdout
    assert report["ok"] is True
    assert report["nixl"]["loaded"] is True
    assert report["nixl"]["backends"] == ["UCX"]
    loopback = report["loopback"]
    assert loopback["ok"] and loopback["bytes_matched"]
    assert loopback["read_lanes"], "UCX named no transport for the READ"
    assert loopback["transport_class"] in ("shared-memory", "rdma", "tcp")
    assert loopback["gbps"] > 0
    assert loopback["ucx_net_devices"] == "lo"
    assert check_named(report, "transfer")["summary"].startswith("bytes moved by ")


def test_doctor_says_tcp_is_the_slow_path_and_strict_fails_on_it() -> None:
    code, stdout, _ = run_cli("--json", "--strict", env={**ENV, "UCX_TLS": "tcp"})
    report = load_report(stdout)
    assert report["loopback"]["transport_class"] == "tcp"
    assert report["loopback"]["read_lanes"] == ["tcp/lo"]
    transfer = check_named(report, "transfer")
    assert transfer["status"] == "warn"
    assert transfer["summary"].startswith("bytes moved over tcp (slow path): tcp/lo at ")
    assert "UCX_TLS='tcp' must allow cma" in transfer["fix"]
    assert code == 1  # --strict: a warning fails


def test_doctor_handshakes_with_two_live_engines(start_engine: Any) -> None:
    prefill, decode = start_engine("prefill-a"), start_engine("decode-b")
    code, stdout, _ = run_cli(
        "--json", "--no-transfer", "--side-channel", prefill, "--side-channel", decode
    )
    report = load_report(stdout)
    assert code == 0, stdout
    assert report["loopback"] is None
    assert [p["engine_id"] for p in report["side_channels"]] == ["prefill-a", "decode-b"]
    assert all(p["reachable"] and p["protocol_version"] == 2 for p in report["side_channels"])
    pair = check_named(report, "pair prefill-a / decode-b")
    assert pair["status"] == "ok" and pair["summary"].startswith("compatible: protocol 2")
    clocks = check_named(report, "clocks")
    assert clocks["summary"].startswith("not checked: side-channel replies carry no timestamp")


def test_doctor_fails_on_a_dead_side_channel_within_seconds() -> None:
    address = dead_address()
    code, stdout, seconds = run_cli("--no-transfer", "--timeout", "1", "--side-channel", address)
    assert code == 1
    assert f"fail  side channel {address}  no handshake: side channel {address} did not " in stdout
    assert "answer within 1.0 s" in stdout
    assert "fix: start the engine" in stdout
    assert seconds < 60  # NIXL's import dominates on a busy 2-core machine


def test_a_dead_side_channel_costs_only_the_timeout() -> None:
    host, port = dead_address().split(":")
    start_s = time.monotonic()
    probe = probe_side_channel(host, int(port), None, 0.5)
    assert time.monotonic() - start_s < 3
    assert not probe.reachable
    assert "did not answer within 0.5 s" in (probe.error or "")


def test_doctor_refuses_a_pair_serving_different_models(start_engine: Any) -> None:
    options = DoctorOptions(
        side_channels=(start_engine("prefill-a"), start_engine("decode-b", model="other")),
        transfer=False,
    )
    report = run_doctor(options, env=ENV)
    assert report.exit_code == 1
    (pair,) = [c for c in report.checks if c.name.startswith("pair")]
    assert pair.status == "fail"
    assert "model: local 'tiny', remote 'other'" in pair.summary


@pytest.mark.parametrize(
    ("doctor_secret", "status", "text"),
    [(SECRET, "ok", "within the ±60 s replay window"),
     (None, "fail", "refused the request")],
    ids=["with the secret, clocks are bounded", "without it, the handshake is refused"],
)  # fmt: skip
def test_doctor_with_a_secret(
    start_engine: Any, doctor_secret: str | None, status: str, text: str
) -> None:
    address = start_engine("prefill-s", secret=SECRET)
    env = {key: value for key, value in ENV.items() if key != ENV_SIDE_CHANNEL_SECRET}
    if doctor_secret is not None:
        env[ENV_SIDE_CHANNEL_SECRET] = doctor_secret
    report = run_doctor(DoctorOptions(side_channels=(address,), transfer=False), env=env)
    checks = {c.name: c for c in report.checks}
    if status == "ok":
        assert checks["clocks"].status == "ok" and text in checks["clocks"].summary
        assert report.exit_code == 0
    else:
        check = checks[f"side channel {address}"]
        assert check.status == "fail" and text in check.summary
        assert "NIXL_PD_SIDE_CHANNEL_SECRET" in (check.fix or "")
        assert report.exit_code == 1


@pytest.mark.parametrize(
    ("env_change", "timeout_s", "reason"),
    [({"UCX_NET_DEVICES": "nosuch0"}, 60.0,
      "target: TransferFailed: creating NIXL backend 'UCX' for agent 'doctor-target-"),
     ({}, 0.5, "target gave no READY line in time")],
    ids=["UCX cannot start on a missing device", "the deadline passes"],
)  # fmt: skip
def test_loopback_failures_are_reported_and_bounded(
    env_change: dict[str, str], timeout_s: float, reason: str
) -> None:
    start_s = time.monotonic()
    result = run_loopback({**ENV, **env_change}, num_bytes=2**20, num_reads=1, timeout_s=timeout_s)
    assert not result.ok
    assert reason in (result.error or "")
    assert time.monotonic() - start_s < timeout_s + 30  # children stopped, not waited for


def test_the_lanes_survive_a_reader_killed_after_its_result(monkeypatch: Any) -> None:
    """On a busy host the doctor may have to kill a reader that is slow to exit: UCX's log,
    which names the lanes, must already be written out (it was lost, "unknown", in CI)."""
    stop = PeerProcess.stop

    def kill_the_reader_first(peer: PeerProcess) -> None:
        if peer.role == "reader":
            peer._proc.kill()
        stop(peer)

    monkeypatch.setattr(PeerProcess, "stop", kill_the_reader_first)
    result = run_loopback(ENV, num_bytes=2**20, num_reads=1, timeout_s=60.0)
    assert result.ok and result.bytes_matched
    assert result.read_lanes, "the killed reader's UCX log named no lane"
    assert result.transport_class in ("shared-memory", "rdma", "tcp")
