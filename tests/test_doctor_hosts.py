"""The doctor's two-host verdicts (pure) and its refusal of a self-contradicting command line.

The real READ between two hosts runs in tests/test_two_hosts.py (network namespaces).
"""

from __future__ import annotations

import pytest

from connector.errors import UnsupportedConfiguration
from connector.tools.doctor import DoctorOptions, run_doctor
from connector.tools.doctor_hosts import (
    MESSAGE_DECODER,
    Offer,
    RemoteRead,
    check_remote_read,
    check_tls_across_hosts,
)
from connector.tools.doctor_ucx import all_read_lanes, parse_proto_tables, read_scopes


def remote(**changes: object) -> RemoteRead:
    facts: dict[str, object] = {
        "ok": True, "listener": "10.0.0.1:5700", "num_bytes": 32 * 2**20, "num_reads": 4,
        "seconds": 0.13, "gbps": 1.03, "bytes_matched": True, "read_lanes": ("tcp/eth1",),
        "transport_class": "tcp", "scopes": ("inter-node",),
    }  # fmt: skip
    facts.update(changes)
    return RemoteRead(**facts)  # type: ignore[arg-type]


REMOTE_CASES = {
    "tcp-between-hosts-is-ok": (
        remote(),
        (),
        "ok",
        "bytes moved over the network by tcp: tcp/eth1 (UCX: inter-node) at 1.03 GB/s, "
        "4 READs of 32 MiB from 10.0.0.1:5700",
    ),
    "rdma-is-ok": (
        remote(read_lanes=("rc_mlx5/mlx5_0:1",), transport_class="rdma"),
        ("mlx5_0",),
        "ok",
        "bytes moved over the network by rdma: rc_mlx5/mlx5_0:1",
    ),
    "tcp-with-idle-rdma-devices-warns": (
        remote(),
        ("mlx5_0",),
        "warn",
        "this host has RDMA devices (mlx5_0) that UCX did not use",
    ),
    "cma-cannot-cross-hosts": (
        remote(read_lanes=("cma/memory",), transport_class="shared-memory", scopes=("intra-node",)),
        (),
        "fail",
        "bytes moved by shared memory: cma/memory (UCX: intra-node) at 1.03 GB/s, 4 READs of "
        "32 MiB from 10.0.0.1:5700; CMA/shm cannot cross hosts",
    ),
    "unnamed-transport-warns": (
        remote(read_lanes=(), transport_class="unknown", scopes=()),
        (),
        "warn",
        "UCX did not name a network transport: ? (UCX: placement not printed)",
    ),
    "wrong-bytes-fail": (remote(bytes_matched=False), (), "fail", "the bytes differ"),
    "no-listener-fails": (
        remote(ok=False, error="no answer from the listener (is doctor --listen running?) in time"),
        (),
        "fail",
        "READ from 10.0.0.1:5700 failed: no answer from the listener",
    ),
}


@pytest.mark.parametrize(
    ("read", "rdma_devices", "status", "summary"),
    list(REMOTE_CASES.values()),
    ids=list(REMOTE_CASES),
)
def test_check_remote_read(
    read: RemoteRead, rdma_devices: tuple[str, ...], status: str, summary: str
) -> None:
    (check,) = check_remote_read(read, rdma_devices)

    assert (check.name, check.status) == ("two hosts", status)
    assert summary in check.summary
    assert (check.fix is None) == (status == "ok")


@pytest.mark.parametrize(
    ("ucx_tls", "fails"),
    [
        (None, False),
        ("tcp", False),
        ("rc,ud,sm", False),
        ("all", False),
        ("^cma", False),
        ("cma", True),
        ("sm,self", True),
        ("posix,sysv,cma", True),
    ],
)
def test_a_ucx_tls_without_a_network_transport_cannot_cross_hosts(
    ucx_tls: str | None, fails: bool
) -> None:
    checks = check_tls_across_hosts(ucx_tls)

    assert bool(checks) == fails
    if fails:
        assert checks[0].status == "fail"
        assert "CMA and shared memory cannot cross hosts" in checks[0].summary


PROTO_TEXT = """
[1.0] [vm:1:0]   | reader intra-node cfg#0                                          |
[1.0] [vm:1:0]   | remote memory read by ucp_get* into host memory from host       |
[1.0] [vm:1:0]   | 0..inf | zero-copy | cma/memory |
[1.0] [vm:1:0]   | reader self cfg#1                                                |
[1.0] [vm:1:0]   | remote memory read by ucp_get* into host memory from host       |
[1.0] [vm:1:0]   | 0..inf | zero-copy | self/memory |
[1.0] [vm:1:0]   | reader inter-node cfg#2                                          |
[1.0] [vm:1:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.0] [vm:1:0]   | 0..8K | software emulation | tcp/veth-decode |
[1.0] [vm:1:0]   | 8K..inf | software emulation | tcp/eth1 |
"""


def test_every_read_lane_and_placement_ucx_printed_for_other_processes() -> None:
    tables = parse_proto_tables(PROTO_TEXT)

    assert all_read_lanes(tables) == ("cma/memory", "tcp/veth-decode", "tcp/eth1")
    assert read_scopes(tables) == ("intra-node", "inter-node")


def test_the_offer_round_trips_through_the_typed_decoder() -> None:
    import msgspec

    offer = Offer(address=4096, num_bytes=2**20, agent_metadata=b"\x00meta")

    assert MESSAGE_DECODER.decode(msgspec.msgpack.encode(offer)) == offer
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'shutdown'"):
        MESSAGE_DECODER.decode(msgspec.msgpack.encode({"type": "shutdown"}))


def test_listen_and_peer_together_are_refused_before_anything_runs() -> None:
    options = DoctorOptions(listen="10.0.0.1:5700", peer="10.0.0.2:5700", transfer=False)

    with pytest.raises(UnsupportedConfiguration, match="--listen and --peer are the two ends"):
        run_doctor(options, env={})


def test_a_malformed_listen_address_names_the_flag() -> None:
    with pytest.raises(UnsupportedConfiguration, match="--listen '10.0.0.1' is not HOST:PORT"):
        run_doctor(DoctorOptions(listen="10.0.0.1"), env={})
