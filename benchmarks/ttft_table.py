"""The TTFT benchmark's tables from its samples: medians per cell and the ratios issue 32 asks.

Pure: samples in, markdown lines out. Every P/D mode is compared with the single engine of its
own phase (the requests interleaved with its own), so load that drifts between phases does not
enter a ratio; ours against vLLM's compares those per-phase ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PD_MODES = ("ours", "ours-overlap", "vllm")
PHASE_OF_MODE = {"ours": "nixlpd", "ours-overlap": "nixlpd", "vllm": "vllm"}


@dataclass(frozen=True)
class Sample:
    """One request's outcome; times in ms from sending it, or the error that failed it."""

    phase: str  # whose pair was running: "nixlpd" (ours) or "vllm"
    mode: str
    prompt_tokens: int
    round_index: int
    first_ms: float | None
    second_ms: float | None
    load_1min: float
    error: str | None = None


def table(samples: Sequence[Sample]) -> list[str]:
    """The per-cell table, then the ratio table, then the load during the measured requests."""
    lengths = sorted({sample.prompt_tokens for sample in samples})
    lines = [
        "| prompt tokens | served by | TTFT ms | 2nd token ms | TTFT / single | "
        "2nd token / single | failed |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for num_tokens in lengths:
        lines += [_cell_row(samples, num_tokens, phase, mode) for phase, mode in _rows(samples)]
    lines += ["", *_ratio_rows(samples, lengths), "", _load_line(samples)]
    return lines


def _rows(samples: Sequence[Sample]) -> list[tuple[str, str]]:
    """(phase, mode) pairs in run order, each phase's single engine first."""
    seen: dict[tuple[str, str], None] = {}
    for sample in samples:
        seen.setdefault((sample.phase, sample.mode), None)
    return sorted(seen, key=lambda key: (key[0] != "nixlpd", key[1] != "single", key[1]))


def _cell_row(samples: Sequence[Sample], num_tokens: int, phase: str, mode: str) -> str:
    cell = _select(samples, num_tokens, phase, mode)
    ok = [sample for sample in cell if sample.error is None]
    label = f"single engine ({'our' if phase == 'nixlpd' else 'vLLM'} pair's phase)"
    label = label if mode == "single" else _mode_label(mode)
    if not ok:
        return f"| {num_tokens} | {label} | - | - | - | - | {len(cell)} |"
    first, second = _medians(ok)
    single_first, single_second = _medians(_select(samples, num_tokens, phase, "single"))
    ratios = f"{_ratio(first, single_first)} | {_ratio(second, single_second)}"
    return (
        f"| {num_tokens} | {label} | {_spread(ok, 'first_ms')} | {_spread(ok, 'second_ms')} | "
        f"{ratios} | {len(cell) - len(ok)} |"
    )


def _ratio_rows(samples: Sequence[Sample], lengths: Iterable[int]) -> list[str]:
    lines = [
        "| prompt tokens | 2nd token: sequential / overlapped | TTFT: sequential / overlapped "
        "| TTFT vs single: ours / vLLM's | 2nd token vs single: ours / vLLM's |",
        "|---:|---:|---:|---:|---:|",
    ]
    for num_tokens in lengths:
        seq = _medians(_select(samples, num_tokens, "nixlpd", "ours"))
        overlap = _medians(_select(samples, num_tokens, "nixlpd", "ours-overlap"))
        ours = _versus_single(samples, num_tokens, "ours")
        theirs = _versus_single(samples, num_tokens, "vllm")
        lines.append(
            f"| {num_tokens} | {_ratio(seq[1], overlap[1])} | {_ratio(seq[0], overlap[0])} | "
            f"{_ratio(ours[0], theirs[0])} | {_ratio(ours[1], theirs[1])} |"
        )
    return lines


def _versus_single(
    samples: Sequence[Sample], num_tokens: int, mode: str
) -> tuple[float | None, float | None]:
    """(TTFT, 2nd token) of ``mode`` over its phase's single engine, medians of each."""
    phase = PHASE_OF_MODE[mode]
    pd = _medians(_select(samples, num_tokens, phase, mode))
    single = _medians(_select(samples, num_tokens, phase, "single"))
    return (
        None if pd[0] is None or not single[0] else pd[0] / single[0],
        None if pd[1] is None or not single[1] else pd[1] / single[1],
    )


def _load_line(samples: Sequence[Sample]) -> str:
    loads = sorted(sample.load_1min for sample in samples)
    if not loads:
        return "no requests"
    return (
        f"1-minute load average when each request was sent: median {statistics.median(loads):.1f}"
        f", min {loads[0]:.1f}, max {loads[-1]:.1f} ({len(loads)} requests, 2 cores)"
    )


def _select(samples: Sequence[Sample], num_tokens: int, phase: str, mode: str) -> list[Sample]:
    return [
        sample
        for sample in samples
        if (sample.prompt_tokens, sample.phase, sample.mode) == (num_tokens, phase, mode)
    ]


def _medians(cell: Sequence[Sample]) -> tuple[float | None, float | None]:
    ok = [sample for sample in cell if sample.first_ms is not None]
    if not ok:
        return None, None
    return (
        statistics.median(sample.first_ms for sample in ok if sample.first_ms is not None),
        statistics.median(sample.second_ms for sample in ok if sample.second_ms is not None),
    )


def _spread(cell: Sequence[Sample], field: str) -> str:
    values = [getattr(sample, field) for sample in cell]
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


def _mode_label(mode: str) -> str:
    return {
        "ours": "P/D, ours, sequential",
        "ours-overlap": "P/D, ours, overlapped",
        "vllm": "P/D, vLLM's NixlConnector, sequential",
    }[mode]
