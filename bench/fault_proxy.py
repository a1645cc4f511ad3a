"""A TCP proxy that breaks a link the way networks do, for fault tests: put it between two services (give the client
its address instead of the server's), then add latency to every chunk it forwards, blackhole the link (nothing passes
either way until it heals, connections stay open), refuse new connections (reset at once), or reset every open one.

Threads, not asyncio: `tandem bench-faults` (bench.faults) and the tests drive it from plain code while real services
talk through it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Link:
    client: socket.socket
    server: socket.socket


@dataclass
class FaultProxy:
    upstream: str  # host:port of the server
    delay_s: float = 0.0  # added before each chunk is passed on, both ways
    refusing: bool = False  # new connections are reset as soon as they are accepted
    _links: list[_Link] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _flowing: threading.Event = field(default_factory=threading.Event)  # cleared: blackholed

    def __post_init__(self) -> None:
        self._flowing.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def reset(self) -> int:
        """Resets (RST) both sides of every open connection; returns how many there were."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            for end in (link.client, link.server):
                _abort(end)
        return len(links)

    def blackhole(self) -> None:
        """Nothing passes until heal(): bytes wait in the proxy, and a peer that waits for an answer hears nothing."""
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._listener.close()
        self.reset()

    def _accept(self) -> None:
        host, port = self.upstream.rsplit(":", 1)
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            if self.refusing:
                _abort(client)
                continue
            try:
                server = socket.create_connection((host, int(port)), timeout=10)
            except OSError:
                _abort(client)
                continue
            server.settimeout(None)
            link = _Link(client, server)
            with self._lock:
                self._links.append(link)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                chunk = source.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                _abort(sink)
                return
            self._flowing.wait()
            if self.delay_s:
                time.sleep(self.delay_s)
            try:
                sink.sendall(chunk)
            except OSError:
                _abort(source)
                return


def _abort(end: socket.socket) -> None:
    """Closes with RST (linger 0), as a reset link does; a socket already closed is left alone. The read side is
    shut first: that wakes a pump blocked reading it, whose call would otherwise hold the socket open (and the RST
    back) until its next byte came."""
    with contextlib.suppress(OSError):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        end.shutdown(socket.SHUT_RD)
    end.close()
