"""Stamp a P->D request's connector hooks inside a real vLLM engine (benchmarks only).

Loaded by the engine itself: ``kv_connector_module_path: benchmarks.latency_probe`` with
``kv_connector`` set to ``ProbedNixlPDConnector`` (ours) or ``ProbedNixlConnector`` (vLLM's
own), and ``NIXL_PD_LATENCY_PROBE=<file>`` in the engine's environment. Each class is the
real connector with a thin wrapper per hook that appends one JSON line per (event, request)
the first time it happens: ``{"t": <wall clock s>, "event": ..., "rid": <vLLM request id>}``.
Wall clock, so that the router's stamps (another process) line up with the engine's.

Ours also gets its trace logger (connector/trace.py, ``nixl_pd.trace``) turned on, into
``<file>.trace``, one ``{"t": <when logged>, "trace": <the trace line>}`` per load.

Events: ``claimed`` (get_num_new_matched_tokens), ``allocated`` (update_state_after_alloc),
``scheduled`` (the request's first step that computes tokens: build_connector_meta),
``load_started`` / ``load_returned`` (start_load_kv with the request's load: on entry and on
return), ``load_reported`` (get_transfer_results hands it to vLLM as received),
``scheduler_heard`` (update_connector_output), ``finished`` (request_finished: prefill
returns the params).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from connector.vllm import NixlPDConnector

PROBE_ENV = "NIXL_PD_LATENCY_PROBE"


class _Probe:
    """One per process: the first time of each (event, request) goes to the probe file."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the engine
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # guards _seen and the file (engine and other threads)

    def stamp(self, event: str, request_ids: Iterable[str]) -> None:
        now_s = time.time()
        with self._lock:
            for rid in request_ids:
                if (event, rid) in self._seen:
                    continue
                self._seen.add((event, rid))
                self._file.write(json.dumps({"t": now_s, "event": event, "rid": rid}) + "\n")


_probe: _Probe | None = None
_probe_lock = threading.Lock()


def _get_probe() -> _Probe | None:
    global _probe
    path = os.environ.get(PROBE_ENV)
    if not path:
        return None
    with _probe_lock:
        if _probe is None:
            _probe = _Probe(path)
            _trace_into(path + ".trace")
    return _probe


def _trace_into(path: str) -> None:
    """Our per-load trace lines, each with the wall-clock time it was logged."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter('{"t": %(created).6f, "trace": %(message)s}'))
    trace = logging.getLogger("nixl_pd.trace")
    trace.addHandler(handler)
    trace.setLevel(logging.DEBUG)
    trace.propagate = False


def _stamp(event: str, request_ids: Iterable[str]) -> None:
    probe = _get_probe()
    if probe is not None:
        probe.stamp(event, request_ids)


def _loads_of(metadata: Any) -> list[str]:
    """The request ids a step's metadata asks this worker to load (ours or vLLM's)."""
    step = getattr(metadata, "step", None)
    if step is not None:
        return [load.request_id for load in step.loads]
    return list(getattr(metadata, "reqs_to_recv", {}) or {})


def _scheduled(scheduler_output: Any) -> list[str]:
    new = [req.req_id for req in scheduler_output.scheduled_new_reqs]
    return new + list(scheduler_output.scheduled_cached_reqs.req_ids)


class _Probed:
    """Wraps each hook of the connector class it is mixed into (listed first)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)  # type: ignore[misc]
        _stamp("claimed", (request.request_id,))
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        _stamp("allocated", (request.request_id,))
        super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        _stamp("scheduled", _scheduled(scheduler_output))
        return super().build_connector_meta(scheduler_output)  # type: ignore[misc]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        loads = _loads_of(self._get_connector_metadata())  # type: ignore[attr-defined]
        _stamp("load_started", loads)
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]
        _stamp("load_returned", loads)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        _stamp("load_reported", results.finished_recving or ())
        return results

    def update_connector_output(self, connector_output: Any) -> None:
        _stamp("scheduler_heard", connector_output.finished_recving or ())
        super().update_connector_output(connector_output)  # type: ignore[misc]

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        _stamp("finished", (request.request_id,))
        return super().request_finished(request, block_ids)  # type: ignore[misc]

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        _stamp("finished", (request.request_id,))
        return super().request_finished_all_groups(request, block_ids)  # type: ignore[misc]


class ProbedNixlPDConnector(_Probed, NixlPDConnector):
    """Ours, stamped."""


class ProbedNixlConnector(_Probed, NixlConnector):
    """vLLM's own NixlConnector, stamped."""
