"""The /metrics endpoint of a target or draft process (`--metrics-port`): prometheus_client's HTTP server, on a
thread of its own, serving one registry per process (no module-level state).

Both services report the same things under their role's name (`tandem:target_*`, `tandem:draft_*`): the time of
each model call (a target step, a draft Propose), its KV pool's usage, the requests it holds, and the calls queued
for its model thread. The gauges are read when /metrics is scraped, from the service's own counters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LOG = logging.getLogger(__name__)

# Seconds of one step or proposal: a few ms for a small batch, up to seconds for a long prefill.
CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class ServiceState:
    """What a service holds now."""

    kv_blocks_total: int
    kv_blocks_free: int
    running_requests: int
    pending_calls: int  # calls waiting for the model thread or running on it


class _Pool(Protocol):
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...


class _Runner(Protocol):
    """What both services' runners offer the metrics: their KV pool and the requests they hold."""

    @property
    def cache(self) -> _Pool: ...
    @property
    def requests(self) -> Sized: ...


class _Queue(Protocol):
    @property
    def pending(self) -> int: ...


def model_service_metrics(
    role: str, call: str, runner: _Runner, model_thread: _Queue, listeners: list[Callable[[float], None]]
) -> ServiceMetrics:
    """A service's metrics: `listeners` (the service's) report each model call's seconds; the gauges read `runner`
    and `model_thread` when scraped."""

    def state() -> ServiceState:
        cache = runner.cache
        return ServiceState(cache.num_blocks, cache.num_free_blocks, len(runner.requests), model_thread.pending)

    metrics = ServiceMetrics(role, call, state)
    listeners.append(metrics.observe_call)
    return metrics


class ServiceMetrics:
    """A target's or draft's metrics: `observe_call` after each model call; `state` is read at scrape time."""

    def __init__(self, role: str, call: str, state: Callable[[], ServiceState]) -> None:
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self.call_seconds = Histogram(
            f"tandem:{role}_{call}_seconds",
            f"Time the {role} spent computing one {call} (the whole batch)",
            registry=self.registry,
            buckets=CALL_BUCKETS,
        )
        self.registry.register(_StateCollector(role, state))

    def observe_call(self, seconds: float) -> None:
        self.call_seconds.observe(seconds)


class _StateCollector(Collector):
    def __init__(self, role: str, state: Callable[[], ServiceState]) -> None:
        self.role = role
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state = self.state()
        role = self.role
        used = (state.kv_blocks_total - state.kv_blocks_free) / state.kv_blocks_total if state.kv_blocks_total else 0.0
        yield GaugeMetricFamily(
            f"tandem:{role}_kv_cache_usage_perc", f"Fraction of the {role}'s KV blocks in use", used
        )
        yield GaugeMetricFamily(
            f"tandem:{role}_running_requests", f"Requests the {role} holds KV or state for", state.running_requests
        )
        yield GaugeMetricFamily(
            f"tandem:{role}_pending_calls",
            f"Calls waiting for the {role}'s model thread or running on it (its queue)",
            state.pending_calls,
        )


def serve_metrics(metrics: ServiceMetrics, host: str, port: int) -> tuple[WSGIServer, str]:
    """Serves metrics.registry on http://host:port/metrics (port 0: a free one); returns the server and its URL."""
    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{server.server_port}/metrics"
    LOG.info("%s metrics on %s", metrics.role, url)
    return server, url
