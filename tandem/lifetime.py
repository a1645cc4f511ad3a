"""Child processes that end when the process that started them ends, however it ends (SIGKILL included).

A process that is stopped in order stops its children itself (`tandem serve` its services, a target its ranks);
one that is killed cannot, and its children would run on as orphans, holding ports, memory and cores. So on Linux
each child asks the kernel for SIGTERM when its parent goes (prctl PR_SET_PDEATHSIG): a Tandem service stops
cleanly on SIGTERM, and stops its own children on the way.

The request is made after exec, not between fork and exec (a Popen preexec_fn): `start_child` runs the command
through `python -m tandem.lifetime`, which makes it and then execs the command in the same process (the request
survives exec). A preexec_fn would make Popen fork the whole process instead of vfork, and a fork runs gRPC's
fork handlers, which in a process serving gRPC (the launcher's Scaler) pause its threads, and in the child can
start a poller that dies before exec (grpc/grpc#43055).

The kernel's parent is the thread that forked, not the process: the signal comes as soon as that thread ends, even
while the rest of the process runs on. The threads that start children are not all long-lived (a gRPC worker of the
launcher's Scaler starts draft replicas, the target's model thread starts its ranks and ends when the target stops,
before it stops them), so every child is forked by one thread that lives as long as the process.

On other systems (macOS) there is no such request: children start as plain subprocesses and outlive a killed parent.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ON_LINUX = sys.platform.startswith("linux")  # where PR_SET_PDEATHSIG exists


def start_child(
    command: Sequence[str],
    start_new_session: bool = False,
    env: Mapping[str, str] | None = None,
    pipe_output: bool = False,
) -> subprocess.Popen[bytes]:
    """Starts `command` as a child process that gets SIGTERM when this process ends (see the module docstring).

    `env`: the child's whole environment (None: this process's). `pipe_output`: its stdout and stderr, merged, are
    the returned process's `stdout` pipe (bytes)."""
    if ON_LINUX:
        command = [sys.executable, "-m", __name__, str(os.getpid()), *command]
    return FORKING_THREAD.popen(command, start_new_session, env, pipe_output)


class ForkingThread:
    """The thread that forks this process's children; it never ends, so their signal comes only when the process ends.

    Started on first use, and again in a forked copy of this process, where it does not exist.
    """

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(
        self,
        command: Sequence[str],
        start_new_session: bool,
        env: Mapping[str, str] | None = None,
        pipe_output: bool = False,
    ) -> subprocess.Popen[bytes]:
        """subprocess.Popen(command) forked on this thread."""
        result: Future[subprocess.Popen[bytes]] = Future()
        stdout, stderr = (subprocess.PIPE, subprocess.STDOUT) if pipe_output else (None, None)

        def fork() -> None:
            try:
                result.set_result(
                    subprocess.Popen(
                        command, start_new_session=start_new_session, env=env, stdout=stdout, stderr=stderr
                    )
                )
            except BaseException as error:  # raised on the caller's thread instead
                result.set_exception(error)

        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="child-forker", daemon=True)
                self._thread.start()
            self._requests.put(fork)
        return result.result()

    def _serve(self) -> None:
        while True:
            self._requests.get()()


FORKING_THREAD = ForkingThread()


def die_with_parent(parent: int, signum: int = signal.SIGTERM) -> None:
    """Asks the kernel to send this process `signum` when the thread of `parent` that forked it ends (Linux only).

    Exits at once if the parent has already ended, before the request could count.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signum)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    if os.getppid() != parent:  # adopted by another process: no signal will come
        sys.exit(f"tandem.lifetime: parent process {parent} ended before its child started")


def main(arguments: Sequence[str]) -> NoReturn:
    """`python -m tandem.lifetime PARENT_PID COMMAND...`: COMMAND in this process, ending with process PARENT_PID."""
    parent, *command = arguments
    die_with_parent(int(parent))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
