"""Which UCX transports carried a READ: parse the protocol tables UCX prints with UCX_PROTO_INFO=y.

With ``UCX_PROTO_INFO=y`` UCX prints, for every endpoint configuration it builds, one table per
operation (log file prefixes elided)::

    +--------+-------------+-----------------------------------------+
    | reader-18556 intra-node cfg#1                                    |
    | remote memory read by ucp_get*(multi) into host memory from host |
    +--------+-------------+-----------------------------------------+
    | Range  | Description |                  Config                 |
    +--------+-------------+-----------------------------------------+
    | 0..inf | zero-copy   | cma/memory                              |
    +--------+-------------+-----------------------------------------+

The title names the scope (``self`` is the agent talking to itself, ``intra-node`` a peer on
this host, ``inter-node`` one on another host) and the operation; each row maps a message size
range to ``transport/device`` lanes. A one-sided NIXL READ is a "remote memory read"; its row
for our descriptor size says how the bytes moved. With UCX_TLS=tcp the same row says
``software emulation | tcp/lo``: the silent slow path this module exists to expose.
Pure: text in, values out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

import msgspec

TransportClass = Literal["tcp", "shared-memory", "rdma", "gpu", "unknown"]

# UCT transport names, by what they mean for a KV transfer.
_SHARED_MEMORY = frozenset({"cma", "knem", "xpmem", "sysv", "posix", "self", "mm"})
_RDMA_PREFIXES = ("rc", "dc", "ud", "srd", "ib", "gga")
_GPU_PREFIXES = ("cuda_", "rocm_", "gdr_", "ze_")

_LOG_PREFIX = re.compile(r"^(?:\s*\[[^\]]*\])*\s*")  # "[1795440763.68] [vm:18556:0]   "
_SCOPE = re.compile(r"\b(self|intra-node|inter-node)\b")
_LANE = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.:\-]+)")
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^(\d+)([KMGT]?B?)$")


class ProtoRow(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One size range of a protocol table: [first_bytes, last_bytes] (None: no upper bound)."""

    first_bytes: int
    last_bytes: int | None
    description: str
    config: str


class ProtoTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope: str  # "self", "intra-node", "inter-node", or "" when the title does not say
    operation: str  # e.g. "remote memory read by ucp_get*(multi) into host memory from host"
    rows: tuple[ProtoRow, ...]


def transport_class(transport: str) -> TransportClass:
    """What a UCT transport name ("tcp", "cma", "rc_mlx5", ...) means for bandwidth."""
    if transport == "tcp":
        return "tcp"
    if transport in _SHARED_MEMORY:
        return "shared-memory"
    if transport.startswith(_RDMA_PREFIXES):
        return "rdma"
    if transport.startswith(_GPU_PREFIXES):
        return "gpu"
    return "unknown"


def slowest_class(lanes: Iterable[str]) -> TransportClass:
    """The verdict for a READ striped over ``lanes``: its slowest one (one TCP lane is slow).

    No lanes at all: "unknown".
    """
    classes = {transport_class(lane.split("/")[0]) for lane in lanes}
    order: tuple[TransportClass, ...] = ("tcp", "unknown", "gpu", "rdma", "shared-memory")
    return next((kind for kind in order if kind in classes), "unknown")


def lanes(config: str) -> tuple[str, ...]:
    """The ``transport/device`` lanes named in a Config cell, in order, without repeats.

    "cma/memory" -> ("cma/memory",); "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1"
    -> both lanes. Words like "get/zcopy" are not lanes: only known transports count.
    """
    found: list[str] = []
    for transport, device in _LANE.findall(config):
        lane = f"{transport}/{device}"
        if transport_class(transport) != "unknown" and lane not in found:
            found.append(lane)
    return tuple(found)


def parse_proto_tables(text: str) -> tuple[ProtoTable, ...]:
    """Every protocol table in a UCX log; lines that are not part of a table are skipped."""
    tables: list[ProtoTable] = []
    titles: list[str] = []
    rows: list[ProtoRow] = []
    for raw_line in text.splitlines():
        line = _LOG_PREFIX.sub("", raw_line, count=1).rstrip()
        if line.startswith("+"):
            continue
        if not (line.startswith("|") and line.endswith("|") and len(line) > 1):
            _flush(tables, titles, rows)
            continue
        cells = [cell.strip() for cell in line[1:-1].split("|")]
        if len(cells) == 1:
            if rows:  # a title after rows starts the next table
                _flush(tables, titles, rows)
            titles.append(cells[0])
        elif cells[0] != "Range" and (row := _row(cells)) is not None:
            rows.append(row)
    _flush(tables, titles, rows)
    return tuple(tables)


def read_lanes(tables: Iterable[ProtoTable], descriptor_bytes: int) -> tuple[str, ...]:
    """The lanes UCX chose for a remote memory read of ``descriptor_bytes`` to another process.

    Tables of the ``self`` scope (an agent's endpoint to itself) are ignored: they say nothing
    about the peer. Empty when UCX printed no such table (old UCX, or UCX_PROTO_ENABLE=n).
    """
    return _lanes(tables, "remote memory read", descriptor_bytes)


def message_lanes(tables: Iterable[ProtoTable]) -> tuple[str, ...]:
    """The lanes UCX uses for active messages (NIXL notifications) to another process."""
    return _lanes(tables, "active message")


def _lanes(
    tables: Iterable[ProtoTable], operation: str, num_bytes: int | None = None
) -> tuple[str, ...]:
    """The lanes of the tables of ``operation`` to another process, in first-seen order; with
    ``num_bytes``, only the size ranges that cover it."""
    found: list[str] = []
    for table in tables:
        if table.scope == "self" or operation not in table.operation:
            continue
        for row in table.rows:
            if num_bytes is None or _covers(row, num_bytes):
                found.extend(lane for lane in lanes(row.config) if lane not in found)
    return tuple(found)


def _flush(tables: list[ProtoTable], titles: list[str], rows: list[ProtoRow]) -> None:
    if rows:
        scope_match = next((m for m in map(_SCOPE.search, titles) if m), None)
        scope = scope_match.group(1) if scope_match else ""
        operation = next((t for t in titles if " by " in t), titles[-1] if titles else "")
        tables.append(ProtoTable(scope, operation, tuple(rows)))
    titles.clear()
    rows.clear()


def _row(cells: list[str]) -> ProtoRow | None:
    """A data row: ``Range | Description | Config`` (extra middle cells join the description)."""
    if len(cells) < 3:
        return None
    first, _, last = cells[0].partition("..")
    first_bytes = _size(first)
    last_bytes = _size(last) if last else first_bytes
    if first_bytes is None or (last_bytes is None and last != "inf"):
        return None
    return ProtoRow(first_bytes, last_bytes, " ".join(cells[1:-1]), cells[-1])


def _size(text: str) -> int | None:
    """ "8184" -> 8184, "16K" -> 16384, "inf" (or garbage) -> None."""
    match = _SIZE.match(text.strip())
    if match is None:
        return None
    return int(match.group(1)) * _UNITS[match.group(2).rstrip("B")]


def _covers(row: ProtoRow, num_bytes: int) -> bool:
    return row.first_bytes <= num_bytes and (row.last_bytes is None or num_bytes <= row.last_bytes)


def all_read_lanes(tables: Iterable[ProtoTable]) -> tuple[str, ...]:
    """Every lane of every size range of the remote-memory-read tables to another process:
    what an engine's READs of any size could have used (``read_lanes`` picks one size)."""
    return _lanes(tables, "remote memory read")


def read_scopes(tables: Iterable[ProtoTable]) -> tuple[str, ...]:
    """How UCX placed the peers of remote memory reads: "intra-node" (same machine as far as
    UCX can tell, so shared memory is possible) and/or "inter-node"."""
    scopes = (table.scope for table in tables if "remote memory read" in table.operation)
    return tuple(dict.fromkeys(scope for scope in scopes if scope not in ("", "self")))
