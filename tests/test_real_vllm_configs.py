"""The configuration tier: configurations fleets run, ours and vLLM's NixlConnector side by side.

Each configuration gets one engine set, its new engines started at once: our P/D pair, vLLM's
NixlConnector pair on the same kind of engines, and (where the configuration needs its own) one
single engine, the oracle; a set reuses engines another set or the session runs with the same
flags (see the fixtures). Each case sends a few prompts through both pairs and the single engine; ours must be
token-identical to the single engine (verify_kv on, so every load is also a byte check); vLLM's
outcome is recorded beside ours, not asserted (it is the reference for what a user loses by
switching, not the code under test).

Configurations:
- ``sliding-tp1``: the sliding-window hybrid (tests/real_vllm_model.py ``gemma3``: 5 layers
  attending over the last 64 tokens, 1 full layer), prefill TP 1 -> decode TP 1; its engine
  set also serves the ``prompt_logprobs`` and ``n > 1`` cases (``n`` = 2 with seeded
  sampling: vLLM refuses ``n`` > 1 with greedy sampling);
- ``sliding-tp2-tp1``: the same model, prefill TP 2 -> decode TP 1 (its decodes and single
  engine are the first set's, its prompts others, so that decode loads them);
- ``ngram-spec-decode``: the tiny Llama with n-gram speculative decoding on the decode engine
  (ours behind the session's shared tiny-Llama prefill and single engine).

MLA (a DeepSeek-V2-style model, whose oracle is vLLM's connector plus verify_kv, not the single
engine) is tests/test_real_vllm_mla.py's (its record: NIXL_PD_MLA_RESULTS); FP8 is
tests/test_real_vllm_fp8.py's (NIXL_PD_FP8_RESULTS).

Every case's outcome (configuration, connector, prompts passed and failed, or the refusal) is
written as JSON to ``NIXL_PD_CONFIG_RESULTS`` (default: a file in the system's temp directory)
when the module ends; scripts/config_table.py turns it into docs/vllm.md's table.

    .venv/bin/python -m pytest tests/test_real_vllm_configs.py -m real_vllm
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm_harness import (
    REQUEST_TIMEOUT_S,
    Deployment,
    Engine,
    EngineError,
    RequestFailed,
    completion_body,
    missing_vllm_venv,
    pd_engine,
)
from tests.real_vllm_workspace import Workspace

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(1500)]

if (missing := missing_vllm_venv()) is not None:
    pytest.skip(missing, allow_module_level=True)

RESULTS_ENV = "NIXL_PD_CONFIG_RESULTS"
MAX_TOKENS = 8
VOCAB_IDS = range(4, 512)
CONNECTORS = ("nixlpd", "vllm")
# A few prompts per case keep the tier's CI time small: lengths around the sliding window
# (64) and vLLM's CPU block (128), one token, and a long one. 191: the window of its last
# token, [127, 190], starts at the last token of a block that vLLM frees once 191 tokens are
# computed (the next token's window is [128, 191]): decode must load 190 and compute that
# token itself (the sliding-window back-off, docs/vllm.md), or it attends a freed block.
PROMPT_LENGTHS = (1, 63, 65, 129, 191, 300, 700)
TP2_PREFILL = ("--tensor-parallel-size", "2")
NGRAM = (
    "--speculative-config",
    json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
)


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB_IDS) for _ in range(num_tokens)]


PROMPTS = [prompt(seed=n, num_tokens=n) for n in PROMPT_LENGTHS]
# The TP 2 case's decodes are the TP 1 set's: other prompts, or they would hit its cache.
TP2_PROMPTS = [prompt(seed=5000 + n, num_tokens=n) for n in PROMPT_LENGTHS]


def results_path() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or Path(tempfile.gettempdir()) / "nixlpd-configs.json")


@dataclass
class Outcome:
    """One case with one connector: how many requests matched the oracle, or why none ran."""

    case: str
    configuration: str
    connector: str
    passed: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    refused: str | None = None  # the engine refused to start: its message

    def record(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "configuration": self.configuration,
            "connector": self.connector,
            "passed": self.passed,
            "failed": self.failed,
            "failures": self.failures[:5],
            "refused": self.refused,
        }


OUTCOMES: list[Outcome] = []


@pytest.fixture(scope="module", autouse=True)
def write_results() -> Iterator[None]:
    """Write every recorded outcome when the module ends, passed or not."""
    started = time.monotonic()
    yield
    path = results_path()
    payload = {
        "tier": "tests/test_real_vllm_configs.py",
        "wall_time_s": round(time.monotonic() - started, 1),
        "outcomes": [outcome.record() for outcome in OUTCOMES],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    warnings.warn(f"configuration tier results in {path}", stacklevel=1)


# ----------------------------------------------------------------------------- requests


def ask(url: str, prompt_ids: Sequence[int], **extra: Any) -> list[tuple[int, ...]]:
    """One completion (greedy unless ``extra`` says otherwise); every choice's token ids
    (``n`` > 1: several)."""
    body = completion_body(prompt_ids, MAX_TOKENS, **extra)
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise RequestFailed(exc.code, exc.read().decode(errors="replace")) from None
    choices = sorted(payload["choices"], key=lambda choice: choice["index"])
    for choice in choices:
        if choice.get("finish_reason") not in ("length", "stop"):
            raise RequestFailed(200, json.dumps(payload)[:500])
    return [tuple(choice["token_ids"]) for choice in choices]


Answer = list[tuple[int, ...]] | str  # the choices' tokens, or why the request failed


def answers(url: str, prompts: Sequence[Sequence[int]], **extra: Any) -> list[Answer]:
    """Every prompt to ``url``, all in flight at once; a failed request is its message."""

    def one(prompt_ids: Sequence[int]) -> Answer:
        try:
            return ask(url, prompt_ids, **extra)
        except (RequestFailed, OSError) as error:
            return str(error)[:300]

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, prompts))


@dataclass
class EngineSet:
    """One configuration's pairs (by connector) and the URL of its single engine."""

    configuration: str
    pairs: dict[str, Deployment]
    reference_url: str
    refused: dict[str, str] = field(default_factory=dict)  # connector -> why it did not start


def run_case(
    engines: EngineSet,
    case: str,
    prompts: Sequence[Sequence[int]],
    **extra: Any,
) -> dict[str, Outcome]:
    """Both pairs and the single engine at once; record and return each connector's outcome."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        pair_futures = {
            name: pool.submit(answers, pair.proxy_url, prompts, **extra)
            for name, pair in engines.pairs.items()
        }
        single = pool.submit(answers, engines.reference_url, prompts, **extra).result()
        got = {name: future.result() for name, future in pair_futures.items()}
    outcomes = {}
    for connector in CONNECTORS:
        outcome = Outcome(case, engines.configuration, connector)
        if connector in engines.refused:
            outcome.refused = engines.refused[connector]
        else:
            for p, mine, theirs in zip(prompts, got[connector], single, strict=True):
                if isinstance(theirs, str):
                    raise AssertionError(
                        f"the single engine failed a {len(p)}-token prompt: {theirs}"
                    )
                if mine == theirs:
                    outcome.passed += 1
                else:
                    outcome.failed += 1
                    outcome.failures.append(f"{len(p)} tokens: {mine!r} vs single {theirs!r}")
        OUTCOMES.append(outcome)
        outcomes[connector] = outcome
    return outcomes


def assert_ours_matched(outcomes: dict[str, Outcome]) -> None:
    ours = outcomes["nixlpd"]
    assert ours.refused is None, ours.refused
    assert ours.failed == 0, "\n".join(ours.failures)
    assert ours.passed > 0


# ----------------------------------------------------------------------------- engine sets


@pytest.fixture(scope="module")
def logs(real_vllm: Workspace, request: pytest.FixtureRequest) -> Iterator[Path]:
    """Every configuration's engine logs; they stay when a test failed."""
    with real_vllm.module_logs(request, "configuration tier engine") as path:
        yield path


@contextlib.contextmanager
def engine_set(
    configuration: str,
    model_dir: Path,
    logs: Path,
    *,
    prefill_args: tuple[str, ...] = (),
    decode_args: tuple[str, ...] = (),
    with_reference: bool = True,
    reference: Engine | None = None,
) -> Iterator[EngineSet]:
    """Our pair, vLLM's pair (and a single engine, or the shared ``reference``), started at
    once; an engine that does not start fails the configuration's cases with its log tail."""
    with (
        started(configuration),
        Deployment.running_together(
            model_dir,
            CONNECTORS,
            logs,
            prefill_args=prefill_args,
            decode_args=decode_args,
            with_reference=with_reference,
            reference=reference,
        ) as deployments,
    ):
        pairs = {d.connector: d for d in deployments}
        yield EngineSet(configuration, pairs, deployments[0].reference.url)


@contextlib.contextmanager
def assembled_set(
    configuration: str,
    model_dir: Path,
    halves: dict[str, tuple[Engine, Engine]],
    reference: Engine,
    borrowed: Sequence[Engine],
) -> Iterator[EngineSet]:
    """Pairs from (prefill, decode) ``halves`` by connector, the ``borrowed`` ones another
    set's (running, left running): the rest start at once here and stop when the set ends."""
    with (
        started(configuration),
        Deployment.assembled(model_dir, halves, reference, borrowed) as deployments,
    ):
        yield EngineSet(configuration, {d.connector: d for d in deployments}, reference.url)


@contextlib.contextmanager
def started(configuration: str) -> Iterator[None]:
    try:
        yield
    except EngineError as error:
        raise EngineError(f"{configuration}: the engine set did not start: {error}") from None


@pytest.fixture(scope="module")
def gemma3_model(real_vllm: Workspace) -> Path:
    return real_vllm.model("gemma3")


# Three engine sets, one after another, eleven engine starts in all (each is 30-150 s of the
# tier's time on two cores): the n-gram set borrows the session's shared tiny-Llama prefill
# (ours) and starts three; the TP 1 set starts five; the TP 2 set borrows the TP 1 set's
# decodes and single engine and starts the two TP 2 prefills (a decode serves loads from any
# prefill). The TP 1 set is module-scoped so that it lives through the TP 2 class; the
# n-gram class runs first, so its engines have stopped by then.
@pytest.fixture(scope="class")
def ngram_engines(real_vllm: Workspace, logs: Path) -> Iterator[EngineSet]:
    configuration = "dense Llama, n-gram speculative decoding on decode"
    model = real_vllm.model()
    shared = real_vllm.pair("nixlpd")  # its prefill is ours, plain: this case's prefill
    halves = {
        "nixlpd": (shared.prefill, pd_engine("nixlpd", "kv_consumer", model, logs, NGRAM)),
        "vllm": (
            pd_engine("vllm", "kv_producer", model, logs),
            pd_engine("vllm", "kv_consumer", model, logs, NGRAM),
        ),
    }
    with assembled_set(
        configuration, model, halves, shared.reference, (shared.prefill,)
    ) as engines:
        # n-gram's proposer is numba-compiled on decode's first speculative step: 10-40 s on
        # two busy cores, in which the engine thread runs no step, so the loads of the other
        # prompts in flight would wait that long, past prefill's 30 s lease (heartbeats pause
        # for an engine thread that runs no step: docs/integrity.md). One request first.
        for pair in engines.pairs.values():
            answers(pair.proxy_url, [prompt(seed=9000, num_tokens=20)])
        yield engines


@pytest.fixture(scope="module")
def sliding_tp1(gemma3_model: Path, logs: Path) -> Iterator[EngineSet]:
    configuration = "sliding-window hybrid, P TP1 -> D TP1"
    with engine_set(configuration, gemma3_model, logs) as engines:
        yield engines


@pytest.fixture(scope="class")
def sliding_tp2(sliding_tp1: EngineSet, gemma3_model: Path, logs: Path) -> Iterator[EngineSet]:
    configuration = "sliding-window hybrid, P TP2 -> D TP1"
    # The TP 1 prefills have served their cases: stopped now (about 2 GB each), they leave
    # room for the TP 2 prefills beside the rest of the set (the peak of the tier's memory).
    for pair in sliding_tp1.pairs.values():
        pair.prefill.stop()
    decodes = {name: pair.decode for name, pair in sliding_tp1.pairs.items()}
    halves = {
        name: (pd_engine(name, "kv_producer", gemma3_model, logs, TP2_PREFILL), decode)
        for name, decode in decodes.items()
    }
    reference = sliding_tp1.pairs["nixlpd"].reference
    with assembled_set(
        configuration, gemma3_model, halves, reference, tuple(decodes.values())
    ) as engines:
        yield engines


class TestNgramSpecDecode:
    def test_ngram_spec_decode_matches_single_engine(self, ngram_engines: EngineSet) -> None:
        assert_ours_matched(run_case(ngram_engines, "n-gram speculative decoding", PROMPTS))


class TestSlidingWindowTp1:
    def test_sliding_window_matches_single_engine(self, sliding_tp1: EngineSet) -> None:
        assert_ours_matched(run_case(sliding_tp1, "sliding-window hybrid", PROMPTS))

    def test_prompt_logprobs_request_matches_single_engine(self, sliding_tp1: EngineSet) -> None:
        outcomes = run_case(sliding_tp1, "prompt_logprobs request", PROMPTS[:3], prompt_logprobs=1)
        assert_ours_matched(outcomes)

    def test_n_2_request_matches_single_engine(self, sliding_tp1: EngineSet) -> None:
        """vLLM refuses n > 1 with greedy sampling: seeded sampling (each child's seed is
        derived from the request's) gives both choices reproducible tokens to compare."""
        outcomes = run_case(sliding_tp1, "n=2 request", PROMPTS[:3], n=2, temperature=1.0, seed=7)
        assert_ours_matched(outcomes)


class TestSlidingWindowPrefillTp2:
    def test_prefill_tp2_decode_tp1_matches_single_engine(self, sliding_tp2: EngineSet) -> None:
        """Prompts the TP 1 set's decodes have not cached: each load is the TP 2 prefill's."""
        assert_ours_matched(run_case(sliding_tp2, "sliding-window hybrid", TP2_PROMPTS))
