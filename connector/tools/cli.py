"""The `nixl-pd` command: argument parsing only; the work lives in examples.demo/serve/route.

The CLI sits on top of the import layers (docs/architecture.md): it wires the example engine
and the doctor together, importing each inside the command that runs it. The example engine
ships with the source tree, not the wheel (connector/tools/source_tree.py finds it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import NoReturn, TypeVar

import msgspec

from connector.errors import ConnectorError
from connector.tools import source_tree

_Options = TypeVar("_Options", bound=msgspec.Struct)

MODELS = ("dense", "mla", "hybrid-swa", "hybrid-ssm")


class _OneLineParser(argparse.ArgumentParser):
    """Bad flags print one clear line (and exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(
    parser: argparse.ArgumentParser, flag: str, default: float, metavar: str, text: str
) -> None:
    """A numeric flag typed by its default (int or float)."""
    parser.add_argument(flag, type=type(default), default=default, metavar=metavar, help=text)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="nixl-pd", description="NIXL prefill/decode KV connector tools")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    demo = commands.add_parser(
        "demo",
        help="run prefill and decode engines end to end and check the result",
        description="Start a prefill and a decode engine (separate processes, real NIXL over "
        "UCX on loopback), send a batch through a toy router, and check tokens, KV bytes and "
        "block leaks against a single-engine run. Exits non-zero on any mismatch or leak.",
    )
    for side in ("prefill", "decode"):
        _number(demo, f"--{side}-tp", 1, "N", f"{side} TP size (1)")
        _number(demo, f"--{side}-block-size", 16, "TOKENS",
            f"{side} logical block size in tokens (16)")  # fmt: skip
        demo.add_argument(
            f"--{side}-kernel-block-size", type=int, default=None, metavar="TOKENS",
            help=f"{side} kernel block size (default: the block size)",
        )  # fmt: skip
    demo.add_argument(
        "--layout", choices=("nhd", "hnd"), default="nhd", help="KV memory layout (nhd)"
    )
    demo.add_argument(
        "--model", choices=MODELS, default="dense", help="model both engines serve (dense)"
    )
    demo.add_argument(
        "--decode-model", choices=MODELS, default=None,
        help="serve another model on decode, to see the handshake refuse the pairing",
    )  # fmt: skip
    _number(demo, "--decode-prefix-hit", 0.0, "FRACTION",
        "fraction of each prompt already in decode's prefix cache (0)")  # fmt: skip
    _number(demo, "--requests", 8, "N", "batch size (8)")
    _number(demo, "--prompt-len", 64, "L", "prompt tokens per request (64)")
    _number(demo, "--max-tokens", 8, "N", "tokens decode generates after prefill's first token (8)")
    demo.add_argument(
        "--fake-nixl",
        action="store_true",
        help="both engines in this process over FakeNixl (no UCX)",
    )
    demo.add_argument(
        "--verify-kv", action="store_true",
        help="verify_kv on both engines: prefill digests each leased block, decode checks "
        "every load against those digests before it reports it",
    )  # fmt: skip
    demo.add_argument(
        "--staged", action="store_true",
        help="host staging: NIXL reads host mirrors of the KV, copied each step (as for a "
        "device NIXL cannot reach)",
    )  # fmt: skip
    _number(demo, "--timeout", 120.0, "SECONDS", "for the batch (120)")
    _number(demo, "--turns", 1, "N",
        "turns per conversation (1); above 1 both engines run in multi-turn mode and "
        "each later turn's prefill pulls the history from decode",
    )  # fmt: skip
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    _add_serve_parser(commands)
    _add_route_parser(commands)
    _add_doctor_parser(commands)
    return parser


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="run one prefill or decode engine until Ctrl-C or SIGTERM",
        description="Run one example engine (real NIXL; UCX_NET_DEVICES=lo unless set) serving "
        "JSON requests on a loopback ZMQ socket; `nixl-pd route` sends it work. Prints one "
        "line when ready. Both engines of a pair must serve the same --model and --seed.",
    )
    serve.add_argument("--role", choices=("prefill", "decode"), required=True)
    serve.add_argument(
        "--port", type=int, default=None,
        help="request socket port (prefill 8100, decode 8200; 0 picks a free one)",
    )  # fmt: skip
    serve.add_argument(
        "--host", default="127.0.0.1", help="address for the request socket and side channel"
    )
    _number(serve, "--side-channel-port", 0, "P", "(0: a free port)")
    serve.add_argument(
        "--metrics-port", type=int, default=None, metavar="P",
        help="serve Prometheus metrics on http://HOST:P/metrics (0 picks a free port; "
        "default: no metrics endpoint)",
    )  # fmt: skip
    serve.add_argument(
        "--trace", action="store_true",
        help="log one JSON line per request per rank to stderr (logger nixl_pd.trace)",
    )  # fmt: skip
    serve.add_argument("--engine-id", default=None, help="(default: <role>-<random hex>)")
    serve.add_argument("--model", choices=MODELS, default="dense", help="(dense)")
    _number(serve, "--tp", 1, "N", "TP size (1)")
    _number(serve, "--block-size", 16, "TOKENS", "(16)")
    serve.add_argument(
        "--kernel-block-size", type=int, default=None, metavar="TOKENS", help="(the block size)"
    )
    serve.add_argument("--layout", choices=("nhd", "hnd"), default="nhd", help="(nhd)")
    _number(serve, "--num-blocks", 256, "N", "KV blocks per group (256)")
    serve.add_argument("--seed", type=int, default=0, help="model weights' seed (0)")
    serve.add_argument(
        "--staged", action="store_true",
        help="host staging: NIXL reads a host mirror of the KV; give both engines the flag",
    )  # fmt: skip
    _number(serve, "--lease", 30.0, "SECONDS",
        "prefill: how long finished KV waits for decode to read it (30)")  # fmt: skip
    _number(serve, "--heartbeat", 5.0, "SECONDS",
        "decode: how often it extends the leases it waits on; below --lease (5)")  # fmt: skip
    _number(serve, "--handshake-timeout", 5.0, "SECONDS",
        "decode: per side-channel handshake attempt (5)")  # fmt: skip
    _number(serve, "--handshake-retries", 2, "N",
        "decode: attempts after the first, with backoff (2)")  # fmt: skip
    serve.add_argument(
        "--bidirectional", action="store_true",
        help="multi-turn (bidirectional_kv_xfer): decode holds a finished request's KV for the "
        "next turn, whose prefill pulls it; give both engines the flag",
    )  # fmt: skip
    _number(serve, "--decoder-kv-ttl", 480.0, "SECONDS",
        "decode, --bidirectional: how long it holds a finished request's KV (480)")  # fmt: skip
    _number(serve, "--recompute-threshold", 64, "TOKENS",
        "prefill, --bidirectional: pull from decode only this many tokens or more (64)",
    )  # fmt: skip


def _add_route_parser(commands: argparse._SubParsersAction) -> None:
    route = commands.add_parser(
        "route",
        help="send a batch through a prefill and a decode `nixl-pd serve`",
        description="The toy router as a client: each prompt to prefill with "
        '{"do_remote_decode": true} and max_tokens=1, then prompt + first token + the returned '
        "kv_transfer_params to decode. Prints each request's tokens and a summary; exits 1 if "
        "any request fails, the prompt KV differs, or (--check) tokens differ from one engine.",
    )
    route.add_argument("--prefill", required=True, metavar="HOST:PORT")
    route.add_argument("--decode", required=True, metavar="HOST:PORT")
    _number(route, "--prompt-len", 64, "L", "(64)")
    _number(route, "--requests", 8, "N", "(8)")
    _number(route, "--max-tokens", 8, "N", "decode's tokens after the first (8)")
    route.add_argument("--seed", type=int, default=0, help="prompts' seed (0)")
    _number(route, "--turns", 1, "N",
        "turns per conversation (1): each next prompt is the last one, its answer and "
        "--prompt-len new tokens, sent to prefill with decode's returned kv_transfer_params "
        "(engines served with --bidirectional pull the history from decode)",
    )  # fmt: skip
    _number(route, "--timeout", 60.0, "SECONDS", "for the batch (60)")
    route.add_argument(
        "--check", action="store_true",
        help="also run the prompts on a local engine (the servers' model and seed); compare",
    )  # fmt: skip
    route.add_argument("--json", action="store_true", help="print one JSON object")


def _add_doctor_parser(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check NIXL, the UCX transport, side channels and the environment",
        description="Check that NIXL loads with a UCX backend, run a short real READ between "
        "two processes and name the UCX transport that moved the bytes (TCP is the slow "
        "path), handshake with the given side channels and compare their engines, and "
        "point out environment mistakes, each with its fix. Exits 1 when something a "
        "deployment needs is missing or incompatible.",
    )
    doctor.add_argument(
        "--side-channel", action="append", default=[], dest="side_channels", metavar="HOST:PORT",
        help="an engine's side channel to handshake with (repeat; two or more are compared)",
    )  # fmt: skip
    _number(doctor, "--timeout", 3.0, "SECONDS", "per side-channel exchange (3)")
    doctor.add_argument(
        "--no-transfer", action="store_false", dest="transfer",
        help="skip the loopback READ (faster)",
    )  # fmt: skip
    doctor.add_argument(
        "--listen", default=None, metavar="HOST:PORT",
        help="two-host mode, first side: serve a READ target here (HOST: this host's address "
        "on the link to the other) and wait up to 120 s for one --peer",
    )  # fmt: skip
    doctor.add_argument(
        "--peer", default=None, metavar="HOST:PORT",
        help="two-host mode, second side: READ the target of the --listen at HOST:PORT and "
        "name the transport (CMA/shared memory cannot cross hosts)",
    )  # fmt: skip
    doctor.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")


def _doctor(args: argparse.Namespace) -> int:
    from connector.tools import doctor

    options = _options(doctor.DoctorOptions, args, timeout_s="timeout")
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops the children like Ctrl-C
    return doctor.main(options, as_json=args.json)


def _raise_interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run `nixl-pd`; returns the exit code (2: bad flags, 1: a failure, 130: interrupted)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_request:  # --help, or a bad flag already explained on stderr
        return int(exit_request.code or 0)
    commands = {"demo": _demo, "serve": _serve, "route": _route, "doctor": _doctor}
    try:
        return commands[args.command](args)
    except ConnectorError as exc:  # a bad flag's value, or no example engine (source_tree)
        print(f"nixl-pd {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _options(options_type: type[_Options], args: argparse.Namespace, **flag_of: str) -> _Options:
    """``options_type`` from the parsed flags: each field from the flag of its name, or of the
    name ``flag_of`` gives it; a field no flag sets keeps its default."""
    fields = options_type.__struct_fields__
    names = {field: flag_of.get(field, field) for field in fields}
    return options_type(**{f: getattr(args, n) for f, n in names.items() if hasattr(args, n)})


def _demo(args: argparse.Namespace) -> int:
    demo = source_tree.import_example("demo")

    options = _options(demo.DemoOptions, args, timeout_s="timeout")
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM cleans up like Ctrl-C
    try:
        result = demo.run_demo(options, progress=None if args.json else demo.print_progress)
    except (TimeoutError, ConnectionError, OSError) as exc:
        print(f"nixl-pd demo: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nixl-pd demo: interrupted; engines stopped", file=sys.stderr)
        return 130
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        print(demo.summary(result))
    return 0 if result.ok else 1


def _serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before NIXL starts: UCX reads it once
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.trace:
        logging.getLogger("nixl_pd.trace").setLevel(logging.DEBUG)
    serve = source_tree.import_example("serve")

    options = _options(
        serve.ServeOptions,
        args,
        tp_size="tp",
        kv_lease_duration_s="lease",
        heartbeat_interval_s="heartbeat",
        handshake_timeout_s="handshake_timeout",
        bidirectional_kv_xfer="bidirectional",
        decoder_kv_blocks_ttl_s="decoder_kv_ttl",
        kv_recompute_threshold="recompute_threshold",
    )
    serve.validate_options(options)  # before the signal handlers: a bad flag changes nothing
    stop = threading.Event()
    serve.stop_on_signals(stop)
    try:
        serve.run_server(
            options,
            stop,
            env=dict(os.environ),
            on_ready=lambda started: print(serve.ready_line(options, started), flush=True),
        )
    except KeyboardInterrupt:  # a second Ctrl-C while stopping
        return 130
    print(f"nixl-pd serve: {args.role} engine stopped", flush=True)
    return 0


def _route(args: argparse.Namespace) -> int:
    route = source_tree.import_example("route")

    options = _options(route.RouteOptions, args, timeout_s="timeout")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        result = route.run_route(options)
    except (TimeoutError, ConnectionError) as exc:
        print(f"nixl-pd route: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nixl-pd route: interrupted", file=sys.stderr)
        return 130
    print(msgspec.json.encode(result).decode() if args.json else route.report(result, options))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
