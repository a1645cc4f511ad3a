"""Prometheus metrics of the orchestrator under vLLM's names and meanings, plus the `tandem:` ones of a split system.

Every metric lives in one CollectorRegistry owned by `Metrics` (no module-level state). Request metrics are fed once
per request, when it ends, from the statistics the scheduler already keeps for it (orchestrator/loop/output.py); the
gauges and the scheduler's own counters are read from the scheduler when /metrics is scraped, on the event loop
that runs the scheduler, so they see a consistent state.

Speculative decoding, as vLLM defines it: a draft is one round of one request that verified at least one draft
token; mean acceptance length = 1 + num_accepted_tokens / num_drafts.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orchestrator.loop.acceptance import AcceptanceMonitor, AcceptanceWatch
from orchestrator.loop.output import RequestOutput
from orchestrator.loop.scheduler import Scheduler

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets in seconds: first token and whole requests span milliseconds to minutes; tokens come tens of ms apart.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PROPOSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class Metrics:
    """The orchestrator's metrics; `render()` gives the Prometheus text exposition."""

    def __init__(self, scheduler: Scheduler, model_name: str, watch: AcceptanceWatch | None = None) -> None:
        self.model_name = model_name
        self.acceptance = AcceptanceMonitor(watch or AcceptanceWatch())
        self.registry = CollectorRegistry(auto_describe=True)
        self._define_request_metrics()
        self._define_speculation_metrics()
        scheduler.proposer.listeners.append(self.observe_propose)
        self.registry.register(SchedulerCollector(scheduler, self))

    def _counter(self, name: str, documentation: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, documentation, ["model_name", *extra], registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, documentation, ["model_name"], registry=self.registry, buckets=buckets)

    def _define_request_metrics(self) -> None:
        """What vLLM users already query of a request's life."""
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens of requests that ended")
        self.generation_tokens = self._counter(
            "vllm:generation_tokens", "Tokens generated for requests that ended, as their usage counts them"
        )
        self.request_success = self._counter(
            "vllm:request_success",
            "Requests that ended, by finished_reason: stop (EOS, stop string or stop token), length, abort "
            "(the client went away), error",
            ("finished_reason",),
        )
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds", "From arrival to the first token", FIRST_TOKEN_BUCKETS
        )
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Between consecutive outputs of a request (one output carries every token one round commits)",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e_request_latency = self._histogram(
            "vllm:e2e_request_latency_seconds", "From arrival to the last token", REQUEST_BUCKETS
        )
        self.prefix_cache_queries = self._counter(
            "vllm:prefix_cache_queries", "Prompt tokens of prefilled requests that ended, looked up in the prefix cache"
        )
        self.prefix_cache_hits = self._counter(
            "vllm:prefix_cache_hits", "Prompt tokens whose KV the target took from its prefix cache"
        )
        self.request_queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "From arrival to the first admission into the batch", REQUEST_BUCKETS
        )

    def _define_speculation_metrics(self) -> None:
        """Drafts and acceptance, by vLLM's names, and Tandem's rounds and Propose calls."""
        self.num_drafts = self._counter("vllm:spec_decode_num_drafts", "Rounds that verified at least one draft token")
        self.num_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = self._counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_position = self._counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Rounds in which the draft token at this position (0-based) was accepted",
            ("position",),
        )
        self.rounds = self._counter("tandem:rounds", "Draft/verify rounds, counted per request")
        self.round_seconds = self._counter(
            "tandem:round_seconds",
            "Time of the rounds of requests that ended, by part: draft (replica compute the round waited for), verify "
            "(target compute), wire (the rest of the Propose/Step calls) and scheduling (the orchestrator's own work); "
            "drafted_ahead (replica compute done before the Propose, off the round's path) is beside them; a round "
            "is counted in full for every request in it, so part / tandem:rounds is the mean per round",
            ("part",),
        )
        self.propose_seconds = Histogram(
            "tandem:propose_seconds",
            "Wall time of one Propose call to a draft replica (its whole batch), by replica",
            ["model_name", "replica"],
            registry=self.registry,
            buckets=PROPOSE_BUCKETS,
        )

    def observe_propose(self, replica: str, seconds: float) -> None:
        self.propose_seconds.labels(self.model_name, replica).observe(seconds)

    def observe(self, output: RequestOutput, finished_reason: str) -> None:
        """Counts a request that ended: finished_reason is its finish reason as the OpenAI API names it, "abort" or
        "error"."""
        stats = output.stats
        name = self.model_name
        self.prompt_tokens.labels(name).inc(output.prompt_tokens)
        self.generation_tokens.labels(name).inc(output.completion_tokens)
        self.request_success.labels(name, finished_reason).inc()
        if output.generated:
            self.prefix_cache_queries.labels(name).inc(output.prompt_tokens)
            self.prefix_cache_hits.labels(name).inc(stats.cached_tokens)
        self.num_drafts.labels(name).inc(stats.draft_rounds)
        self.num_draft_tokens.labels(name).inc(stats.draft_tokens)
        self.num_accepted_tokens.labels(name).inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_per_position.labels(name, str(position)).inc(count)
        if output.last_message is not None:
            self.time_to_first_token.labels(name).observe(stats.first_token_seconds)
        for seconds in stats.inter_token_seconds:
            self.inter_token_latency.labels(name).observe(seconds)
        if output.scheduled:
            self.request_queue_time.labels(name).observe(stats.queue_seconds)
        if finished_reason in ("stop", "length"):
            self.e2e_request_latency.labels(name).observe(stats.total_seconds)
        self.rounds.labels(name).inc(stats.rounds)
        for part, seconds in (
            ("draft", stats.draft_seconds),
            ("verify", stats.verify_seconds),
            ("wire", stats.wire_seconds),
            ("scheduling", stats.scheduling_seconds),
            ("drafted_ahead", stats.draft_ahead_seconds),
        ):
            self.round_seconds.labels(name, part).inc(seconds)
        self.acceptance.add(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SchedulerCollector(Collector):
    """What the scheduler knows now: queue lengths, KV usage, replicas, replica failures."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        scheduler = self.scheduler
        name = self.metrics.model_name

        def gauge(metric: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, documentation, labels=["model_name"])
            family.add_metric([name], value)
            return family

        def counter(metric: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, documentation, labels=["model_name"])
            family.add_metric([name], value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch", len(scheduler.running))
        yield gauge("vllm:num_requests_waiting", "Requests waiting for admission", len(scheduler.waiting))
        pool = scheduler.facts.pool
        used = sum(pool.blocks(request.kv_length) for request in scheduler.running.values())
        yield gauge(
            "vllm:kv_cache_usage_perc", "Fraction of the target's KV blocks in use (1 = full)", used / pool.num_blocks
        )
        yield gauge(
            "tandem:k_in_use",
            "Draft tokens per round the scheduler asks for now (the adaptive choice, or --speculative-num-steps)",
            scheduler.k_in_use,
        )
        yield gauge(
            "tandem:acceptance_collapsed",
            "1 when the mean acceptance length of the last interval fell to about 1.0 (see the orchestrator's log)",
            float(self.metrics.acceptance.collapsed),
        )
        yield counter(
            "tandem:replica_failures",
            "Draft replica demotions (failed, timed out or sent bad drafts)",
            scheduler.placement.replica_failures,
        )
        yield counter(
            "tandem:request_reassigns",
            "Requests moved off a demoted draft replica, to another replica or to target-only",
            scheduler.placement.requests_moved,
        )
        yield counter(
            "tandem:speculation_paused",
            "Requests taken off (or started without) a draft replica to decode target-only: adaptive k at 0 for their "
            "batch size, or for their class",
            scheduler.placement.requests_paused,
        )
        replicas = GaugeMetricFamily("tandem:draft_replicas", "Draft replicas by state", labels=["model_name", "state"])
        states = [replica.state for replica in scheduler.replicas.all()]
        for state in ("serving", "draining", "demoted"):
            replicas.add_metric([name, state], states.count(state))
        yield replicas
        outstanding = GaugeMetricFamily(
            "tandem:replica_requests", "Requests assigned to each draft replica", labels=["model_name", "replica"]
        )
        for replica in scheduler.replicas.all():
            outstanding.add_metric([name, replica.replica_id], replica.outstanding)
        yield outstanding
        yield from self._draft_prefixes(name)
        yield from self._adaptive_k(name)

    def _draft_prefixes(self, name: str) -> Iterator[Metric]:
        """Tokens of draft context the replicas were asked to take from their own prefix caches, and found."""
        proposer = self.scheduler.proposer
        for metric, documentation, value in (
            (
                "tandem:draft_prefix_cache_queries",
                "Tokens of draft context replicas had to take from their own prefix caches (the target skipped them)",
                proposer.prefix_queried,
            ),
            (
                "tandem:draft_prefix_cache_hits",
                "Tokens of draft context replicas reused from their prefix caches (a miss is replayed, counting 0)",
                proposer.prefix_cached,
            ),
        ):
            family = CounterMetricFamily(metric, documentation, labels=["model_name"])
            family.add_metric([name], value)
            yield family

    def _adaptive_k(self, name: str) -> Iterator[Metric]:
        """The deepest k each measured batch size settled on, how often it changed, and the rounds by k and class."""
        policy = self.scheduler.speculation
        settled = GaugeMetricFamily(
            "tandem:k_settled",
            "The deepest k adaptive k settled on for rounds of this many decoding requests (batch_size: the top of a "
            "bucket 1, 2, 4, 8, ...); the orchestrator's log has a line for each change",
            labels=["model_name", "batch_size"],
        )
        changes = CounterMetricFamily(
            "tandem:k_changes", "Changes of a batch size's settled k", labels=["model_name", "batch_size"]
        )
        for size, k in sorted(policy.current.items()):
            settled.add_metric([name, str(size)], k)
            changes.add_metric([name, str(size)], policy.changes.get(size, 0))
        yield settled
        yield changes
        lengths = CounterMetricFamily(
            "tandem:draft_length_rounds",
            "Decoding rounds by the k chosen for the request (orchestrator/loop/draft_length.py) and its class: free "
            "text, grammar (structured output) or penalties (and logit bias)",
            labels=["model_name", "request_class", "k"],
        )
        for (request_class, k), rounds in sorted(policy.rounds.items()):
            lengths.add_metric([name, request_class, str(k)], rounds)
        yield lengths
        cuts = CounterMetricFamily(
            "tandem:drafts_cut_by_confidence",
            "Drafts proposed but not verified: their drafter's confidence (DSpark's) said they would not pay for "
            "their rows (orchestrator/loop/confidence.py)",
            labels=["model_name"],
        )
        cuts.add_metric([name], policy.confidence_cuts)
        yield cuts
