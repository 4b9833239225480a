"""What the real-vLLM tier's modules share in one pytest session: models, one single engine, logs.

Every real-vLLM module used to build its own tiny model, start its own plain single engine
(the reference its P/D answers are compared with) and copy the same scratch-folder and
keep-the-logs-on-failure code. A `Workspace`, the session fixture ``real_vllm`` of
tests/conftest.py, does that once:

- ``model(kind)``: each tiny model (tests/real_vllm_model.py) built once per session;
- ``reference()``: the plain tiny-Llama single engine (no connector, the harness's engine
  arguments, 128 KV blocks), started on first use and stopped when the session ends. Its answers depend on
  nothing another module does to its own engines, so every module comparing tiny-Llama P/D
  answers with a single engine asks this one;
- ``pair(connector)``: the plain tiny-Llama P/D pair of that connector (default failure
  policies; ours with verify_kv, a short ``overlap_wait_timeout``, ``chunked_pull`` and a
  prefill that computes in chunks of 128 tokens) and its proxy, behind
  the shared reference; started on first use, stopped when the session ends. Every module
  whose cases need a plain pair and leave it serving shares it (tests/test_real_vllm.py,
  tests/test_real_vllm_overlap.py, the n-gram case's prefill in
  tests/test_real_vllm_configs.py): an engine start is 30-150 s of the tier's time. A module
  that needs other engine flags or connector settings, or kills, pauses or restarts engines
  mid-module (but tests/test_real_vllm.py's last case, a restart on the same ports), starts
  its own;
- ``module_logs(request, what)``: a log folder for one module's engines, kept (and named in
  a warning, so that pytest's summary shows it) when one of the module's tests failed.

A new real-vLLM module takes the ``real_vllm`` fixture and builds its engines from these
(docs/testing.md, "A new real-vLLM module").

Stdlib only, like the harness: this module runs in the test environment (.venv).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real_vllm_harness import Deployment, Engine, EngineSpec, build_model, free_port

REFERENCE_NUM_BLOCKS = 128
# The shared pair's KV blocks (128 MiB each with the tiny model, not 1 GiB: it lives beside
# every module's own engines). Its largest user keeps 16 prompts of up to 7 blocks cached.
PAIR_NUM_BLOCKS = 512
# Our pair's prefill computes prompts in chunks of this many tokens (chunked prefill), and
# both engines have chunked_pull on: under overlapped dispatch
# (tests/test_real_vllm_overlap.py) decode pulls each chunk while prefill computes the next.
# Sequential dispatch (every other user) is the same as without it, chunked prefill included.
PAIR_PREFILL_CHUNK = 128
# Its decode's overlap_wait_timeout: how long a load waits for prefill's announcement under
# overlapped dispatch (tests/test_real_vllm_overlap.py); sequential dispatch never waits.
OVERLAP_WAIT_S = 5.0


class Workspace:
    """One session's scratch folder (our own, not pytest's tmp_path: pytest deletes all but
    the three newest basetemps, and other pytest runs on the machine would delete a model
    under running engines), its models and its shared single engine."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, Path] = {}
        self._reference: Engine | None = None
        self._pairs: dict[str, Deployment] = {}
        self._running = contextlib.ExitStack()  # the shared pairs
        self._kept: list[Path] = []  # log folders kept for a failed module

    @classmethod
    @contextlib.contextmanager
    def open(cls, session: pytest.Session) -> Iterator[Workspace]:
        """A workspace for ``session``; on exit the shared engine stops and everything goes,
        except the logs of a failed module and, after any failure, the reference's log."""
        workspace = cls(Path(tempfile.mkdtemp(prefix="nixlpd-real-vllm-")))
        failed_before = session.testsfailed
        try:
            yield workspace
        finally:
            workspace._close(keep_logs=session.testsfailed > failed_before)

    def model(self, kind: str = "llama") -> Path:
        """The tiny ``kind`` model (see build_model), built on first use."""
        if kind not in self._models:
            self._models[kind] = build_model(self.root / f"model-{kind}", kind=kind)
        return self._models[kind]

    def reference(self) -> Engine:
        """The shared tiny-Llama single engine, started (not necessarily ready: wait_ready
        it along with your own engines, so that they all start at once)."""
        if self._reference is None:
            logs = self.root / "logs-reference"
            logs.mkdir(exist_ok=True)
            # It lives through the whole tier, beside every module's own engines: 128 blocks
            # (32 MiB; a fleet's engines get as many), not 1 GiB. Eight sequences of at most
            # --max-model-len 1024 tokens use 64 at most.
            sized = ("--num-gpu-blocks-override", str(REFERENCE_NUM_BLOCKS))
            spec = EngineSpec("reference", self.model(), free_port(), extra_args=sized)
            self._reference = Engine(spec, logs)
            self._reference.start()
        return self._reference

    def pair(self, connector: str = "nixlpd") -> Deployment:
        """The shared tiny-Llama P/D pair of ``connector`` (``deployment.reference`` is the
        shared single engine), started and ready, its proxy serving. A user may restart its
        prefill on the same ports (`Deployment.restart_prefill`) but must leave it serving."""
        if connector not in self._pairs:
            logs = self.root / f"logs-pair-{connector}"
            logs.mkdir(exist_ok=True)
            extra, prefill_args = None, ()
            if connector == "nixlpd":
                extra = {"overlap_wait_timeout": OVERLAP_WAIT_S, "chunked_pull": True}
                prefill_args = ("--max-num-batched-tokens", str(PAIR_PREFILL_CHUNK))
            self._pairs[connector] = self._running.enter_context(
                Deployment.running(
                    self.model(),
                    connector,
                    logs,
                    extra_config=extra,
                    reference=self.reference(),
                    extra_args=("--num-gpu-blocks-override", str(PAIR_NUM_BLOCKS)),
                    prefill_args=prefill_args,
                )
            )
        return self._pairs[connector]

    @contextlib.contextmanager
    def module_logs(self, request: pytest.FixtureRequest, what: str) -> Iterator[Path]:
        """A fresh log folder for one module's engines (``request``: its module fixture's).
        Kept when the block raised or one of the module's tests failed, else removed."""
        logs = Path(tempfile.mkdtemp(prefix=f"logs-{request.module.__name__}-", dir=self.root))
        failed_before = request.session.testsfailed
        keep = True  # until the block ends without an error
        try:
            yield logs
            keep = request.session.testsfailed > failed_before
        finally:
            if keep:
                self._kept.append(logs)
                warnings.warn(f"{what} logs kept in {logs}", stacklevel=1)
            else:
                shutil.rmtree(logs, ignore_errors=True)

    def _close(self, *, keep_logs: bool) -> None:
        self._running.close()
        if self._reference is not None:
            self._reference.cleanup()
        for model in self._models.values():
            shutil.rmtree(model, ignore_errors=True)
        if keep_logs or self._kept:
            if self._reference is not None:
                warnings.warn(
                    f"shared reference engine log kept in {self._reference.log_dir}", stacklevel=1
                )
            for pair in self._pairs.values():
                warnings.warn(f"shared pair's logs kept in {pair.prefill.log_dir}", stacklevel=1)
            return
        shutil.rmtree(self.root, ignore_errors=True)
