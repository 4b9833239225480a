"""One P->D request's timeline from the router's, the engines' and our trace's stamps; the table.

Pure: reads the probe files (benchmarks/latency_probe.py) and the router's records, returns
rows. Every time is wall-clock seconds on one machine, so stamps from different processes
line up. A stage whose stamps one connector does not have is left out for it ("-").
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROUTER_ID = re.compile(r"lat(\d{5})x")  # the X-Request-Id the router sends: lat00042x
# The READ itself: post() copies small same-host READs inline, so from the plan to DONE seen.
READ_STAGE = "READs: posted (copied inside post()) and seen done"


@dataclass(frozen=True)
class RouterStamps:
    """What the router saw of one request (wall-clock seconds)."""

    seq: int
    connector: str  # "ours" or "vLLM"
    num_tokens: int
    prefill_sent: float
    params_back: float  # prefill's answer (with the params) read
    decode_sent: float
    first_token: float  # the first streamed token event read
    last_token: float
    num_output_tokens: int

    @property
    def decode_step_s(self) -> float:
        """One decode step: the inter-token time of this request's stream."""
        return (self.last_token - self.first_token) / max(1, self.num_output_tokens - 1)


def request_id(seq: int) -> str:
    return f"lat{seq:05d}x"


def read_probe(path: Path) -> dict[int, dict[str, float]]:
    """{router seq: {event: first time}} from one engine's probe file."""
    events: dict[int, dict[str, float]] = {}
    if not path.exists():
        return events
    for line in path.read_text().splitlines():
        record = json.loads(line)
        match = ROUTER_ID.search(record["rid"])
        if match is not None:
            events.setdefault(int(match.group(1)), {}).setdefault(record["event"], record["t"])
    return events


def read_traces(path: Path) -> dict[int, dict[str, float]]:
    """{router seq: {stage: wall-clock time}} from our trace lines (connector/trace.py):
    each line's ms are since the load was scheduled on the rank, and it was logged at end."""
    stages: dict[int, dict[str, float]] = {}
    if not path.exists():
        return stages
    for line in path.read_text().splitlines():
        record = json.loads(line)
        trace = record["trace"]
        match = ROUTER_ID.search(trace.get("request_id", ""))
        if trace.get("event") != "load" or match is None or trace["outcome"] != "ok":
            continue
        scheduled = record["t"] - trace["ended_ms"] / 1e3
        stamps = {"rank_scheduled": scheduled}
        for name in ("handshake_ready", "planned", "posted", "done", "ended"):
            if trace.get(f"{name}_ms") is not None:
                stamps[f"rank_{name}"] = scheduled + trace[f"{name}_ms"] / 1e3
        stages[int(match.group(1))] = stamps
    return stages


# (row label, start stamp, end stamp): "router." stamps are the router's, "P." prefill's
# probe, "D." decode's probe, "D.rank_*" our trace on decode's rank.
STAGES: tuple[tuple[str, str, str], ...] = (
    ("router sends -> prefill claims", "router.prefill_sent", "P.claimed"),
    ("prefill claims -> params returned (request_finished)", "P.claimed", "P.finished"),
    ("params returned -> router has them", "P.finished", "router.params_back"),
    ("router sends to decode -> decode claims", "router.decode_sent", "D.claimed"),
    ("decode claims -> worker's start_load_kv", "D.claimed", "D.load_started"),
    ("start_load_kv -> transfer thread has the load", "D.load_started", "D.rank_scheduled"),
    ("-> lease pre-check answered, READs planned (handshake: warm)", "D.rank_scheduled",
     "D.rank_planned"),
    ("start_load_kv (posts vLLM's READs) returns", "D.load_started", "D.load_returned"),
    (READ_STAGE, "D.rank_planned", "D.rank_done"),
    ("READs done -> load ended (lease proof, notify)", "D.rank_done", "D.rank_ended"),
    ("load ended -> reported to vLLM (get_transfer_results)", "D.rank_ended",
     "D.load_reported"),
    ("start_load_kv returned -> reported to vLLM", "D.load_returned", "D.load_reported"),
    ("reported -> first-token step scheduled", "D.load_reported", "D.scheduled"),
    ("first-token step scheduled -> first token at router", "D.scheduled",
     "router.first_token"),
)  # fmt: skip


def timeline(
    router: RouterStamps,
    prefill: Mapping[str, float],
    decode: Mapping[str, float],
    traces: Mapping[str, float],
) -> dict[str, float]:
    """Every stage's and summary's duration in ms for one request (stages with stamps only)."""
    stamps = {f"router.{k}": v for k, v in vars(router).items() if isinstance(v, float)}
    stamps.update({f"P.{k}": v for k, v in prefill.items()})
    stamps.update({f"D.{k}": v for k, v in decode.items()})
    stamps.update({f"D.{k}": v for k, v in traces.items()})
    row = {
        label: (stamps[end] - stamps[start]) * 1e3
        for label, start, end in STAGES
        if start in stamps and end in stamps
    }
    step_ms = router.decode_step_s * 1e3
    share_ms = (router.first_token - router.decode_sent) * 1e3 - step_ms
    if "D.claimed" in stamps and "D.load_reported" in stamps:
        connector_ms = (stamps["D.load_reported"] - stamps["D.claimed"]) * 1e3
        row["CONNECTOR'S PART: decode claims -> load reported to vLLM"] = connector_ms
    row["one decode step (inter-token)"] = step_ms
    row["DECODE SHARE: decode receives -> first token, minus one step"] = share_ms
    if READ_STAGE in row:
        row["decode share / READ time"] = share_ms / max(row[READ_STAGE], 1e-3)
    row["TTFT at the router"] = (router.first_token - router.prefill_sent) * 1e3
    return row


def table(rows: Iterable[tuple[str, int, dict[str, float]]]) -> list[str]:
    """Markdown: one line per stage, one column per (size, connector): median [p90] ms."""
    cells: dict[tuple[int, str], list[dict[str, float]]] = {}
    for connector, num_tokens, row in rows:
        cells.setdefault((num_tokens, connector), []).append(row)
    columns = sorted(cells, key=lambda key: (key[0], key[1] == "vLLM", key[1]))
    labels: list[str] = []
    for samples in cells.values():
        for row in samples:
            labels += [label for label in row if label not in labels]
    order = [label for label, _, _ in STAGES] + [x for x in labels if x not in dict.fromkeys(
        label for label, _, _ in STAGES)]  # fmt: skip
    header = "| stage | " + " | ".join(f"{n} tok, {c} (n={len(cells[(n, c)])})"
                                        for n, c in columns) + " |"  # fmt: skip
    lines = [header, "|---|" + "---:|" * len(columns)]
    for label in (x for x in order if x in labels):
        values = [[row[label] for row in cells[key] if label in row] for key in columns]
        lines.append(f"| {label} | " + " | ".join(_cell(v) for v in values) + " |")
    return lines


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return f"{statistics.median(ordered):.1f} [{p90:.1f}]"
