"""Draft discovery: follow a DNS name and keep the replica pool in step with the addresses it resolves to.

On Kubernetes the name is the draft Deployment's headless Service, which resolves to one address per ready pod,
so `kubectl scale` or an HPA changes the replicas with no admin call. Every pass (`DiscoverySettings.interval_s`):

- a new address is connected (GetInfo gives its replica id) and joins the pool; one that does not answer yet is
  tried again at the next pass;
- an address that is gone is drained: it gets no new requests, keeps its running ones, and leaves the pool when they
  finish; it serves again if it comes back first;
- a failed resolution (the DNS server does not answer) changes nothing, while an answer that the name has no address
  (a headless Service without ready pods) drains every replica the name brought.

Replicas given by address (`--draft-address`, AddReplica of an allow-listed address) are never touched. The name is
also an allow rule of AddReplica: an address it resolves to now may be added at once (`join_now`), as a replica of
this discovery, drained when it leaves DNS. The resolver is a seam: `DnsResolver` asks the system resolver; any
object with the same `resolve` works.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Protocol

import grpc

from orchestrator.peers.replicas import Connect, Replica, ReplicaPool
from orchestrator.settings import DiscoverySettings

LOG = logging.getLogger(__name__)

# getaddrinfo answers meaning "this name has no address" (NXDOMAIN, no A/AAAA record), as opposed to "no answer".
_NO_ADDRESS_ERRORS = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)


class ResolveFailed(Exception):
    """The name could not be resolved this time (as opposed to: it resolved to no address)."""


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> frozenset[str]:
        """The addresses ("ip:port", IPv6 in brackets) `host` has now; empty if none; raises ResolveFailed."""
        ...


def format_address(ip: str, port: int) -> str:
    """A gRPC target for one resolved address: "10.0.0.7:50062", "[fd00::7]:50062"."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class DnsResolver:
    """The system resolver (getaddrinfo, off the event loop): A and AAAA records, /etc/hosts included."""

    async def resolve(self, host: str, port: int) -> frozenset[str]:
        loop = asyncio.get_running_loop()
        try:
            answers = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            if error.errno in _NO_ADDRESS_ERRORS:
                return frozenset()
            raise ResolveFailed(f"{host}: {error.strerror}") from None
        return frozenset(format_address(str(sockaddr[0]), port) for *_, sockaddr in answers)


class DraftDiscovery:
    def __init__(
        self,
        settings: DiscoverySettings,
        resolver: Resolver,
        connect: Connect,
        replicas: ReplicaPool,
        on_join: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.resolver = resolver
        self.connect = connect  # address -> (replica id, backend); a connect timeout is the caller's to set
        self.replicas = replicas
        self.on_join = on_join  # called when replicas joined (the scheduler moves target-only requests to them)
        self._members: dict[str, Replica] = {}  # address -> the replica this discovery added for it
        self._drains: dict[str, asyncio.Task[None]] = {}  # address -> its running drain
        self._unanswered: set[str] = set()  # addresses already reported as not answering (reported once)
        self._had_addresses: bool | None = None

    @property
    def addresses(self) -> frozenset[str]:
        """The addresses whose replicas this discovery added and has not removed (draining ones included)."""
        return frozenset(self._members)

    async def run(self) -> None:
        """Refreshes every `interval_s` until cancelled."""
        try:
            while True:
                await self.refresh()
                await asyncio.sleep(self.settings.interval_s)
        finally:
            for drain in self._drains.values():
                drain.cancel()

    async def refresh(self) -> None:
        """One pass: resolve, then add the new addresses, drain the gone ones and keep the returning ones."""
        name = f"{self.settings.host}:{self.settings.port}"
        try:
            resolved = await self.resolver.resolve(self.settings.host, self.settings.port)
        except ResolveFailed as error:
            LOG.warning("draft discovery: cannot resolve %s (%s); keeping %d replicas", name, error, len(self._members))
            return
        self._unanswered &= resolved
        if self._had_addresses is not bool(resolved):
            if not resolved:
                LOG.warning("draft discovery: %s has no address; no draft replica from it", name)
            self._had_addresses = bool(resolved)
        for address, replica in list(self._members.items()):
            if self.replicas.get(replica.replica_id) is not replica:
                del self._members[address]  # removed by RemoveReplica
            elif address not in resolved and address not in self._drains:
                self._drain(address, replica)
            elif address in resolved and address in self._drains:
                self._drains.pop(address).cancel()
                replica.draining = False
                LOG.info("draft replica %s at %s is back: it serves again", replica.replica_id, address)
        joined = await asyncio.gather(*(self._join(address) for address in sorted(resolved - self._members.keys())))
        if any(joined):
            self.on_join()

    async def resolves_to(self, address: str) -> bool:
        """Whether the name resolves to `address` now (AddReplica's allow rule for this source); False when the
        lookup fails."""
        try:
            return address in await self.resolver.resolve(self.settings.host, self.settings.port)
        except ResolveFailed:
            return False

    async def join_now(self, address: str) -> Replica | None:
        """Joins `address` now rather than at the next pass (AddReplica); None if it does not answer or answers with
        an id already in the pool (both logged)."""
        if not await self._join(address):
            return None
        self.on_join()
        return self._members[address]

    async def _join(self, address: str) -> bool:
        try:
            replica_id, backend = await self.connect(address)
        except (grpc.aio.AioRpcError, TimeoutError, OSError) as error:
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else repr(error)
            if address not in self._unanswered:
                LOG.warning("draft discovery: no draft replica answers at %s yet (%s); retrying", address, detail)
                self._unanswered.add(address)
            return False
        self._unanswered.discard(address)
        present = self.replicas.get(replica_id)
        if present is not None:
            LOG.warning(
                "draft discovery: %s answers as replica %r, which is already in the pool at %s; not added",
                address,
                replica_id,
                present.address,
            )
            return False
        self._members[address] = self.replicas.add(replica_id, address, backend)
        LOG.info("draft replica %s at %s joined (found by DNS)", replica_id, address)
        return True

    def _drain(self, address: str, replica: Replica) -> None:
        LOG.info(
            "draft replica %s at %s left DNS: draining (%d requests)", replica.replica_id, address, replica.outstanding
        )
        replica.draining = True  # now, not when the task first runs: no request may be assigned in between
        self._drains[address] = asyncio.get_running_loop().create_task(self._remove_when_drained(address, replica))

    async def _remove_when_drained(self, address: str, replica: Replica) -> None:
        if await self.replicas.drain(replica):
            LOG.info("draft replica %s at %s removed", replica.replica_id, address)
        if self._members.get(address) is replica:
            del self._members[address]
        self._drains.pop(address, None)
