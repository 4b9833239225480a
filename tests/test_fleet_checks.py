"""The router tier's verdict (tests/real_vllm_fleet.py ``fleet_problems``) on made-up counters.

tests/test_real_vllm_router.py judges a real run with this function; here each broken promise
is planted in an otherwise healthy run of 24 requests over 2 prefill and 2 decode engines, and
the verdict must name it, so the real-engine case cannot pass on a check that never fires.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from tests.real_vllm_fleet import EngineCounters, fleet_problems

Run = tuple[dict[str, EngineCounters], dict[str, EngineCounters]]  # after-counters: P, D

START = EngineCounters()  # every engine fresh: handshakes count since an engine started


def healthy_run() -> Run:
    """12 requests per engine; every lease completed by its reader; both decodes read both."""
    prefill = EngineCounters(served=12.0, leases_completed=12.0)
    decode = EngineCounters(served=12.0, external_tokens=900.0, loads_finished=12.0, handshakes=2)
    return {"prefill0": prefill, "prefill1": prefill}, {"decode0": decode, "decode1": decode}


def judge(run: Run, *, connector_metrics: bool = True) -> list[str]:
    prefills, decodes = run
    return fleet_problems(
        {name: (START, after) for name, after in prefills.items()},
        {name: (START, after) for name, after in decodes.items()},
        24,
        connector_metrics=connector_metrics,
    )


def change(run: Run, name: str, **values: float) -> Run:
    """``run`` with engine ``name``'s after-counters changed."""
    prefills, decodes = dict(run[0]), dict(run[1])
    side = prefills if name in prefills else decodes
    side[name] = dataclasses.replace(side[name], **values)
    return prefills, decodes


BROKEN: dict[str, tuple[Callable[[Run], Run], list[str]]] = {
    "a-prefill-served-nothing": (
        lambda run: change(
            change(run, "prefill0", served=24, leases_completed=24),
            "prefill1",
            served=0,
            leases_completed=0,
        ),
        ["prefill1 served no request"],
    ),
    "a-decode-served-nothing": (
        lambda run: change(
            change(run, "decode0", served=24, loads_finished=24),
            "decode1",
            served=0,
            external_tokens=0,
            loads_finished=0,
        ),
        ["decode1 served 0 requests with 0 prompt tokens loaded over the connector"],
    ),
    "a-decode-served-without-loading-kv": (
        lambda run: change(run, "decode0", external_tokens=0),
        ["decode0 served 12 requests with 0 prompt tokens loaded over the connector"],
    ),
    "a-lease-expired": (
        lambda run: change(run, "prefill1", leases_completed=11, leases_expired=1),
        [
            "prefill1 served 12 requests but 11 leases were ended by their readers' notifications",
            "prefill1: 1 leases expired instead of being read",
        ],
    ),
    "a-lease-released": (
        lambda run: change(run, "prefill0", leases_completed=11, leases_released=1),
        [
            "prefill0 served 12 requests but 11 leases were ended by their readers' notifications",
            "prefill0: 1 leases released instead of being read",
        ],
    ),
    "a-lease-not-ended-yet": (
        lambda run: change(run, "prefill0", leases_completed=10),
        ["prefill0 served 12 requests but 10 leases were ended by their readers' notifications"],
    ),
    "a-load-failed": (
        lambda run: change(run, "decode1", loads_failed=1, loads_finished=11),
        ["decode1: 1 loads failed", "decode engines loaded 23 requests, not 24"],
    ),
    "a-decode-read-from-one-prefill-only": (
        lambda run: change(run, "decode0", handshakes=1),
        ["decode0 has handshaked with 1 remote engines, not with each of the 2 prefill engines"],
    ),
    "a-request-prefilled-twice": (
        lambda run: change(run, "prefill0", served=13, leases_completed=13),
        ["prefill engines served 25 requests, not 24"],
    ),
}


def test_a_healthy_run_has_no_problems() -> None:
    assert judge(healthy_run()) == []


@pytest.mark.parametrize("breaks, expected", BROKEN.values(), ids=BROKEN.keys())
def test_each_broken_promise_is_named(breaks: Callable[[Run], Run], expected: list[str]) -> None:
    assert judge(breaks(healthy_run())) == expected


def test_vllm_connector_runs_are_judged_without_our_metrics() -> None:
    """vLLM's own NixlConnector has no nixl_pd_* counters: only vLLM's are judged."""
    run = change(healthy_run(), "prefill0", leases_completed=0, leases_expired=3)
    run = change(run, "decode0", handshakes=0, loads_finished=0)

    assert judge(run, connector_metrics=False) == []
    assert judge(change(run, "prefill1", served=0), connector_metrics=False) == [
        "prefill1 served no request",
        "prefill engines served 12 requests, not 24",
    ]


def test_counters_subtract_field_by_field() -> None:
    earlier = EngineCounters(served=3, leases_completed=2, handshakes=1)
    later = EngineCounters(served=10, leases_completed=9, leases_expired=1, handshakes=2)

    assert later.minus(earlier) == EngineCounters(
        served=7, leases_completed=7, leases_expired=1, handshakes=1
    )
