"""benchmarks/latency_timeline.py: one request's stages from the router's, the probe's and our
trace's stamps (wall-clock seconds; a trace line's ms count from the load's scheduling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.latency_timeline import (
    READ_STAGE,
    RouterStamps,
    read_probe,
    read_traces,
    request_id,
    table,
    timeline,
)

T0 = 1_000.0
ROUTER = RouterStamps(7, "ours", 128, prefill_sent=T0, params_back=T0 + 0.050,
                      decode_sent=T0 + 0.051, first_token=T0 + 0.200, last_token=T0 + 0.230,
                      num_output_tokens=4)  # fmt: skip
ENGINE_RID = f"cmpl-{request_id(7)}-0-1a2b3c4d"  # as vLLM builds it from X-Request-Id


def _trace_line(logged_s: float, **changes: object) -> str:
    trace = {
        "event": "load",
        "request_id": ENGINE_RID,
        "outcome": "ok",
        "handshake_ready_ms": 0.0,
        "planned_ms": 20.0,
        "posted_ms": 21.0,
        "done_ms": 22.0,
        "ended_ms": 30.0,
    } | changes
    return json.dumps({"t": logged_s, "trace": trace})  # fmt: skip


def test_trace_times_count_back_from_when_the_line_was_logged(tmp_path: Path) -> None:
    path = tmp_path / "decode.probe.trace"
    failed = _trace_line(T0, outcome="lease_expired", request_id=f"cmpl-{request_id(8)}-0-x")
    path.write_text(_trace_line(T0 + 0.130) + "\n" + failed + "\n")
    stamps = read_traces(path)
    assert list(stamps) == [7]  # a failed load has no timeline to tabulate
    assert stamps[7]["rank_scheduled"] == pytest.approx(T0 + 0.100)
    assert stamps[7]["rank_planned"] == pytest.approx(T0 + 0.120)
    assert stamps[7]["rank_ended"] == pytest.approx(T0 + 0.130)


def test_probe_keeps_each_events_first_time_per_router_request(tmp_path: Path) -> None:
    path = tmp_path / "decode.probe"
    lines = [{"t": T0 + 0.06, "event": "claimed", "rid": ENGINE_RID},
             {"t": T0 + 0.09, "event": "claimed", "rid": ENGINE_RID},
             {"t": T0 + 0.07, "event": "claimed", "rid": "cmpl-not-ours-0-x"}]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert read_probe(path) == {7: {"claimed": T0 + 0.06}}


def test_decode_share_is_receipt_to_first_token_minus_one_step() -> None:
    decode = {"claimed": T0 + 0.061, "load_started": T0 + 0.095, "load_reported": T0 + 0.140}
    traces = {"rank_scheduled": T0 + 0.100, "rank_planned": T0 + 0.120, "rank_done": T0 + 0.125}
    row = timeline(ROUTER, {}, decode, traces)
    step_ms = 10.0  # 30 ms over the 3 gaps between 4 tokens
    share_ms = 149.0 - step_ms
    assert row["one decode step (inter-token)"] == pytest.approx(step_ms)
    assert row["DECODE SHARE: decode receives -> first token, minus one step"] == pytest.approx(
        share_ms
    )
    assert row[READ_STAGE] == pytest.approx(5.0)
    assert row["decode share / READ time"] == pytest.approx(share_ms / 5.0)
    assert row["CONNECTOR'S PART: decode claims -> load reported to vLLM"] == pytest.approx(79.0)
    assert "router sends -> prefill claims" not in row  # no prefill stamps: stage left out


def test_table_gives_median_and_p90_per_size_and_connector() -> None:
    rows = [("ours", 128, {READ_STAGE: float(ms)}) for ms in range(1, 11)]
    rows.append(("vLLM", 128, {"one decode step (inter-token)": 3.0}))
    lines = table(rows)
    assert lines[0] == "| stage | 128 tok, ours (n=10) | 128 tok, vLLM (n=1) |"
    assert f"| {READ_STAGE} | 5.5 [9.0] | - |" in lines
