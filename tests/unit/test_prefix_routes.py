"""Placement by prefix: the blocks an orchestrator sent each replica, and the replica a request goes to."""

from __future__ import annotations

from orchestrator.peers.prefix_routes import IMBALANCE, PrefixRoutes
from orchestrator.peers.replicas import ReplicaPool
from tests.unit.test_discovery import IdleDraft

PROMPT = list(range(40))


def test_routes_count_the_leading_blocks_a_replica_was_sent() -> None:
    routes = PrefixRoutes(block_size=16)
    routes.record("a", routes.names(PROMPT[:33], ""))
    assert routes.matched("a", routes.names(PROMPT, "")) == 2
    assert routes.matched("a", routes.names([99, *PROMPT[1:]], "")) == 0  # a change renames every later block
    assert routes.matched("a", routes.names(PROMPT, "tenant")) == 0
    assert routes.matched("b", routes.names(PROMPT, "")) == 0
    routes.forget("a")
    assert routes.matched("a", routes.names(PROMPT, "")) == 0


def test_a_request_goes_where_its_prefix_is_unless_that_replica_is_overloaded() -> None:
    pool = ReplicaPool()
    for replica_id in ("a", "b"):
        pool.add(replica_id, replica_id, IdleDraft())
    routes = PrefixRoutes(block_size=16)
    routes.record("b", routes.names(PROMPT, ""))
    names = routes.names(PROMPT, "")
    assert pool.pick() == "a"  # least outstanding, the first on a tie
    for _ in range(IMBALANCE):
        pool.acquire("b")
    assert pool.pick(lambda replica_id: routes.matched(replica_id, names)) == "b"
    pool.acquire("b")
    assert pool.pick(lambda replica_id: routes.matched(replica_id, names)) == "a"
