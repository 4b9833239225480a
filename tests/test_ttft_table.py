"""benchmarks/ttft_table.py: each P/D mode over its own phase's single engine, sequential over
overlapped, ours over vLLM's, failures counted and left out of the medians."""

from __future__ import annotations

import pytest

from benchmarks.ttft_stream import RequestFailed, _event_token_ids
from benchmarks.ttft_table import Sample, table


def _sample(phase: str, mode: str, first_ms: float | None, error: str | None = None) -> Sample:
    second_ms = None if first_ms is None else first_ms + 100.0
    return Sample(phase, mode, 1024, 0, first_ms, second_ms, 3.0, error)


SAMPLES = [
    _sample("nixlpd", "single", 1000.0),
    _sample("nixlpd", "ours", 2000.0),
    _sample("nixlpd", "ours-overlap", 1500.0),
    _sample("nixlpd", "ours-overlap", None, "HTTP 500"),  # counted, not in the medians
    _sample("vllm", "single", 4000.0),  # another phase's single engine: vLLM is divided by it
    _sample("vllm", "vllm", 12000.0),
]


def _row(lines: list[str], label: str) -> list[str]:
    (found,) = [line for line in lines if f"| {label} |" in line]
    return [cell.strip() for cell in found.strip("|").split("|")]


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        pytest.param("P/D, ours, sequential", ["2.00", "1.91", "0"], id="ours-over-its-single"),
        pytest.param("P/D, ours, overlapped", ["1.50", "1.45", "1"], id="overlap-failure-counted"),
        pytest.param(
            "P/D, vLLM's NixlConnector, sequential", ["3.00", "2.95", "0"], id="vllm-own-phase"
        ),
    ],
)
def test_each_pd_mode_is_divided_by_its_own_phases_single_engine(
    label: str, expected: list[str]
) -> None:
    assert _row(table(SAMPLES), label)[-3:] == expected


def test_ratio_row_compares_sequential_with_overlapped_and_ours_with_vllms() -> None:
    (ratios,) = [line for line in table(SAMPLES) if line.startswith("| 1024 | 1.")]
    # 2nd token 2100 / 1600; TTFT 2000 / 1500; ours 2.00 over vLLM's 3.00; 1.91 over 2.95.
    assert [cell.strip() for cell in ratios.strip("|").split("|")] == [
        "1024", "1.31", "1.33", "0.67", "0.65",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        pytest.param(b'data: {"choices": [{"token_ids": [7, 9]}]}\n', [7, 9], id="two-tokens"),
        pytest.param(b"data: [DONE]\n", [], id="done"),
        pytest.param(b"\n", [], id="blank"),
    ],
)
def test_event_token_ids(line: bytes, expected: list[int]) -> None:
    assert _event_token_ids(line) == expected


def test_an_error_event_fails_the_request() -> None:
    with pytest.raises(RequestFailed, match="EngineCore"):
        _event_token_ids(b'data: {"error": {"message": "EngineCore encountered an issue"}}\n')
