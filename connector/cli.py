"""The `nixl-pd` command: argument parsing only; the demo itself lives in examples.demo."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import NoReturn

import msgspec

MODELS = ("dense", "mla", "hybrid-swa", "hybrid-ssm")


class _OneLineParser(argparse.ArgumentParser):
    """Bad flags print one clear line (and exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
        demo.add_argument(
            f"--{side}-tp", type=int, default=1, metavar="N", help=f"{side} TP size (1)"
        )
        demo.add_argument(
            f"--{side}-block-size",
            type=int,
            default=16,
            metavar="TOKENS",
            help=f"{side} logical block size in tokens (16)",
        )
        demo.add_argument(
            f"--{side}-kernel-block-size",
            type=int,
            default=None,
            metavar="TOKENS",
            help=f"{side} kernel block size (default: the block size)",
        )
    demo.add_argument(
        "--layout", choices=("nhd", "hnd"), default="nhd", help="KV memory layout (nhd)"
    )
    demo.add_argument(
        "--model", choices=MODELS, default="dense", help="model both engines serve (dense)"
    )
    demo.add_argument(
        "--decode-model",
        choices=MODELS,
        default=None,
        help="serve another model on decode, to see the handshake refuse the pairing",
    )
    demo.add_argument(
        "--decode-prefix-hit",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="fraction of each prompt already in decode's prefix cache (0)",
    )
    demo.add_argument("--requests", type=int, default=8, metavar="N", help="batch size (8)")
    demo.add_argument(
        "--prompt-len", type=int, default=64, metavar="L", help="prompt tokens per request (64)"
    )
    demo.add_argument(
        "--max-tokens",
        type=int,
        default=8,
        metavar="N",
        help="tokens decode generates after prefill's first token (8)",
    )
    demo.add_argument(
        "--fake-nixl",
        action="store_true",
        help="both engines in this process over FakeNixl (no UCX)",
    )
    demo.add_argument(
        "--timeout", type=float, default=120.0, metavar="SECONDS", help="for the batch (120)"
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _raise_interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run `nixl-pd`; returns the exit code (2: bad flags, 1: the demo found a problem)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_request:  # --help, or a bad flag already explained on stderr
        return int(exit_request.code or 0)
    from connector.errors import ConnectorError
    from examples import demo

    options = demo.DemoOptions(
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_block_size=args.prefill_block_size,
        decode_block_size=args.decode_block_size,
        prefill_kernel_block_size=args.prefill_kernel_block_size,
        decode_kernel_block_size=args.decode_kernel_block_size,
        layout=args.layout,
        model=args.model,
        decode_model=args.decode_model,
        decode_prefix_hit=args.decode_prefix_hit,
        requests=args.requests,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        fake_nixl=args.fake_nixl,
        timeout_s=args.timeout,
    )
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM cleans up like Ctrl-C
    try:
        result = demo.run_demo(options, progress=None if args.json else demo.print_progress)
    except ConnectorError as exc:
        print(f"nixl-pd demo: error: {exc}", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    sys.exit(main())
