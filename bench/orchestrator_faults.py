"""The orchestrator's own faults in `tandem bench-faults` (bench.faults): SIGTERM under the streams, which drains
them (within --shutdown-timeout: the second orchestrator's is short, and ends those still running with UNAVAILABLE);
and SIGKILL while the second orchestrator serves, whose streams the clients resume there (tandem.resuming). Each
fault returns what it saw of the orchestrator (bench.fault_stack.Signalled) and leaves it serving again.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import grpc

from bench.fault_stack import FaultStack, Signalled
from bench.fault_streams import completion

PROBE_FOR_S = 5.0  # how long new requests are sent after a SIGTERM before its refusal counts as missing
EXIT_WAIT_S = 60.0
TAKEOVER_S = 2.0  # how long the first orchestrator stays dead while the second takes its streams


def drain(stack: FaultStack, name: str) -> Callable[[], Signalled]:
    """SIGTERM: the streams finish; new requests are refused; the process exits; then it starts again."""
    return lambda: _terminated(stack, name)


def takeover(stack: FaultStack, name: str) -> Callable[[], Signalled]:
    """SIGKILL, and started again only after TAKEOVER_S: the clients resume on the second orchestrator."""

    def fault() -> Signalled:
        began = time.monotonic()
        exit_code = stack.services[name].kill()
        exited_s = time.monotonic() - began
        time.sleep(TAKEOVER_S)
        return Signalled(exit_code, exited_s, stack.start_again(name, began=began))

    return fault


def _terminated(stack: FaultStack, name: str) -> Signalled:
    service = stack.services[name]
    began = time.monotonic()
    service.signal(signal.SIGTERM)
    refused_s = _refused_after(service.address, began)
    assert service.process is not None
    exit_code = service.process.wait(timeout=EXIT_WAIT_S)
    exited_s = time.monotonic() - began
    return Signalled(exit_code, exited_s, stack.start_again(name, began=began), refused_s)


def _refused_after(address: str, began: float) -> float | None:
    """Seconds from `began` until a new one-token request was refused (UNAVAILABLE); None: none was."""
    while time.monotonic() - began < PROBE_FOR_S:
        try:
            completion(address, input_ids=[1, 2, 3], max_new_tokens=1)
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.UNAVAILABLE:
                return time.monotonic() - began
            raise
    return None
