"""`nixl-pd serve --metrics-port 0`: scrape /metrics of two real engines around a routed batch.

Real NIXL over loopback UCX, separate processes, as tests/test_serve_by_hand.py runs them. The
scrape is parsed with prometheus_client's own parser, so names, types and values are checked
as Prometheus reads them. Every process started here is stopped.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from connector.observability.metrics import COUNTER, METRICS
from tests.test_serve_by_hand import READY_TIMEOUT_S, STOP_TIMEOUT_S, run_cli

pytestmark = pytest.mark.real_nixl

READY = re.compile(
    r"engine \S+ ready: requests on (127\.0\.0\.1:\d+), side channel \S+, "
    r"metrics (http://127\.0\.0\.1:\d+/metrics) "
)
NUM_REQUESTS = 4


class MeteredServer:
    """One `nixl-pd serve --port 0 --metrics-port 0`; ``close()`` stops it (signal, then kill)."""

    def __init__(self, role: str, log_path: Path) -> None:
        self.role = role
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        argv = ["serve", "--role", role, "--port", "0", "--metrics-port", "0", "--trace"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "connector.tools.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=dict(os.environ, UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1"),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self) -> tuple[str, str]:
        """(request socket HOST:PORT, metrics URL) from the server's ready line."""
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline_s:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            match = READY.search(line)
            if match:
                return match.group(1), match.group(2)
        raise AssertionError(f"{self.role} not ready: {self.log_path.read_text()[-2000:]}")

    def close(self) -> int | None:
        """SIGTERM, then SIGKILL if it does not stop in time; the SIGTERM exit code."""
        code = self.process.poll()
        if code is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT_S)
        self._log.close()
        return code


def scrape(url: str) -> tuple[str, dict[str, Any]]:
    """The page's text and its families by name: (type, {(sample name, labels): value})."""
    with urllib.request.urlopen(url, timeout=10.0) as response:  # noqa: S310 - loopback URL
        assert response.status == 200
        text = response.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        families[family.name] = (family.type, samples)
    return text, families


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    family = family.removesuffix("_bucket")
    return float(families[family][1][(sample, tuple(sorted(labels.items())))])


def check_every_metric_is_exposed(families: dict[str, Any]) -> None:
    for spec in METRICS:
        family = spec.name.removesuffix("_total")
        assert family in families, spec.name
        assert families[family][0] == ("counter" if spec.kind == COUNTER else "histogram")


def test_metrics_of_a_real_routed_batch(tmp_path: Path) -> None:
    prefill = MeteredServer("prefill", tmp_path / "prefill.log")
    decode = MeteredServer("decode", tmp_path / "decode.log")
    try:
        (prefill_address, prefill_url), (decode_address, decode_url) = (
            prefill.wait_ready(),
            decode.wait_ready(),
        )
        _, idle = scrape(decode_url)
        routed = run_cli(
            *("route", "--prefill", prefill_address, "--decode", decode_address),
            *("--requests", str(NUM_REQUESTS), "--prompt-len", "40", "--max-tokens", "3"),
            *("--check", "--json"),
        )
        decode_text, decoded = scrape(decode_url)
        prefill_text, prefilled = scrape(prefill_url)
    finally:
        codes = (prefill.close(), decode.close())
    (tmp_path / "decode.metrics").write_text(decode_text)
    (tmp_path / "prefill.metrics").write_text(prefill_text)
    assert routed.returncode == 0, routed.stderr
    assert json.loads(routed.stdout)["completed_requests"] == NUM_REQUESTS
    assert codes == (0, 0)

    check_every_metric_is_exposed(idle)
    assert value(idle, "nixl_pd_loads_finished_total") == 0
    check_every_metric_is_exposed(decoded)
    check_every_metric_is_exposed(prefilled)

    # Decode (TP 1): one load per routed request, every byte READ, nothing failed.
    assert value(decoded, "nixl_pd_loads_finished_total") == NUM_REQUESTS
    for kind in ("aborted", "handshake", "transfer", "transfer_timeout", "other"):
        assert value(decoded, "nixl_pd_loads_failed_total", reason=kind) == 0
    for histogram in ("transfer_seconds", "transfer_bytes", "transfer_descriptors", "post_seconds"):
        assert value(decoded, f"nixl_pd_{histogram}_count") == NUM_REQUESTS
    assert value(decoded, "nixl_pd_transfer_bytes_sum") > 0
    assert value(decoded, "nixl_pd_transfer_descriptors_sum") >= NUM_REQUESTS
    assert value(decoded, "nixl_pd_transfer_seconds_sum") > 0
    assert value(decoded, "nixl_pd_transfer_bytes_bucket", le="+Inf") == NUM_REQUESTS
    assert value(decoded, "nixl_pd_handshake_seconds_count") == 1  # one prefill engine
    assert value(decoded, "nixl_pd_handshake_failures_total", reason="timeout") == 0

    # Prefill: every request's blocks freed by its reader's notification, none by expiry.
    assert value(prefilled, "nixl_pd_notifications_total", kind="counted") == NUM_REQUESTS
    for kind in ("duplicate", "stray", "garbage"):
        assert value(prefilled, "nixl_pd_notifications_total", kind=kind) == 0
    assert value(prefilled, "nixl_pd_leases_completed_total") == NUM_REQUESTS
    assert value(prefilled, "nixl_pd_leases_expired_total") == 0
    assert value(prefilled, "nixl_pd_prefill_free_seconds_count") == NUM_REQUESTS
    assert value(prefilled, "nixl_pd_loads_finished_total") == 0

    # --trace: one line per request on each side, sizes as the metrics say.
    loads = trace_lines(tmp_path / "decode.log", "load")
    assert len(loads) == NUM_REQUESTS and {line["outcome"] for line in loads} == {"ok"}
    assert sum(line["num_bytes"] for line in loads) == value(decoded, "nixl_pd_transfer_bytes_sum")
    assert len(trace_lines(tmp_path / "prefill.log", "send")) == NUM_REQUESTS


def trace_lines(log_path: Path, event: str) -> list[dict[str, Any]]:
    lines = []
    for line in log_path.read_text().splitlines():
        if " nixl_pd.trace DEBUG " in line:
            trace = json.loads(line.split(" nixl_pd.trace DEBUG ", 1)[1])
            if trace["event"] == event:
                lines.append(trace)
    return lines


def test_a_bad_metrics_port_is_refused_in_one_line() -> None:
    completed = run_cli("serve", "--role", "decode", "--metrics-port", "70000", timeout_s=30.0)

    assert completed.returncode == 2
    assert completed.stderr.strip() == (
        "nixl-pd serve: error: --metrics-port 70000: use 1..65535, or 0 for a free port"
    )
