"""End to end on FakeNixl: prefill and decode engines in one process, checked against one engine.

The matrix (model kind x TP pair x block sizes x kernel split x layout x decode prefix hit)
is covered 3-wise: every combination of values of any three factors appears in some case
(e.g. every model with every TP pair and every prefix hit). Each case
runs the whole demo in-process and requires identical tokens, identical prompt KV on decode,
no failed request and no referenced block left on either engine.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pytest

from connector.config import ConnectorConfig
from connector.observability.metrics import LOADS_FINISHED, default_recorder
from connector.tools.cli import main
from examples.demo import DemoOptions, run_demo
from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from worker.fake import FakeFabric, FakeNixl

MODELS = ("dense", "mla", "hybrid-swa", "hybrid-ssm")
TP_PAIRS = ((1, 1), (1, 2), (2, 1), (2, 4))
BLOCKS = {"equal": (16, 16), "prefill-larger": (32, 8), "decode-larger": (8, 32)}
KERNELS = ("none", "prefill-split", "decode-split")  # split: kernel block = half the block
LAYOUTS = ("nhd", "hnd")
HITS = {"no-hit": 0.0, "partial-hit": 0.45, "full-hit": 1.0}
FACTORS: tuple[tuple[str, ...], ...] = (
    MODELS,
    tuple(f"tp{p}-{d}" for p, d in TP_PAIRS),
    tuple(BLOCKS),
    KERNELS,
    LAYOUTS,
    tuple(HITS),
)
PROMPT_LEN = 64  # a multiple of every block size: "full-hit" really hits every prompt token


def covering_cases(factors: tuple[tuple[str, ...], ...], strength: int) -> list[tuple[str, ...]]:
    """Rows covering every combination of values of any ``strength`` factors (greedy)."""
    groups = list(itertools.combinations(range(len(factors)), strength))

    def combos(row: tuple[str, ...]) -> set[tuple[tuple[int, str], ...]]:
        return {tuple((i, row[i]) for i in group) for group in groups}

    candidates = [(row, combos(row)) for row in itertools.product(*factors)]
    uncovered = set().union(*(covered for _, covered in candidates))
    rows: list[tuple[str, ...]] = []
    while uncovered:
        row, covered = max(candidates, key=lambda candidate: len(candidate[1] & uncovered))
        rows.append(row)
        uncovered -= covered
    return rows


def options_for(row: tuple[str, ...]) -> DemoOptions:
    model, tp, blocks, kernel, layout, hit = row
    prefill_tp, decode_tp = (int(x) for x in tp.removeprefix("tp").split("-"))
    prefill_block, decode_block = BLOCKS[blocks]
    return DemoOptions(
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        prefill_block_size=prefill_block,
        decode_block_size=decode_block,
        prefill_kernel_block_size=prefill_block // 2 if kernel == "prefill-split" else None,
        decode_kernel_block_size=decode_block // 2 if kernel == "decode-split" else None,
        layout=layout,
        model=model,
        decode_prefix_hit=HITS[hit],
        requests=2,
        prompt_len=PROMPT_LEN,
        max_tokens=3,
        fake_nixl=True,
        timeout_s=60.0,
    )


# Cases the seeds name, on top of the pairwise cover.
SEED_CASES = {
    "seed001-ssm-partial-hit-decode-blocks-smaller": (
        "hybrid-ssm",
        "tp1-2",
        "prefill-larger",
        "none",
        "nhd",
        "partial-hit",
    ),
    "seed002-mla-prefill-tp-larger": ("mla", "tp2-1", "equal", "none", "nhd", "no-hit"),
    "seed003-kernel-split-hetero-blocks": (
        "dense",
        "tp2-4",
        "decode-larger",
        "decode-split",
        "hnd",
        "partial-hit",
    ),
    "seed004-swa-page-sizes-full-hit": (
        "hybrid-swa",
        "tp2-1",
        "prefill-larger",
        "prefill-split",
        "hnd",
        "full-hit",
    ),
}
CASES = {"-".join(row): row for row in covering_cases(FACTORS, strength=3)} | SEED_CASES


@pytest.mark.parametrize("row", list(CASES.values()), ids=list(CASES))
def test_disaggregated_run_matches_single_engine(row: tuple[str, ...]) -> None:
    result = run_demo(options_for(row))

    assert result.errors == []
    assert result.failed_requests == 0
    assert result.tokens_match
    assert result.kv_match
    assert (result.leaked_blocks_prefill, result.leaked_blocks_decode) == (0, 0)
    if HITS[row[-1]] < 1.0:
        assert result.bytes_transferred > 0


def test_full_decode_hit_reads_nothing_and_frees_prefill() -> None:
    result = run_demo(options_for(("dense", "tp1-1", "equal", "none", "nhd", "full-hit")))

    assert result.ok
    assert result.decode_prefix_hit_tokens == 2 * PROMPT_LEN
    assert result.bytes_transferred == 0


@pytest.mark.parametrize(
    ("tp_pair", "blocks", "kernel", "layout"),
    [
        ("tp1-1", "equal", "none", "nhd"),
        ("tp1-2", "prefill-larger", "decode-split", "hnd"),
        ("tp2-1", "decode-larger", "prefill-split", "nhd"),
    ],
)
def test_demo_turns_pull_the_history_from_decode_and_leave_nothing_held(
    tp_pair: str, blocks: str, kernel: str, layout: str
) -> None:
    # Both directions of every difference: a pull reads decode's geometry into prefill's.
    base = options_for(("dense", tp_pair, blocks, kernel, layout, "no-hit"))
    result = run_demo(msgspec.structs.replace(base, turns=3))

    assert result.ok, result.errors
    assert result.requests == 3 * base.requests
    assert result.pulled_tokens > 0
    assert (result.leaked_blocks_prefill, result.leaked_blocks_decode) == (0, 0)


# ---- pairings the connector refuses ------------------------------------------------------


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _pair(prefill_model: str, decode_model: str, clock: ManualClock) -> tuple[Engine, Engine]:
    fabric = FakeFabric()
    config = ConnectorConfig(
        side_channel_port=0, kv_lease_duration_s=30.0, handshake_timeout_s=5.0, handshake_retries=1
    )
    engines = []
    for role, model in (("prefill", prefill_model), ("decode", decode_model)):
        engines.append(
            Engine(
                EngineConfig(role, role=role, model=model, num_blocks=32),
                connector_config=config,
                clock=clock,
                agent_factory=lambda name: FakeNixl(name, fabric),
            )
        )
    return engines[0], engines[1]


def _run(
    engines: list[Engine], request_ids: set[str], max_steps: int = 20_000
) -> dict[str, RequestOutput]:
    outputs: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        for engine in engines:
            outputs.update((o.request_id, o) for o in engine.step())
        if request_ids <= set(outputs):
            return outputs
    raise AssertionError(f"unfinished after {max_steps} steps: {request_ids - set(outputs)}")


def _prefill_then_decode(prefill: Engine, decode: Engine) -> RequestOutput:
    prompt = list(range(20))
    prefill.add_request(EngineRequest("p", prompt, 1, {"do_remote_decode": True}))
    first = _run([prefill], {"p"})["p"]
    assert first.kv_transfer_params is not None
    decode.add_request(EngineRequest("d", prompt + first.token_ids, 3, first.kv_transfer_params))
    return _run([prefill, decode], {"d"})["d"]


REJECTED = {
    "different-model-same-groups-refused-at-handshake": (
        "dense",
        "mla",
        "KV load failed: handshake with prefill engine prefill failed: prefill "
        "and decode engines are not compatible: group0.head_dim: local '16', remote '8'",
    ),
    "different-cache-groups-refused-with-the-params": (
        "dense",
        "hybrid-swa",
        "KV load failed: invalid kv_transfer_params: kv_transfer_params['remote_block_ids']: "
        "1 cache group(s) given, this engine has 2",
    ),
}


@pytest.mark.parametrize(
    "prefill_model, decode_model, message", list(REJECTED.values()), ids=list(REJECTED)
)
def test_incompatible_engines_fail_the_request_with_the_reason(
    prefill_model: str, decode_model: str, message: str
) -> None:
    clock = ManualClock()
    prefill, decode = _pair(prefill_model, decode_model, clock)
    try:
        output = _prefill_then_decode(prefill, decode)
        assert output.error is not None and output.error.startswith(message)
        assert decode.num_leaked_blocks == 0
        clock.now_s += 31.0  # the prefill lease expires: its blocks come back
        _drain([prefill, decode])
        assert prefill.num_leaked_blocks == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def _drain(engines: list[Engine], max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not any(engine.has_work() for engine in engines):
            return
        for engine in engines:
            engine.step()
    raise AssertionError("engines still hold requests")


def test_malformed_params_fail_one_request_and_the_engine_keeps_serving() -> None:
    clock = ManualClock()
    prefill, decode = _pair("dense", "dense", clock)
    try:
        bad: dict[str, Any] = {"do_remote_prefill": True, "remote_engine_id": "prefill"}
        decode.add_request(EngineRequest("bad", list(range(20)), 2, bad))
        failed = _run([decode], {"bad"})["bad"]
        assert failed.error is not None and "remote_block_ids" in failed.error
        good = _prefill_then_decode(prefill, decode)
        assert good.error is None and len(good.token_ids) == 3
        _drain([prefill, decode])
        assert (prefill.num_leaked_blocks, decode.num_leaked_blocks) == (0, 0)
    finally:
        prefill.shutdown()
        decode.shutdown()


# ---- the `nixl-pd demo` command --------------------------------------------------------

JSON_KEYS = {
    "tokens_match",
    "kv_match",
    "requests",
    "bytes_transferred",
    "transfer_gbps",
    "failed_requests",
    "leaked_blocks_prefill",
    "leaked_blocks_decode",
}


def test_cli_demo_json_prints_one_object_with_the_contract_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "demo",
        "--fake-nixl",
        "--json",
        "--requests",
        "2",
        "--prompt-len",
        "20",
        "--max-tokens",
        "2",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
    ]

    exit_code = main(argv)

    out = capsys.readouterr().out
    result = json.loads(out)
    assert exit_code == 0
    assert out.count("\n") == 1
    assert set(result) >= JSON_KEYS
    assert result["tokens_match"] and result["kv_match"] and result["requests"] == 2


def test_cli_demo_prints_a_human_summary(capsys: pytest.CaptureFixture[str]) -> None:
    exit_code = main(["demo", "--fake-nixl", "--requests", "1", "--prompt-len", "12"])

    captured = capsys.readouterr()
    assert exit_code == 0
    assert captured.out.startswith("nixl-pd demo: OK")
    assert "leaks         prefill 0 blocks, decode 0 blocks" in captured.out
    assert "[1/1] cmpl-0: 9 tokens" in captured.err


BAD_FLAGS = {
    "unknown-flag": (["--bogus"], "nixl-pd: error: unrecognized arguments: --bogus"),
    "not-a-number": (["--requests", "many"], "argument --requests: invalid int value: 'many'"),
    "unknown-model": (["--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
    "kernel-does-not-divide": (
        ["--decode-kernel-block-size", "5"],
        "nixl-pd demo: error: --decode-kernel-block-size 5 must divide --decode-block-size 16",
    ),
    "tp-the-model-cannot-split": (
        ["--prefill-tp", "3"],
        "nixl-pd demo: error: --prefill-tp 3: model dense cannot run with tensor-parallel size 3",
    ),
    "hit-not-a-fraction": (
        ["--decode-prefix-hit", "1.5"],
        "--decode-prefix-hit 1.5: give a fraction in [0, 1]",
    ),
    "batch-too-large": (["--requests", "1000", "--prompt-len", "1000"], "keep the batch within"),
}


@pytest.mark.parametrize("flags, message", list(BAD_FLAGS.values()), ids=list(BAD_FLAGS))
def test_cli_bad_flags_give_one_clear_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    exit_code = main(["demo", "--fake-nixl", *flags])

    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exit_code == 2
    assert len(lines) == 1 and message in lines[0]
    assert captured.out == ""


def _loads_finished() -> int:
    counters = default_recorder().snapshot().counters
    return sum(counters.get(LOADS_FINISHED.name, {}).values())


def test_two_requests_with_one_lease_both_answer_and_the_lease_is_read_once() -> None:
    # vLLM's n > 1 children, or resent params: the second waits for the first's load, then
    # computes what the example engine's prefix cache does not hold (scheduler/requests.py SiblingLoads).
    clock = ManualClock()
    prefill, decode = _pair("dense", "dense", clock)
    try:
        prompt = list(range(20))
        prefill.add_request(EngineRequest("p", prompt, 1, {"do_remote_decode": True}))
        first = _run([prefill], {"p"})["p"]
        params = first.kv_transfer_params
        assert params is not None
        loaded = _loads_finished()
        for request_id in ("0_d", "1_d"):
            decode.add_request(EngineRequest(request_id, prompt + first.token_ids, 3, params))
        outputs = _run([prefill, decode], {"0_d", "1_d"})
        assert [outputs[rid].error for rid in ("0_d", "1_d")] == [None, None]
        assert outputs["0_d"].token_ids == outputs["1_d"].token_ids
        assert _loads_finished() - loaded == 1
        _drain([prefill, decode])
        assert (prefill.num_leaked_blocks, decode.num_leaked_blocks) == (0, 0)
    finally:
        prefill.shutdown()
        decode.shutdown()
