"""Loaded at start-up by every Python process that `python -m bench.trace` starts (this folder is put first on their
PYTHONPATH): when TANDEM_TRACE_DIR is set, it wraps the calls that mark a round's path through the services and
logs when each happened (CLOCK_MONOTONIC, which every process on a host shares) to TANDEM_TRACE_DIR/<pid>.log.
The wrapping is applied to each module right after it is imported, so the services run unchanged otherwise.

Events (see bench/trace/__init__.py for the round they describe):
    target: step_in / step_out (the Step call's handler), take_start / take_end (waiting for pushed drafts),
            compute_start / compute_end (the step handed to the model thread and back), runner_start / runner_end
            (TargetRunner.step on the model thread), rows_yield / rows_written (the write holding a step's last rows
            for a replica given to gRPC, and gRPC asking for the next one: it is written), push_arrived / push_added
            (a replica's pushed drafts read off their stream, and kept)
    draft:  rows_arrived (the write holding a step's last rows read off the stream), draft_start / draft_end (a
            batch drafted ahead, on the model thread), push (its drafts queued for the target)
    orchestrator: step_send / step_answer (the Step call)
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

TRACE_DIR = os.environ.get("TANDEM_TRACE_DIR")
FLUSH_EVERY = 256


class _Log:
    """Events of this process, written to its file in batches (and at exit)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, f"{os.getpid()}.log")
        self.events: list[tuple[int, str]] = []
        with open(self.path, "w") as file:
            file.write(" ".join(sys.argv[:3]) + "\n")

    def event(self, name: str) -> None:
        self.events.append((time.monotonic_ns(), name))
        if len(self.events) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        with open(self.path, "a") as file:
            file.writelines(f"{at} {name}\n" for at, name in self.events)
        self.events.clear()


def _around(log: _Log, owner: Any, name: str, before: str, after: str) -> None:
    """Wraps owner.name (a plain or a coroutine function) to log `before` and `after` it runs."""
    original = getattr(owner, name)
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def wrapped_coroutine(*args: Any, **kwargs: Any) -> Any:
            log.event(before)
            try:
                return await original(*args, **kwargs)
            finally:
                log.event(after)

        setattr(owner, name, wrapped_coroutine)
        return

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        log.event(before)
        try:
            return original(*args, **kwargs)
        finally:
            log.event(after)

    setattr(owner, name, wrapped)


def _target_service(log: _Log, module: ModuleType) -> None:
    service = module.TargetService
    _around(log, service, "_step", "step_in", "step_out")
    _around(log, service, "_take_pushed", "take_start", "take_end")
    _around(log, service, "_run", "compute_start", "compute_end")
    subscribe = service.SubscribeHidden

    async def subscribe_hidden(self: Any, request: Any, context: Any) -> Any:
        async for batch in subscribe(self, request, context):
            step_end = any(message.step_end for message in batch.rows)
            if step_end:
                log.event("rows_yield")
            yield batch
            if step_end:
                log.event("rows_written")

    service.SubscribeHidden = subscribe_hidden


def _target_runner(log: _Log, module: ModuleType) -> None:
    _around(log, module.TargetRunner, "step", "runner_start", "runner_end")


def _target_pushed(log: _Log, module: ModuleType) -> None:
    _around(log, module.PushedDrafts, "add", "push_arrived", "push_added")


def _draft_service(log: _Log, module: ModuleType) -> None:
    service = module.DraftService
    consume = service.consume

    async def consume_logged(self: Any, stream: Any) -> None:
        async def logged() -> Any:
            async for batch in stream:
                if any(message.step_end for message in batch.rows):
                    log.event("rows_arrived")
                yield batch

        await consume(self, logged())

    service.consume = consume_logged
    _around(log, module, "_timed_proposals", "draft_start", "draft_end")
    _around(log, service, "_push", "push", "push_queued")


def _orchestrator_backends(log: _Log, module: ModuleType) -> None:
    _around(log, module.GrpcTarget, "step", "step_send", "step_answer")


WRAPPERS: dict[str, Callable[[_Log, ModuleType], None]] = {
    "target_server.service": _target_service,
    "target_server.runner": _target_runner,
    "target_server.pushed": _target_pushed,
    "draft_server.service": _draft_service,
    "orchestrator.grpc_backends": _orchestrator_backends,
}


class _WrapAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, log: _Log) -> None:
        self.log = log

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        wrap = WRAPPERS.get(name)
        if wrap is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module
        log = self.log

        def exec_module(module: ModuleType) -> None:
            execute(module)
            wrap(log, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if TRACE_DIR:
    import atexit

    _log = _Log(TRACE_DIR)
    atexit.register(_log.flush)
    sys.meta_path.insert(0, _WrapAfterImport(_log))
