"""An FP8 KV cache on real engines: P->D with `--kv-cache-dtype fp8` must equal a single engine.

vLLM's CPU platform stores an fp8 cache as one byte per element (uint8, e4m3) with one K and one
V scale per layer (1.0 for this checkpoint-less model). Three engines start at once, all with
`--kv-cache-dtype fp8`: a P/D pair with our connector (verify_kv on, so every load is also a
byte-for-byte check of the FP8 pages), vLLM's NixlConnector pair (its outcome is recorded for
the configuration table, not asserted) and one single engine, the reference. The prompts are the
tier's (tests/test_real_vllm.py): its length cases, 16 prompts 8 in flight, then the same
prompts again from decode's prefix cache. Greedy tokens must be equal and logprobs within the
tier's LOGPROB_TOL: both paths attend over the same FP8 bytes (measured: equal to the bit).

    .venv/bin/python -m pytest tests/test_real_vllm_fp8.py -m real_vllm
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.real_vllm_harness import (
    Completion,
    Deployment,
    RequestFailed,
    complete,
    missing_vllm_venv,
)
from tests.real_vllm_workspace import Workspace

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

if (missing := missing_vllm_venv()) is not None:
    pytest.skip(missing, allow_module_level=True)

from tests.test_real_vllm import (  # noqa: E402  (after the skip: it needs .venv-vllm too)
    LENGTH_CASES,
    LOGPROB_TOL,
    MAX_TOKENS,
    concurrent_prompts,
    prompt,
)

ENGINE_ARGS = ("--kv-cache-dtype", "fp8")


@dataclass
class Fp8:
    """Our FP8 pair with its reference, vLLM's pair, and the worst logprob difference seen."""

    deployment: Deployment
    vllms: Deployment  # vLLM's NixlConnector pair on the same engine flags
    block_size: int
    vllm_compared: int = 0
    vllm_differed: int = 0  # vLLM's pair: requests not token-identical to the single engine
    worst_logprob_diff: float = 0.0
    compared: int = 0
    differed: int = 0  # requests whose tokens or logprobs were not the single engine's
    notes: dict[str, object] = field(default_factory=dict)


@pytest.fixture(scope="module")
def fp8(real_vllm: Workspace, request: pytest.FixtureRequest) -> Iterator[Fp8]:
    # Its own single engine: the reference runs with the FP8 cache too (ENGINE_ARGS).
    with (
        real_vllm.module_logs(request, "real-vLLM FP8 engine") as logs,
        Deployment.running_together(
            real_vllm.model(), ("nixlpd", "vllm"), logs, extra_args=ENGINE_ARGS
        ) as (deployment, vllms),
    ):
        sizes = {engine.block_size() for engine in deployment.engines()}
        assert len(sizes) == 1, f"engines disagree on block size: {sizes}"
        for engine in deployment.engines():  # vLLM's cache_config_info says what it runs
            assert 'cache_dtype="fp8"' in engine.metrics(), engine.spec.name
        warm(deployment, prompt(seed=0, num_tokens=200))
        warm_pair(vllms, prompt(seed=0, num_tokens=200))
        state = Fp8(deployment, vllms, sizes.pop())
        yield state
        report(state)


def warm(deployment: Deployment, warm_up: list[int]) -> None:
    """The engines' first requests, asked once more if the P/D one failed: they pay the
    handshake and the engines' one-time costs (the first FP8 forward pass among them), which
    on a loaded CI host ran past the lease check's 10 s timeout once (a right failure: the
    load was unproven, never wrong)."""
    complete(deployment.reference.url, warm_up, 2)
    for attempt in (1, 2):
        try:
            complete(deployment.proxy_url, warm_up, 2)
            return
        except RequestFailed as exc:
            if attempt == 2:
                raise
            warnings.warn(f"FP8 warm-up failed, asked again: {exc}", stacklevel=1)


def warm_pair(deployment: Deployment, warm_up: list[int]) -> None:
    """vLLM's pair's first request (its handshake); its failure is recorded, not raised."""
    try:
        complete(deployment.proxy_url, warm_up, 2)
    except RequestFailed as exc:
        warnings.warn(f"vLLM's FP8 pair failed its warm-up: {exc}", stacklevel=1)


def report(state: Fp8) -> None:
    """A warning, so that pytest's summary shows it; NIXL_PD_REAL_VLLM_REPORT=FILE keeps it."""
    summary = {
        "kv_cache_dtype": "fp8",
        "prompts": state.compared,
        "worst_logprob_diff": state.worst_logprob_diff,
        "block_size": state.block_size,
        **state.notes,
    }
    warnings.warn(f"real-vLLM FP8: {json.dumps(summary)}", stacklevel=1)
    if path := os.environ.get("NIXL_PD_REAL_VLLM_REPORT"):
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    if path := os.environ.get(OUTCOME_ENV):  # the configuration table's row (config_table.py)
        Path(path).write_text(json.dumps(outcome_record(state), indent=2) + "\n")


OUTCOME_ENV = "NIXL_PD_FP8_RESULTS"


def outcome_record(state: Fp8) -> dict[str, object]:
    """This test's outcome in the configuration tier's format (tests/test_real_vllm_configs.py),
    ours and vLLM's NixlConnector's."""
    counts = {
        "nixlpd": (state.compared, state.differed),
        "vllm": (state.vllm_compared, state.vllm_differed),
    }
    outcomes = [
        {
            "case": "tier prompts, 8 in flight, prefix-cache round",
            "configuration": "dense Llama, --kv-cache-dtype fp8",
            "connector": connector,
            "passed": compared - differed,
            "failed": differed,
            "failures": [],
            "refused": None,
        }
        for connector, (compared, differed) in counts.items()
    ]
    return {"tier": "tests/test_real_vllm_fp8.py", "outcomes": outcomes}


def through(url: str, prompts: Sequence[Sequence[int]]) -> list[Completion]:
    """Prompts to one URL, 8 in flight (decode's --max-num-seqs)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda p: complete(url, p, MAX_TOKENS), prompts))


def tokens_through(url: str, prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...] | None]:
    """Like ``through``, a failed request as None (vLLM's pair: recorded, not raised)."""

    def one(p: Sequence[int]) -> tuple[int, ...] | None:
        try:
            return tuple(complete(url, p, MAX_TOKENS).token_ids)
        except RequestFailed:
            return None

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, prompts))


def check_against_single_engine(state: Fp8, prompts: Sequence[Sequence[int]]) -> None:
    """P/D's greedy tokens equal the single engine's, logprobs within LOGPROB_TOL; both pairs
    and the reference run at once (vLLM's pair's tokens are counted for the table)."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        pd_f = pool.submit(through, state.deployment.proxy_url, prompts)
        vllm_f = pool.submit(tokens_through, state.vllms.proxy_url, prompts)
        single_f = pool.submit(through, state.deployment.reference.url, prompts)
        disaggregated, single, theirs = pd_f.result(), single_f.result(), vllm_f.result()
    state.vllm_compared += len(prompts)
    state.vllm_differed += sum(t != tuple(b.token_ids) for t, b in zip(theirs, single, strict=True))
    differ = []
    for p, a, b in zip(prompts, disaggregated, single, strict=True):
        state.compared += 1
        if a.token_ids != b.token_ids:
            differ.append(f"{len(p)} tokens: P/D {list(a.token_ids)}, single {list(b.token_ids)}")
            continue
        worst = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        state.worst_logprob_diff = max(state.worst_logprob_diff, worst)
        if worst > LOGPROB_TOL:
            differ.append(f"{len(p)} tokens: logprobs differ by up to {worst:.2e}")
    state.differed += len(differ)
    assert not differ, f"{len(differ)} of {len(prompts)} differ:\n" + "\n".join(differ)


def loaded_tokens(state: Fp8) -> float:
    return state.deployment.decode.prompt_tokens_by_source().get("external_kv_transfer", 0.0)


def cache_hit_tokens(state: Fp8) -> float:
    return state.deployment.decode.prompt_tokens_by_source().get("local_cache_hit", 0.0)


def test_fp8_prompt_lengths_match_single_engine(fp8: Fp8) -> None:
    """One token, a block minus one, one, plus one, three plus a partial: partial FP8 blocks."""
    prompts = [
        prompt(seed=n, num_tokens=n) for n in (of(fp8.block_size) for of in LENGTH_CASES.values())
    ]
    loaded_before = loaded_tokens(fp8)

    check_against_single_engine(fp8, prompts)

    # Decode computes at most each prompt's last token: the rest came over NIXL, verified.
    assert loaded_tokens(fp8) - loaded_before >= sum(len(p) - 1 for p in prompts)


def test_fp8_16_requests_8_in_flight_then_from_decode_prefix_cache(fp8: Fp8) -> None:
    prompts = concurrent_prompts(fp8.block_size)
    check_against_single_engine(fp8, prompts)
    hits_before = cache_hit_tokens(fp8)

    check_against_single_engine(fp8, prompts)  # the prefix-cache round

    hits = cache_hit_tokens(fp8) - hits_before
    fp8.notes["prefix_round_decode_cache_hit_tokens"] = hits
    assert hits >= sum((len(p) - 1) // fp8.block_size for p in prompts) * fp8.block_size
