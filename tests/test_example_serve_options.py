"""`nixl-pd serve` exposes the connector's timeouts as flags (issue 11, finding 6)."""

from __future__ import annotations

import pytest

from connector.tools.cli import main
from examples.serve import ServeOptions, serve_connector_config


def test_timeout_options_reach_the_connector_config() -> None:
    options = ServeOptions(
        role="decode",
        kv_lease_duration_s=12.0,
        heartbeat_interval_s=2.0,
        handshake_timeout_s=0.5,
        handshake_retries=0,
    )
    config = serve_connector_config(options, env={})
    assert (
        config.kv_lease_duration_s,
        config.heartbeat_interval_s,
        config.handshake_timeout_s,
        config.handshake_retries,
    ) == (12.0, 2.0, 0.5, 0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--lease", "0"], "--lease 0.0: use seconds in (0, 3600]", id="lease-zero"),
        pytest.param(["--heartbeat", "40"], "--heartbeat 40.0 must be below --lease 30.0", id="heartbeat-above-lease"),
        pytest.param(["--handshake-timeout", "-1"], "--handshake-timeout -1.0: use seconds", id="negative-timeout"),
        pytest.param(["--handshake-retries", "101"], "--handshake-retries 101: use 0..100", id="too-many-retries"),
    ],
)  # fmt: skip
def test_bad_timeout_flags_exit_2_with_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--role", "decode", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nixl-pd serve: error: ") and message in err, err
