"""The doctor's pure parts: UCX protocol-table parsing and every verdict, table-driven."""

from __future__ import annotations

import pytest

from connector.errors import UnsupportedConfiguration
from connector.tools.doctor import DoctorReport, parse_address, render
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
from connector.tools.doctor_ucx import (
    lanes,
    message_lanes,
    parse_proto_tables,
    read_lanes,
    slowest_class,
    transport_class,
)
from worker.handshake import digest_of

MIB = 2**20

# Verbatim from this machine: UCX 1.x in the nixl 1.5.1 wheel, UCX_PROTO_INFO=y, lo only.
REAL_CMA_READ = """\
[1795440830.806934] [vm:19402:0]   +--------+-------------+-------------------------------------------+
[1795440830.806934] [vm:19402:0]   | reader-19402 intra-node cfg#1                                    |
[1795440830.806934] [vm:19402:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795440830.806934] [vm:19402:0]   +--------+-------------+-------------------------------------------+
[1795440830.806934] [vm:19402:0]   | Range  | Description |                  Config                   |
[1795440830.806934] [vm:19402:0]   +--------+-------------+-------------------------------------------+
[1795440830.806934] [vm:19402:0]   | 0..inf | zero-copy   | cma/memory                                |
[1795440830.806934] [vm:19402:0]   +--------+-------------+-------------------------------------------+
"""


def table(scope: str, operation: str, rows: list[tuple[str, str, str]]) -> str:
    """A UCX protocol table as UCX prints it (log prefix included)."""
    prefix = "[1795440830.1] [vm:1:0]   "
    border = prefix + "+--------+-------------+--------+"
    lines = [border, f"{prefix}| agent-1 {scope} cfg#0 |", f"{prefix}| {operation} |", border]
    lines += [f"{prefix}| Range | Description | Config |", border]
    lines += [f"{prefix}| {r} | {d} | {c} |" for r, d, c in rows] + [border]
    return "\n".join(lines) + "\n"


READ = "remote memory read by ucp_get*(multi) into host memory from host"
AM = "active message by ucp_am_send* from host memory"

READ_LANE_CASES = [
    ("cma on this machine", REAL_CMA_READ, MIB, ("cma/memory",)),
    (
        "tcp software emulation (UCX_TLS=tcp)",
        table("intra-node", READ, [("0..inf", "software emulation", "tcp/lo")]),
        MIB,
        ("tcp/lo",),
    ),
    (
        "the row covering the descriptor size wins",
        table(
            "inter-node",
            READ,
            [("0..8184", "short", "tcp/eth0"), ("8185..inf", "zero-copy", "rc_mlx5/mlx5_0:1")],
        ),
        MIB,
        ("rc_mlx5/mlx5_0:1",),
    ),
    (
        "small descriptors use the small-size row",
        table(
            "inter-node",
            READ,
            [("0..8184", "short", "tcp/eth0"), ("8185..inf", "zero-copy", "rc_mlx5/mlx5_0:1")],
        ),
        4096,
        ("tcp/eth0",),
    ),
    (
        "sizes with units",
        table(
            "inter-node", READ, [("0..16K", "copy", "tcp/eth0"), ("16K..inf", "zc", "sysv/memory")]
        ),
        MIB,
        ("sysv/memory",),
    ),
    (
        "multi-lane rows name every lane",
        table(
            "inter-node",
            READ,
            [("0..inf", "zero-copy", "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1")],
        ),
        MIB,
        ("rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"),
    ),
    (
        "an agent's self endpoint says nothing about the peer",
        table("self", READ, [("0..inf", "zero-copy", "cma/memory")]),
        MIB,
        (),
    ),
    (
        "writes and messages are not the READ",
        table("intra-node", AM, [("0..inf", "short", "tcp/lo")]),
        MIB,
        (),
    ),
    ("no tables at all (old UCX)", "UCX  WARN  something else\nhello\n", MIB, ()),
]


@pytest.mark.parametrize(
    ("text", "descriptor_bytes", "expected"),
    [case[1:] for case in READ_LANE_CASES],
    ids=[case[0] for case in READ_LANE_CASES],
)
def test_read_lanes(text: str, descriptor_bytes: int, expected: tuple[str, ...]) -> None:
    assert read_lanes(parse_proto_tables(text), descriptor_bytes) == expected


def test_message_lanes_come_from_active_message_tables() -> None:
    text = REAL_CMA_READ + table("intra-node", AM, [("0", "short", "tcp/lo")])
    assert message_lanes(parse_proto_tables(text)) == ("tcp/lo",)


def test_tables_back_to_back_are_split_by_their_titles() -> None:
    text = table("intra-node", AM, [("0..inf", "short", "tcp/lo")]) + REAL_CMA_READ
    tables = parse_proto_tables(text.replace("\n[1795440830.806934] [vm:19402:0]   +-", "\n+-"))
    assert [(t.scope, t.operation.split(" by ")[0]) for t in tables] == [
        ("intra-node", "active message"),
        ("intra-node", "remote memory read"),
    ]


@pytest.mark.parametrize(
    ("transport", "expected"),
    [("tcp", "tcp"), ("cma", "shared-memory"), ("sysv", "shared-memory"), ("posix", "shared-memory"),
     ("rc_mlx5", "rdma"), ("dc_mlx5", "rdma"), ("rc_verbs", "rdma"), ("srd", "rdma"),
     ("cuda_ipc", "gpu"), ("zcopy", "unknown")],
)  # fmt: skip
def test_transport_class(transport: str, expected: str) -> None:
    assert transport_class(transport) == expected


@pytest.mark.parametrize(
    ("read_lanes_seen", "expected"),
    [(("cma/memory",), "shared-memory"), (("rc_mlx5/mlx5_0:1", "tcp/eth0"), "tcp"),
     (("rc_mlx5/mlx5_0:1", "cma/memory"), "rdma"), ((), "unknown")],
    ids=["cma", "one tcp lane makes the READ slow", "rdma and cma", "no lanes"],
)  # fmt: skip
def test_slowest_class(read_lanes_seen: tuple[str, ...], expected: str) -> None:
    assert slowest_class(read_lanes_seen) == expected


def test_lanes_ignore_words_that_only_look_like_lanes() -> None:
    assert lanes("rndv get/zcopy on rc_mlx5/mlx5_0:1") == ("rc_mlx5/mlx5_0:1",)


# ---- verdicts ----


def loopback(**fields: object) -> Loopback:
    base: dict[str, object] = {
        "ok": True, "ucx_net_devices": "lo", "net_devices_from_env": False, "num_bytes": 32 * MIB,
        "num_reads": 4, "num_descriptors": 32, "seconds": 0.03, "gbps": 4.2,
        "bytes_matched": True, "read_lanes": ("cma/memory",), "transport_class": "shared-memory",
        "message_lanes": ("tcp/lo",),
    }  # fmt: skip
    return Loopback(**{**base, **fields})  # type: ignore[arg-type]


LOOPBACK_CASES = [
    ("cma is the fast same-host path", loopback(), "ok", "bytes moved by cma/shared memory", None),
    (
        "tcp is called out as the slow path, with UCX_TLS in the fix",
        loopback(read_lanes=("tcp/lo",), transport_class="tcp", gbps=0.25, ucx_tls="tcp"),
        "warn",
        "bytes moved over tcp (slow path): tcp/lo at 0.25 GB/s",
        "UCX_TLS='tcp' must allow cma",
    ),
    (
        "RDMA is fine",
        loopback(read_lanes=("rc_mlx5/mlx5_0:1",), transport_class="rdma"),
        "ok",
        "bytes moved by RDMA: rc_mlx5/mlx5_0:1",
        None,
    ),
    (
        "no protocol table: say so",
        loopback(read_lanes=(), transport_class="unknown"),
        "warn",
        "UCX did not say which transport moved the bytes",
        "UCX_PROTO_INFO=y",
    ),
    (
        "the doctor's UCX_NET_DEVICES default is stated",
        loopback(),
        "ok",
        "UCX_NET_DEVICES=lo (unset in your environment; doctor default)",
        None,
    ),
    (
        "a failed READ fails",
        loopback(ok=False, error="reader: TimeoutError: a READ did not finish in time"),
        "fail",
        "loopback READ failed (UCX_NET_DEVICES=lo (unset in your environment; doctor default)): "
        "reader: TimeoutError",
        "UCX_LOG_LEVEL=info",
    ),
    (
        "wrong bytes fail",
        loopback(bytes_matched=False),
        "fail",
        "loopback READ completed but the bytes differ",
        "report this",
    ),
]


@pytest.mark.parametrize(
    ("result", "status", "summary", "fix"),
    [case[1:] for case in LOOPBACK_CASES],
    ids=[case[0] for case in LOOPBACK_CASES],
)
def test_check_loopback(result: Loopback, status: str, summary: str, fix: str | None) -> None:
    (check,) = check_loopback(result)
    assert check.status == status
    assert summary in check.summary
    assert (check.fix is None) if fix is None else (fix in (check.fix or ""))


NIXL_CASES = [
    (
        "NIXL missing",
        NixlProbe(loaded=False, error="ModuleNotFoundError: No module named 'nixl'"),
        [("fail", "NIXL does not load: ModuleNotFoundError: No module named 'nixl'")],
    ),
    (
        "no UCX plugin",
        NixlProbe(True, "1.5.1", "nixl_cu13", ("POSIX",)),
        [
            ("ok", "nixl 1.5.1 (nixl_cu13) loads; plugins: POSIX"),
            ("fail", "no UCX backend: UCX is not among the plugins found (POSIX)"),
        ],
    ),  # fmt: skip
    (
        "UCX backend fails to start",
        NixlProbe(True, "1.5.1", "nixl_cu13", ("UCX",), error="creating the UCX backend failed"),
        [("ok", "plugins: UCX"), ("fail", "no UCX backend: creating the UCX backend failed")],
    ),
    (
        "UCX backend fails to start: the fix points at UCX's own settings",
        NixlProbe(True, "1.5.1", "nixl_cu13", ("UCX",), error="nixlBackendError"),
        [("ok", "plugins: UCX"), ("fail", "no UCX backend: nixlBackendError")],
    ),
    (
        "all well",
        NixlProbe(True, "1.5.1", "nixl_cu13", ("POSIX", "UCX"), ("UCX",)),
        [("ok", "plugins: POSIX, UCX"), ("ok", "UCX backend created")],
    ),
]


@pytest.mark.parametrize(
    ("probe", "expected"), [c[1:] for c in NIXL_CASES], ids=[c[0] for c in NIXL_CASES]
)
def test_check_nixl(probe: NixlProbe, expected: list[tuple[str, str]]) -> None:
    checks = check_nixl(probe)
    assert [(c.status, e) for c, (_, e) in zip(checks, expected, strict=True)] == expected
    assert all(text in check.summary for check, (_, text) in zip(checks, expected, strict=True))
    assert all(c.fix for c in checks if c.status == "fail")
    if "UCX" in probe.plugins and not probe.backends:
        assert "check that UCX_NET_DEVICES and UCX_TLS name devices" in (checks[-1].fix or "")


@pytest.mark.parametrize(
    ("fraction", "status", "text"),
    [
        (0.01, "ok", "used 1% of a core"),
        (0.98, "warn", "used 98% of a core: its progress thread spins"),
    ],
    ids=["delayed progress thread", "spinning progress thread"],
)
def test_check_progress(fraction: float, status: str, text: str) -> None:
    (check,) = check_progress(fraction)
    assert (check.status, text in check.summary) == (status, True)


def engine(
    engine_id: str, *, model: str = "tiny", tp_size: int = 1, **fields: object
) -> SideChannelProbe:
    facts = {"protocol_version": "2", "model": model, "dtype": "float16"}
    base: dict[str, object] = {
        "address": f"127.0.0.1:{5600 + len(engine_id)}", "reachable": True, "engine_id": engine_id,
        "protocol_version": 2, "tp_size": tp_size, "ranks_answered": tp_size,
        "fingerprint": digest_of(facts), "compat_facts": facts, "round_trip_ms": 1.5,
    }  # fmt: skip
    return SideChannelProbe(**{**base, **fields})  # type: ignore[arg-type]


SIDE_CHANNEL_CASES = [
    (
        "a live engine",
        engine("prefill-0"),
        "ok",
        "engine prefill-0: protocol 2, TP 1 (1/1 ranks answered)",
        None,
    ),
    (
        "a dead address",
        engine("x", reachable=False, error="side channel 127.0.0.1:9 did not answer within 1.0 s"),
        "fail",
        "no handshake: side channel 127.0.0.1:9 did not answer within 1.0 s",
        "start the engine",
    ),
    (
        "a secret is needed",
        engine("x", reachable=False, error="refused the request: authentication failed"),
        "fail",
        "authentication failed",
        "export NIXL_PD_SIDE_CHANNEL_SECRET",
    ),
    (
        "another protocol version",
        engine("x", reachable=False, error="peer speaks side-channel protocol version 3"),
        "fail",
        "protocol version 3",
        "same nixl-pd-connector version",
    ),
    (
        "a TP rank that never registered",
        engine("p", tp_size=2, ranks_answered=1, error="TP rank 1 of 2: unknown TP rank"),
        "fail",
        "but TP rank 1 of 2: unknown TP rank",
        "every TP rank",
    ),
]


@pytest.mark.parametrize(
    ("probe", "status", "summary", "fix"),
    [c[1:] for c in SIDE_CHANNEL_CASES],
    ids=[c[0] for c in SIDE_CHANNEL_CASES],
)
def test_check_side_channel(
    probe: SideChannelProbe, status: str, summary: str, fix: str | None
) -> None:
    check = check_side_channel(probe)
    assert check.status == status
    assert summary in check.summary
    assert (check.fix is None) if fix is None else (fix in (check.fix or ""))


PAIR_CASES = [
    ("same model, TP 2 and 1", engine("prefill", tp_size=2), engine("decode"), "ok",
     "compatible: protocol 2, same model fingerprint"),
    ("different models", engine("prefill"), engine("decode", model="other"), "fail",
     "): prefill and decode engines are not compatible: model: local 'tiny', remote 'other'"),
    ("TP sizes that do not divide", engine("prefill", tp_size=3), engine("decode", tp_size=2),
     "fail", "incompatible (127.0.0.1:5607 as local, 127.0.0.1:5606 as remote): "),
    ("protocol versions differ", engine("prefill"), engine("decode", protocol_version=3), "fail",
     "incompatible: protocol version 2 at"),
    ("a tampered fingerprint", engine("prefill"), engine("decode", fingerprint="abc"), "fail",
     "does not match the facts it sent"),
    ("one engine given twice", engine("prefill"), engine("prefill"), "warn", "are one engine"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("first", "second", "status", "summary"),
    [c[1:] for c in PAIR_CASES],
    ids=[c[0] for c in PAIR_CASES],
)
def test_check_pair(
    first: SideChannelProbe, second: SideChannelProbe, status: str, summary: str
) -> None:
    check = check_pair(first, second)
    assert check.status == status
    assert summary in check.summary
    assert status == "ok" or check.fix


def test_clocks_are_not_invented_without_a_timestamp() -> None:
    check = check_clocks([engine("a"), engine("b")])
    assert (
        check.status,
        check.summary.startswith("not checked: side-channel replies carry no timestamp"),
    ) == ("info", True)


def test_clocks_are_bounded_by_a_signed_handshake() -> None:
    check = check_clocks([engine("a", signed=True), engine("b", signed=True)])
    assert check.status == "ok"
    assert "within the ±60 s replay window" in check.summary


@pytest.mark.parametrize(
    ("statuses", "strict", "code"),
    [(("ok", "info"), False, 0), (("ok", "warn"), False, 0), (("ok", "warn"), True, 1),
     (("fail",), False, 1)],
    ids=["all ok", "a warning passes", "a warning fails under --strict", "a failure fails"],
)  # fmt: skip
def test_exit_code(statuses: tuple[str, ...], strict: bool, code: int) -> None:
    checks = [Check(f"c{i}", s, "x") for i, s in enumerate(statuses)]  # type: ignore[arg-type]
    assert exit_code(checks, strict=strict) == code


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:5600", ("127.0.0.1", 5600)), ("[::1]:5600", ("::1", 5600)),
     ("engine-a.local:1", ("engine-a.local", 1))],
)  # fmt: skip
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["127.0.0.1", ":5600", "h:0", "h:65536", "h:http", ""])
def test_parse_address_refuses(address: str) -> None:
    with pytest.raises(
        UnsupportedConfiguration, match=r"is not HOST:PORT with a port in 1\.\.65535"
    ):
        parse_address(address)


def test_render_puts_each_fix_under_its_problem() -> None:
    checks = (
        Check("transfer", "warn", "bytes moved over tcp (slow path)", "unset UCX_TLS"),
        Check("nixl", "ok", "loads", "never shown"),
    )
    report = DoctorReport(True, 0, NixlProbe(True), None, (), checks)
    assert render(report).splitlines() == [
        "nixl-pd doctor: OK (0 failed, 1 warning)",
        "  warn  transfer  bytes moved over tcp (slow path)",
        "                  fix: unset UCX_TLS",
        "  ok    nixl      loads",
    ]
