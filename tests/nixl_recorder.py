"""A recording stand-in for the ``nixl._api`` and ``nixl._bindings`` modules.

``load_recorded_nixl_real(monkeypatch)`` imports worker.nixl_real against it, so tests see
exactly what RealNixlAgent asks of NIXL (memory types, device ids, backends) on a machine
without GPUs. Every call is appended to ``Recorder.calls`` as (method, args).
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest


@dataclass
class Recorder:
    plugins: tuple[str, ...] = ("UCX", "POSIX")
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    def of(self, method: str) -> list[tuple[Any, ...]]:
        return [args for name, args in self.calls if name == method]


class nixlNotFoundError(Exception):  # noqa: N801  (NIXL's own spelling)
    pass


def _bindings_module(recorder: Recorder) -> types.ModuleType:
    module = types.ModuleType("nixl._bindings")

    class nixlAgentConfig:  # noqa: N801
        pass

    class nixlAgent:  # noqa: N801
        def __init__(self, name: str, config: Any) -> None:
            recorder.calls.append(("cpp_agent", (name, config.pthrDelay)))

    module.nixlAgentConfig = nixlAgentConfig  # type: ignore[attr-defined]
    module.nixlAgent = nixlAgent  # type: ignore[attr-defined]
    module.NIXL_THREAD_SYNC_NONE = 0  # type: ignore[attr-defined]
    module.nixlNotFoundError = nixlNotFoundError  # type: ignore[attr-defined]
    return module


def _api_module(recorder: Recorder) -> types.ModuleType:
    module = types.ModuleType("nixl._api")

    class nixl_agent_config:  # noqa: N801
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs

    class nixl_xfer_handle:  # noqa: N801
        def release(self) -> None:
            recorder.calls.append(("release", ()))

    class nixl_agent:  # noqa: N801
        def __init__(self, name: str, config: Any) -> None:
            self.name = name
            self.agent: Any = None

        def get_plugin_list(self) -> list[str]:
            return list(recorder.plugins)

        def create_backend(self, backend: str, init: dict[str, str]) -> None:
            recorder.calls.append(("create_backend", (backend, dict(init))))

        def register_memory(self, rows: Any, mem_type: str) -> str:
            recorder.calls.append(("register_memory", (np.asarray(rows).tolist(), mem_type)))
            return "registration"

        def deregister_memory(self, registration: Any) -> None:
            recorder.calls.append(("deregister_memory", (registration,)))

        def get_agent_metadata(self) -> bytes:
            return b"metadata-of-" + self.name.encode()

        def add_remote_agent(self, metadata: bytes) -> bytes:
            return metadata.removeprefix(b"metadata-of-")

        def remove_remote_agent(self, name: str) -> None:
            recorder.calls.append(("remove_remote_agent", (name,)))

        def get_xfer_descs(self, rows: Any, mem_type: str) -> tuple[str, list[list[int]]]:
            recorder.calls.append(("get_xfer_descs", (np.asarray(rows).tolist(), mem_type)))
            return (mem_type, np.asarray(rows).tolist())

        def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str, notif: bytes) -> Any:
            recorder.calls.append(("initialize_xfer", (op, local, remote, peer, notif)))
            return nixl_xfer_handle()

        def prep_xfer_dlist(self, owner: str, rows: Any, mem_type: str) -> Any:
            recorder.calls.append(("prep_xfer_dlist", (owner, rows, mem_type)))
            return nixl_xfer_handle()

        def make_prepped_xfer(self, op: str, *args: Any) -> Any:
            recorder.calls.append(("make_prepped_xfer", (op, *args)))
            return nixl_xfer_handle()

        def transfer(self, handle: Any) -> str:
            return "DONE"

        def check_xfer_state(self, handle: Any) -> str:
            return "DONE"

        def get_new_notifs(self) -> dict[str, list[bytes]]:
            return {}

        def send_notif(self, peer: str, message: bytes) -> None:
            recorder.calls.append(("send_notif", (peer, message)))

    module.nixl_agent = nixl_agent  # type: ignore[attr-defined]
    module.nixl_agent_config = nixl_agent_config  # type: ignore[attr-defined]
    module.nixl_xfer_handle = nixl_xfer_handle  # type: ignore[attr-defined]
    # Handle types the agent only names (annotations): any other name is a plain class.
    module.__getattr__ = _handle_type  # type: ignore[method-assign]
    return module


def _handle_type(name: str) -> type:
    if not name.startswith("nixl_"):
        raise AttributeError(name)
    return type(name, (), {})


def load_recorded_nixl_real(monkeypatch: pytest.MonkeyPatch, recorder: Recorder) -> Any:
    """worker.nixl_real imported against the recorder; monkeypatch restores the real modules."""
    import nixl

    import worker

    # Import the real module first, so monkeypatch has it to put back: otherwise the recorded
    # module stays in sys.modules and later tests' "real" agents move no bytes.
    importlib.import_module("worker.nixl_real")
    bindings, api = _bindings_module(recorder), _api_module(recorder)
    monkeypatch.setitem(sys.modules, "nixl._bindings", bindings)
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    monkeypatch.setattr(nixl, "_bindings", bindings)
    monkeypatch.setattr(nixl, "_api", api)
    monkeypatch.delitem(sys.modules, "worker.nixl_real")
    monkeypatch.setattr(worker, "nixl_real", worker.nixl_real)
    return importlib.import_module("worker.nixl_real")
