"""Session leases (tandem.leases) and KV pool sizing by memory (tandem.settings)."""

from __future__ import annotations

import pytest

from tandem.leases import SESSION_METADATA_KEY, Leases, session_of
from tandem.settings import KVCacheSettings, parse_size


def test_requests_of_a_session_expire_only_after_its_last_stream_closed_and_the_timeout_passed() -> None:
    leases = Leases(timeout_s=10.0)
    leases.stream_opened("a", now=0.0)
    leases.own("a", "r1", now=0.0)
    leases.own("a", "r2", now=1.0)
    assert leases.expired(now=100.0) == []  # the stream is still open
    leases.stream_closed("a", now=100.0)
    assert leases.expired(now=105.0) == []
    assert leases.expired(now=110.5) == ["r1", "r2"]
    assert leases.expired(now=200.0) == []  # forgotten once returned
    assert leases.owned() == 0


def test_a_reopened_stream_or_a_call_keeps_the_session() -> None:
    leases = Leases(timeout_s=10.0)
    leases.stream_opened("a", now=0.0)
    leases.own("a", "r1", now=0.0)
    leases.stream_closed("a", now=1.0)  # e.g. a call timed out and the orchestrator dropped its stream
    leases.stream_opened("a", now=5.0)
    assert leases.expired(now=50.0) == []
    leases.stream_closed("a", now=50.0)
    leases.seen("a", now=58.0)  # a unary call
    assert leases.expired(now=65.0) == []
    assert leases.expired(now=68.5) == ["r1"]


def test_released_requests_are_forgotten_and_a_restarted_orchestrator_does_not_keep_the_old_ones() -> None:
    leases = Leases(timeout_s=10.0)
    leases.stream_opened("old", now=0.0)
    leases.own("old", "r1", now=0.0)
    leases.own("old", "r2", now=0.0)
    leases.forget(["r1"])
    leases.stream_closed("old", now=1.0)  # the orchestrator died
    leases.stream_opened("new", now=2.0)  # and came back under a new session id
    leases.own("new", "r3", now=2.0)
    assert leases.expired(now=20.0) == ["r2"]
    assert leases.owned() == 1


def test_a_request_moves_to_the_last_session_that_touched_it_and_anonymous_callers_own_nothing() -> None:
    leases = Leases(timeout_s=10.0)
    leases.own("a", "r1", now=0.0)
    leases.own("b", "r1", now=0.0)
    leases.stream_opened("b", now=0.0)
    leases.own("", "r2", now=0.0)
    assert leases.expired(now=30.0) == []  # "a" is gone but r1 is b's now; r2 has no owner
    assert leases.owned() == 1


def test_a_claim_owns_only_a_request_nobody_owns() -> None:
    leases = Leases(timeout_s=10.0)
    assert leases.claim("a", "r1", now=0.0)
    assert not leases.claim("b", "r1", now=0.0)  # a's: a duplicate open from b must not take it
    assert not leases.claim("", "r2", now=0.0)
    assert (leases.owner("r1"), leases.owner("r2")) == ("a", "")
    leases.forget(["r1"])
    assert leases.owner("r1") == "" and leases.owned() == 0


def test_session_of_reads_the_metadata_key() -> None:
    assert session_of(((SESSION_METADATA_KEY, "abc"), ("user-agent", "x"))) == "abc"
    assert session_of((("user-agent", "x"),)) == ""
    assert session_of(None) == ""


@pytest.mark.parametrize(
    ("text", "size"),
    [("1048576", 1 << 20), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5G", 3 << 29), ("64k", 64 << 10)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1MiB", "0"])
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_memory_sizes_the_pool_in_whole_blocks() -> None:
    assert KVCacheSettings(num_blocks=7).blocks_for(1000) == 7
    assert KVCacheSettings(num_blocks=7, memory_bytes=10_500).blocks_for(1000) == 10
    with pytest.raises(ValueError, match="do not hold one KV block"):
        KVCacheSettings(memory_bytes=999).blocks_for(1000)
