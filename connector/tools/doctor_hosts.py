"""The doctor's two-host mode: what the two sides say to each other, and the verdicts on it.

`nixl-pd doctor --listen HOST:PORT` on one host serves a NIXL target; `nixl-pd doctor --peer
HOST:PORT` on the other READs it and names the UCX transport that moved the bytes
(connector.tools.doctor_remote does the I/O). Between two hosts, only a network transport can work:
seeing CMA or shared memory means both sides share one kernel (the same machine, or network
namespaces of one machine), so the READ says nothing about the network.

Pure: messages and facts in, Checks out.
"""

from __future__ import annotations

import msgspec

from connector.tools.doctor_checks import Check, Status
from connector.tools.doctor_ucx import TransportClass, transport_class

MAX_REMOTE_BYTES = 2**30  # the largest READ a listener may offer (the peer allocates it)


class RemoteRead(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The READ between the two hosts, as the reading side saw it."""

    ok: bool
    listener: str  # HOST:PORT of `doctor --listen`
    ucx_net_devices: str | None = None  # the reader's
    ucx_tls: str | None = None  # the reader's
    num_bytes: int = 0  # per READ
    num_reads: int = 0  # timed READs (after one warm-up)
    seconds: float = 0.0
    gbps: float = 0.0
    bytes_matched: bool = False
    read_lanes: tuple[str, ...] = ()  # e.g. ("tcp/eth1",)
    transport_class: TransportClass = "unknown"
    scopes: tuple[str, ...] = ()  # UCX's placement of the peer: "inter-node", "intra-node"
    error: str | None = None


# The exchange, over one ZMQ REQ (peer) / REP (listener) pair: Hello -> Offer, Report -> Bye.
class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="hello"):
    pass


class Offer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="offer"):
    address: int  # of the target's buffer, in the listener's process
    num_bytes: int
    agent_metadata: bytes  # the target agent's NIXL metadata


class Report(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="report"):
    read: RemoteRead


class Bye(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="bye"):
    error: str | None = None  # why the listener refused a message, if it did


Message = Hello | Offer | Report | Bye
MESSAGE_DECODER = msgspec.msgpack.Decoder(Message)


def check_tls_across_hosts(ucx_tls: str | None) -> list[Check]:
    """A UCX_TLS with no network transport cannot connect two hosts at all."""
    if ucx_tls is None or ucx_tls.startswith("^"):
        return []
    items = [item.strip() for item in ucx_tls.split(",") if item.strip()]
    network = [i for i in items if i in ("all", "tcp") or transport_class(i) == "rdma"]
    if network:
        return []
    summary = (
        f"UCX_TLS={ucx_tls} has no network transport: CMA and shared memory cannot "
        "cross hosts, so engines on two hosts cannot connect"
    )
    fix = "add a network transport on both hosts: UCX_TLS=tcp, or rc,ud (RDMA), or unset it"
    return [Check("UCX_TLS", "fail", summary, fix)]


def check_remote_read(read: RemoteRead, rdma_devices: tuple[str, ...] = ()) -> list[Check]:
    """The two-host READ: did it work, was it the bytes, and did it cross a network?"""
    where = f"from {read.listener}"
    if not read.ok:
        fix = (
            "start `nixl-pd doctor --listen HOST:PORT` on the other host first, with HOST its "
            "address on the link between the hosts; set UCX_NET_DEVICES on both sides to "
            "that link's device and allow its port through any firewall"
        )
        return [Check("two hosts", "fail", f"READ {where} failed: {read.error}", fix)]
    if not read.bytes_matched:
        fix = "report this: NIXL or UCX delivered wrong data"
        return [Check("two hosts", "fail", f"READ {where} completed but the bytes differ", fix)]
    lanes = ", ".join(read.read_lanes) or "?"
    scope = "/".join(read.scopes) or "placement not printed"
    measured = (
        f"{lanes} (UCX: {scope}) at {read.gbps:.2f} GB/s, {read.num_reads} READs of "
        f"{read.num_bytes / 2**20:.0f} MiB {where}"
    )
    status, summary, verdict_fix = _verdict(read.transport_class, measured, rdma_devices)
    return [Check("two hosts", status, summary, verdict_fix)]


def _verdict(
    kind: TransportClass, measured: str, rdma_devices: tuple[str, ...]
) -> tuple[Status, str, str | None]:
    if kind == "shared-memory":
        return (
            "fail",
            f"bytes moved by shared memory: {measured}; CMA/shm cannot cross hosts, so these "
            "two sides share one kernel (one machine, or namespaces of one) and the READ did "
            "not touch the network",
            "run the two sides on different hosts, or restrict both to the network: "
            "UCX_TLS=tcp (or rc,ud for RDMA) with UCX_NET_DEVICES=<the link's device>",
        )
    if kind == "tcp" and rdma_devices:
        return (
            "warn",
            f"bytes moved over tcp: {measured}; this host has RDMA devices "
            f"({', '.join(rdma_devices)}) that UCX did not use",
            "name the RDMA device in UCX_NET_DEVICES (e.g. mlx5_0:1) and allow rc/ud in UCX_TLS",
        )
    if kind in ("tcp", "rdma"):
        return "ok", f"bytes moved over the network by {kind}: {measured}", None
    return (
        "warn",
        f"UCX did not name a network transport: {measured}",
        "run with UCX_PROTO_INFO=y and read the 'remote memory read' table yourself",
    )
