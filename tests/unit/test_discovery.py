"""Draft discovery: the pool follows what a resolver answers (a static resolver here; real DNS in integration)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import pytest

from launch.cli import build_parser
from orchestrator.peers.backends import DraftBackend, ProposedBatch, ProposeTask
from orchestrator.peers.discovery import DnsResolver, DraftDiscovery, ResolveFailed, format_address
from orchestrator.peers.replicas import ReplicaPool
from orchestrator.settings import DiscoverySettings, parse_host_port

SETTINGS = DiscoverySettings(host="draft-headless.test.svc", port=50062, interval_s=0.01)


@dataclass
class StaticResolver:
    """Answers what the test sets; `failing` makes it fail the way an unreachable DNS server does."""

    addresses: set[str] = field(default_factory=set)
    failing: bool = False
    asked: list[tuple[str, int]] = field(default_factory=list)

    async def resolve(self, host: str, port: int) -> frozenset[str]:
        self.asked.append((host, port))
        if self.failing:
            raise ResolveFailed(f"{host}: Temporary failure in name resolution")
        return frozenset(self.addresses)


class IdleDraft:
    """A replica that is never asked for drafts in these tests: discovery only connects and counts."""

    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch:
        raise AssertionError("discovery never proposes")

    async def release(self, request_ids: Sequence[str]) -> None:
        raise AssertionError("discovery never releases")

    async def probe(self) -> None:
        raise AssertionError("discovery never probes")


@dataclass
class Replicas:
    """The draft processes behind the addresses: address -> replica id; an address missing here does not answer."""

    answering: dict[str, str] = field(default_factory=dict)

    async def connect(self, address: str) -> tuple[str, DraftBackend]:
        if address not in self.answering:
            raise TimeoutError(f"{address} does not answer")
        return self.answering[address], IdleDraft()


@dataclass
class Setup:
    resolver: StaticResolver
    replicas: Replicas
    pool: ReplicaPool
    discovery: DraftDiscovery
    joins: list[None]

    def states(self) -> dict[str, str]:
        return {replica.address: f"{replica.replica_id} {replica.state}" for replica in self.pool.all()}


def setup() -> Setup:
    resolver, replicas, pool, joins = StaticResolver(), Replicas(), ReplicaPool(), []
    discovery = DraftDiscovery(SETTINGS, resolver, replicas.connect, pool, lambda: joins.append(None))
    return Setup(resolver, replicas, pool, discovery, joins)


def run(test: Callable[[Setup], Awaitable[None]]) -> None:
    async def main() -> None:
        await asyncio.wait_for(test(setup()), timeout=60)

    asyncio.run(main())


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_new_addresses_join_and_the_resolver_is_asked_for_the_configured_name() -> None:
    async def test(s: Setup) -> None:
        s.replicas.answering = {"10.0.0.1:50062": "draft-a", "10.0.0.2:50062": "draft-b"}
        s.resolver.addresses = set(s.replicas.answering)
        await s.discovery.refresh()
        assert s.states() == {"10.0.0.1:50062": "draft-a serving", "10.0.0.2:50062": "draft-b serving"}
        assert s.resolver.asked == [("draft-headless.test.svc", 50062)]
        assert len(s.joins) == 1  # the scheduler is woken once per pass that added replicas
        await s.discovery.refresh()
        assert len(s.joins) == 1
        assert s.discovery.addresses == {"10.0.0.1:50062", "10.0.0.2:50062"}

    run(test)


def test_a_gone_address_drains_before_it_is_removed() -> None:
    async def test(s: Setup) -> None:
        s.replicas.answering = {"10.0.0.1:50062": "draft-a", "10.0.0.2:50062": "draft-b"}
        s.resolver.addresses = set(s.replicas.answering)
        await s.discovery.refresh()
        s.pool.acquire("draft-b")  # a request is running on draft-b
        s.resolver.addresses = {"10.0.0.1:50062"}
        await s.discovery.refresh()
        assert s.states() == {"10.0.0.1:50062": "draft-a serving", "10.0.0.2:50062": "draft-b draining"}
        assert s.pool.pick() == "draft-a"
        s.pool.release("draft-b")  # the request finished
        await until(lambda: s.pool.get("draft-b") is None)
        assert s.states() == {"10.0.0.1:50062": "draft-a serving"}
        assert s.discovery.addresses == {"10.0.0.1:50062"}

    run(test)


def test_an_address_back_before_its_drain_ends_serves_again() -> None:
    async def test(s: Setup) -> None:
        s.replicas.answering = {"10.0.0.1:50062": "draft-a"}
        s.resolver.addresses = {"10.0.0.1:50062"}
        await s.discovery.refresh()
        s.pool.acquire("draft-a")
        s.resolver.addresses = set()
        await s.discovery.refresh()
        assert s.states() == {"10.0.0.1:50062": "draft-a draining"}
        s.resolver.addresses = {"10.0.0.1:50062"}
        await s.discovery.refresh()
        assert s.states() == {"10.0.0.1:50062": "draft-a serving"}
        s.pool.release("draft-a")
        await s.discovery.refresh()
        assert s.states() == {"10.0.0.1:50062": "draft-a serving"}

    run(test)


def test_a_failed_resolution_keeps_the_replicas_and_no_address_drains_them() -> None:
    async def test(s: Setup) -> None:
        s.replicas.answering = {"10.0.0.1:50062": "draft-a", "10.0.0.2:50062": "draft-b"}
        s.resolver.addresses = set(s.replicas.answering)
        await s.discovery.refresh()
        s.resolver.failing = True
        await s.discovery.refresh()
        assert s.states() == {"10.0.0.1:50062": "draft-a serving", "10.0.0.2:50062": "draft-b serving"}
        s.resolver.failing = False
        s.resolver.addresses = set()  # the Service has no ready pod
        await s.discovery.refresh()
        await until(lambda: not s.pool.all())
        assert s.discovery.addresses == frozenset()

    run(test)


def test_an_address_that_does_not_answer_yet_joins_at_a_later_pass() -> None:
    async def test(s: Setup) -> None:
        s.resolver.addresses = {"10.0.0.3:50062"}
        await s.discovery.refresh()
        assert s.states() == {}
        assert s.joins == []
        s.replicas.answering = {"10.0.0.3:50062": "draft-c"}  # the pod finished loading
        await s.discovery.refresh()
        assert s.states() == {"10.0.0.3:50062": "draft-c serving"}
        assert len(s.joins) == 1

    run(test)


def test_replicas_given_by_address_and_taken_ids_are_left_alone() -> None:
    async def test(s: Setup) -> None:
        s.pool.add("draft-static", "192.168.1.5:50062", IdleDraft())
        s.replicas.answering = {"10.0.0.1:50062": "draft-static", "10.0.0.2:50062": "draft-b"}
        s.resolver.addresses = set(s.replicas.answering)
        await s.discovery.refresh()
        # 10.0.0.1 answers with an id already in the pool: not added, and the replica in the pool is not touched.
        assert s.states() == {"192.168.1.5:50062": "draft-static serving", "10.0.0.2:50062": "draft-b serving"}
        s.resolver.addresses = set()
        await s.discovery.refresh()
        await until(lambda: s.pool.get("draft-b") is None)
        assert s.states() == {"192.168.1.5:50062": "draft-static serving"}

    run(test)


def test_a_replica_removed_by_the_admin_rejoins_while_its_address_resolves() -> None:
    async def test(s: Setup) -> None:
        s.replicas.answering = {"10.0.0.1:50062": "draft-a"}
        s.resolver.addresses = {"10.0.0.1:50062"}
        await s.discovery.refresh()
        replica = s.pool.get("draft-a")
        assert replica is not None
        assert await s.pool.drain(replica)  # what RemoveReplica does
        await s.discovery.refresh()
        assert s.states() == {"10.0.0.1:50062": "draft-a serving"}
        assert s.pool.get("draft-a") is not replica

    run(test)


def test_an_address_the_name_resolves_to_may_join_between_passes_as_the_discoverys_own() -> None:
    async def test(s: Setup) -> None:
        s.replicas.answering = {"10.0.0.1:50062": "draft-a", "10.0.0.9:50062": "draft-z"}
        s.resolver.addresses = {"10.0.0.1:50062"}
        assert await s.discovery.resolves_to("10.0.0.1:50062")  # AddReplica's allow rule for this source
        assert not await s.discovery.resolves_to("10.0.0.9:50062")  # answers, but the name does not give it
        assert not await s.discovery.resolves_to("10.0.0.1:50063")
        replica = await s.discovery.join_now("10.0.0.1:50062")
        assert replica is not None and replica is s.pool.get("draft-a")
        assert len(s.joins) == 1 and s.discovery.addresses == {"10.0.0.1:50062"}
        await s.discovery.refresh()  # the next pass finds it there: nothing joins twice
        assert s.states() == {"10.0.0.1:50062": "draft-a serving"} and len(s.joins) == 1
        s.resolver.addresses = set()
        await s.discovery.refresh()
        await until(lambda: s.pool.get("draft-a") is None)  # drained like any replica the name brought
        s.resolver.failing = True
        assert not await s.discovery.resolves_to("10.0.0.1:50062")  # no answer: not allowed
        s.resolver.failing = False
        s.resolver.addresses = {"10.0.0.2:50062"}
        assert await s.discovery.join_now("10.0.0.2:50062") is None  # it does not answer

    run(test)


def test_run_refreshes_until_cancelled() -> None:
    async def test(s: Setup) -> None:
        s.replicas.answering = {"10.0.0.1:50062": "draft-a"}
        task = asyncio.get_running_loop().create_task(s.discovery.run())
        await until(lambda: len(s.resolver.asked) >= 2)
        s.resolver.addresses = {"10.0.0.1:50062"}
        await until(lambda: s.pool.get("draft-a") is not None)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(test)


def test_the_system_resolver_finds_localhost() -> None:
    addresses = asyncio.run(DnsResolver().resolve("localhost", 50062))
    assert "127.0.0.1:50062" in addresses
    assert addresses <= {"127.0.0.1:50062", "[::1]:50062"}


def test_ipv6_addresses_are_bracketed() -> None:
    assert format_address("fd00::7", 50062) == "[fd00::7]:50062"
    assert format_address("10.0.0.7", 50062) == "10.0.0.7:50062"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("draft-headless.ns.svc:50062", ("draft-headless.ns.svc", 50062)),
        ("localhost:1", ("localhost", 1)),
        ("[::1]:50062", ("::1", 50062)),
    ],
)
def test_host_port_is_parsed(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("draft-headless", "'draft-headless': expected HOST:PORT"),
        (":50062", "':50062': expected HOST:PORT"),
        ("draft:http", "'draft:http': the port 'http' is not a number"),
        ("draft:70000", "'draft:70000': the port 70000 is outside 1..65535"),
        ("draft:0", "'draft:0': the port 0 is outside 1..65535"),
    ],
)
def test_a_bad_draft_dns_is_refused_naming_what_is_wrong(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError) as refused:
        parse_host_port(text)
    assert message in str(refused.value)
    arguments = ["orchestrator", "--target-address", "t:1", "--tokenizer", "tok", "--draft-dns", text]
    with pytest.raises(SystemExit):
        build_parser().parse_args(arguments)
    error = capsys.readouterr().err
    assert "--draft-dns" in error
    assert message in error


@pytest.mark.parametrize("interval", ["0", "-1", "nan"])
def test_a_draft_dns_interval_must_be_positive(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["orchestrator", "--target-address", "t:1", "--tokenizer", "tok", "--draft-dns-interval", interval]
    with pytest.raises(SystemExit):
        build_parser().parse_args(arguments)
    assert f"{interval}: must be a number of seconds above 0" in capsys.readouterr().err


def test_draft_dns_defaults_come_from_the_settings() -> None:
    arguments = ["orchestrator", "--target-address", "t:1", "--tokenizer", "tok", "--draft-dns", "d.ns.svc:50062"]
    args = build_parser().parse_args(arguments)
    assert args.draft_dns == ("d.ns.svc", 50062)
    assert args.draft_dns_interval == DiscoverySettings.interval_s
