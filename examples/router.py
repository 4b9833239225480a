"""A toy P/D router: prompt -> prefill (do_remote_decode) -> decode with the returned params.

Multi-turn: a next turn's prompt goes to prefill with the params decode returned for the
previous turn (engines in bidirectional mode), so prefill pulls the history from decode.

Like vLLM's toy proxy: prefill runs the prompt with ``max_tokens=1`` and returns the first
token and ``kv_transfer_params``; the router sends prompt + that token to decode with those
params untouched, and decode generates the rest. Engines are reached through ``EngineHandle``
(an in-process engine or a server process); the router only submits and polls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from examples.engine import Engine, EngineRequest, RequestOutput

POLL_S = 0.002  # each engine's poll wait while the router has requests in flight


class EngineHandle(Protocol):
    """One engine the router can talk to.

    A handle may also have ``problem(num_pending: int) -> str | None``: why the engine cannot
    finish its pending requests (it died, it stopped answering), or None. Once it gives a
    reason the router ends those requests with it instead of waiting for its timeout.
    """

    def submit(self, request: EngineRequest) -> None: ...

    def poll(self, timeout_s: float) -> list[RequestOutput]:
        """Outputs finished since the last poll (waits at most ``timeout_s`` for the first)."""
        ...


@dataclass
class Completion:
    """One client request's journey through both engines."""

    request_id: str
    prompt: list[int]
    prefill: RequestOutput | None = None
    decode: RequestOutput | None = None
    submitted_s: float = 0.0
    first_token_s: float | None = None
    done_s: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """The first token (from prefill) followed by decode's tokens."""
        first = self.prefill.token_ids if self.prefill else []
        return first + (self.decode.token_ids if self.decode else [])

    @property
    def done(self) -> bool:
        return self.done_s is not None


def prefill_request_id(request_id: str) -> str:
    return f"{request_id}-prefill"


def decode_request_id(request_id: str) -> str:
    return f"{request_id}-decode"


class ToyRouter:
    """Runs a batch of prompts through a prefill engine and a decode engine."""

    def __init__(
        self,
        prefill: EngineHandle,
        decode: EngineHandle,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.clock = clock
        self.problems: dict[str, str] = {}  # "prefill"/"decode" -> why it cannot finish

    def run(
        self,
        prompts: Mapping[str, Sequence[int]],
        num_decode_tokens: int,
        *,
        timeout_s: float,
        on_done: Callable[[Completion], None] | None = None,
        held: Mapping[str, Mapping[str, object]] | None = None,
    ) -> dict[str, Completion]:
        """Send every prompt; returns when all completed or failed, or after ``timeout_s``
        (unfinished requests then carry a timeout error).

        ``held``: request id -> the params the previous turn's decode returned (multi-turn);
        they go to prefill whole, instead of a bare do_remote_decode, so prefill can pull the
        conversation's KV from decode."""
        held = held or {}
        completions = {
            rid: Completion(rid, list(p), submitted_s=self.clock()) for rid, p in prompts.items()
        }
        by_prefill = {prefill_request_id(rid): c for rid, c in completions.items()}
        by_decode = {decode_request_id(rid): c for rid, c in completions.items()}
        for completion in completions.values():
            self.prefill.submit(
                EngineRequest(
                    prefill_request_id(completion.request_id),
                    completion.prompt,
                    1,
                    dict(held.get(completion.request_id, {"do_remote_decode": True})),
                )
            )
        deadline_s = self.clock() + timeout_s
        pending = len(completions)
        while pending and self.clock() < deadline_s:
            for output in self.prefill.poll(POLL_S):
                prefilled = by_prefill.get(output.request_id)
                if prefilled is not None and self._on_prefill(prefilled, output, num_decode_tokens):
                    pending -= self._finish(prefilled, on_done)
            for output in self.decode.poll(POLL_S):
                decoded = by_decode.get(output.request_id)
                if decoded is not None and not decoded.done:
                    decoded.decode = output
                    if output.error:
                        decoded.errors.append(f"decode: {output.error}")
                    pending -= self._finish(decoded, on_done)
            pending -= self._fail_on_dead_engines(completions, on_done)
        for completion in completions.values():
            if not completion.done:
                completion.errors.append(f"timed out after {timeout_s} s")
        return completions

    def _on_prefill(
        self, completion: Completion, output: RequestOutput, num_decode_tokens: int
    ) -> bool:
        """Forward a prefill result to decode; True if the request ends here (failure)."""
        completion.prefill = output
        completion.first_token_s = self.clock()
        if output.error or not output.kv_transfer_params or not output.token_ids:
            completion.errors.append(f"prefill: {output.error or 'no kv_transfer_params returned'}")
            return True
        self.decode.submit(
            EngineRequest(
                decode_request_id(completion.request_id),
                completion.prompt + output.token_ids[:1],
                num_decode_tokens,
                dict(output.kv_transfer_params),
            )
        )
        return False

    def _fail_on_dead_engines(
        self, completions: Mapping[str, Completion], on_done: Callable[[Completion], None] | None
    ) -> int:
        """End, with the reason, the requests an engine that died can no longer finish:
        prefill's not yet prefilled ones; decode's every one (they all end there)."""
        open_ = [c for c in completions.values() if not c.done]
        at_prefill = [c for c in open_ if c.prefill is None]
        num_ended = 0
        for role, engine, stuck in (
            ("prefill", self.prefill, at_prefill),
            ("decode", self.decode, open_),
        ):
            problem = self.problems.get(role) or _problem_of(engine, len(stuck))
            if problem is None or not stuck:
                continue
            self.problems[role] = problem
            for completion in stuck:
                if not completion.done:
                    completion.errors.append(f"{role}: {problem}")
                    num_ended += self._finish(completion, on_done)
        return num_ended

    def _finish(self, completion: Completion, on_done: Callable[[Completion], None] | None) -> int:
        completion.done_s = self.clock()
        if on_done is not None:
            on_done(completion)
        return 1


def _problem_of(engine: EngineHandle, num_pending: int) -> str | None:
    problem: Callable[[int], str | None] | None = getattr(engine, "problem", None)
    return problem(num_pending) if problem is not None else None


def run_local(
    engine: EngineHandle,
    prompts: Mapping[str, Sequence[int]],
    max_tokens: int,
    *,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, RequestOutput]:
    """Run plain requests (no transfer params) on one engine, e.g. to warm its prefix cache."""
    for request_id, prompt in prompts.items():
        engine.submit(EngineRequest(request_id, list(prompt), max_tokens))
    outputs: dict[str, RequestOutput] = {}
    deadline_s = clock() + timeout_s
    while len(outputs) < len(prompts):
        if clock() > deadline_s:
            raise TimeoutError(
                f"{len(prompts) - len(outputs)} local request(s) unfinished after {timeout_s} s"
            )
        outputs.update((o.request_id, o) for o in engine.poll(POLL_S) if o.request_id in prompts)
    return outputs


class InProcessEngine:
    """An EngineHandle over an Engine in this process: each poll is one engine step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._ready: list[RequestOutput] = []

    def submit(self, request: EngineRequest) -> None:
        error = self.engine.add_request(request)
        if error is not None:
            self._ready.append(error)

    def poll(self, timeout_s: float) -> list[RequestOutput]:
        outputs, self._ready = self._ready, []
        if self.engine.has_work():
            outputs += self.engine.step()
        return outputs

    def problem(self, num_pending: int) -> str | None:
        return None  # it lives in this process
