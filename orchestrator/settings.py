"""Settings of the orchestrator process; the CLI takes its defaults from these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.settings import TreeShape
from tandem.transport import Insecure, TransportSecurity


@dataclass(frozen=True)
class SchedulerSettings:
    num_steps: int = 5  # draft tokens per round; with adaptive_k, the most a round asks for
    tree: TreeShape = field(default_factory=TreeShape)  # the drafts' tree shape, resolved; topk 1: chains
    # Choose k (0 included) per batch from measured costs and acceptance (speculation.py); at k = 0 a batch's
    # requests leave their replica (Scheduler._pause_speculation). False: every round drafts num_steps.
    adaptive_k: bool = True
    max_num_seqs: int = 32  # requests running at once (each step carries at most these)
    # Tokens one target step computes: verification rows first, then prompt chunks (chunked prefill).
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024  # requests queued for admission; beyond, Generate answers RESOURCE_EXHAUSTED
    # Forward passes one target step may run when it decodes without drafts and nothing else waits (vLLM's name):
    # the hop to the target and the scheduling are paid once per this many tokens (orchestrator/batching.py).
    num_scheduler_steps: int = 4
    target_timeout_s: float = 300.0  # a target step or release that takes longer fails its requests
    draft_timeout_s: float = 10.0  # a Propose that takes longer costs its round's drafts and demotes the replica
    reprobe_s: float = 1.0  # first wait before a demoted replica is probed again (doubling, up to 30 s)
    stall_s: float = 60.0  # health reports NOT_SERVING when the loop has work and made no step for this long
    hybrid: HybridSettings | None = None  # --hybrid-ngram: prompt-lookup drafts merged into every replica's answer
    # In steps with at most this many drafting requests, ask their replicas to draft the next round as soon as the
    # target's rows arrive, while the target's answer and the next Propose travel (StepTask.draft_ahead); 0: never.
    # Larger batches lost on 2 cores: the batch drafted ahead competed with the orchestrator's work on their outputs.
    draft_ahead: int = 8
    # Replicas that can push (DraftInfo.pushes_drafts) send the drafts they made ahead to the target directly, and the
    # next round's item tells the target to verify them (StepTask.pushed_drafts): the drafts skip the orchestrator.
    push_drafts: bool = True

    @property
    def max_tree_drafts(self) -> int:
        """Drafts a round's tree may hold: --speculative-num-draft-tokens - 1, and with --hybrid-ngram the n-gram
        branch's at most num_steps more."""
        extra = self.num_steps if self.hybrid is not None else 0
        return self.tree.resolved(self.num_steps).max_drafts + extra


@dataclass(frozen=True)
class NgramSettings:
    """`--draft ngram`: prompt-lookup drafting in the orchestrator (orchestrator/ngram.py), with no draft model.

    The last n tokens of a request (n from max_n down to min_n) are looked up in its earlier tokens, and what followed
    the most recent match is proposed. Longer n first, as vLLM's prompt_lookup_max / prompt_lookup_min; min_n 1 as
    transformers' prompt lookup, which tries sizes from its max_matching_ngram_size (2) down to 1.
    """

    max_n: int = 4  # --ngram-max
    min_n: int = 1  # --ngram-min

    def __post_init__(self) -> None:
        if self.min_n < 1:
            raise ValueError(f"--ngram-min: {self.min_n}; the shortest suffix to look up is at least 1 token")
        if self.max_n < self.min_n:
            raise ValueError(f"--ngram-max: {self.max_n} is below --ngram-min {self.min_n}")


@dataclass(frozen=True)
class HybridSettings:
    """`--hybrid-ngram`: the prompt-lookup proposal merged into every draft replica's answer (orchestrator/hybrid.py).

    The lookup runs with `ngram`'s suffix lengths (--ngram-max, --ngram-min). The merged tree is the replica's answer
    whole plus the nodes of the lookup's branch it does not share: at most k (--speculative-num-steps) more drafts.
    Suffixes of at least 3 tokens by default: shorter ones verified more extra drafts per extra accepted token on the
    demo pair (docs/architecture.md, "Hybrid drafting").
    """

    ngram: NgramSettings = field(default_factory=lambda: NgramSettings(max_n=4, min_n=3))


@dataclass(frozen=True)
class DiscoverySettings:
    """Draft replicas found by DNS (`--draft-dns`): a Kubernetes headless Service has one address per ready pod."""

    host: str  # the name to resolve, e.g. draft-headless.default.svc
    port: int  # the replicas' gRPC port (DNS A/AAAA records carry none)
    interval_s: float = 5.0  # seconds between resolutions
    connect_timeout_s: float = 10.0  # a new address whose GetInfo does not answer in time is tried at the next one
    # The name each found replica's TLS certificate must hold (`--tls-server-name`): replicas are dialled by IP
    # address, while their certificate names the headless Service. None: the address dialled.
    tls_server_name: str | None = None


@dataclass(frozen=True)
class AdminSettings:
    """OrchestratorAdmin's own server: loopback by default, its own bearer token, bounded and allow-listed."""

    host: str = "127.0.0.1"  # a host other than loopback needs a token
    port: int = 50052  # 0: any free port (written to ready_file)
    ready_file: Path | None = None
    token: str | None = field(default=None, repr=False)  # `authorization: Bearer <token>` on every admin call
    max_draft_replicas: int = 8  # Scale above it is refused with INVALID_ARGUMENT
    # AddReplica dials only these ("host:port", or "host:*" for any port of host), besides the start-up addresses.
    allowed_draft_addresses: tuple[str, ...] = ()


def parse_host_port(text: str) -> tuple[str, int]:
    """ "host:port" or "[ipv6]:port" -> (host, port); ValueError naming what is wrong."""
    host, separator, port_text = text.rpartition(":")
    if not separator or not host:
        raise ValueError(f"{text!r}: expected HOST:PORT, e.g. tandem-draft-headless.default.svc:50062")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit():
        raise ValueError(f"{text!r}: the port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"{text!r}: the port {port} is outside 1..65535")
    return host, port


@dataclass(frozen=True)
class HttpSettings:
    """The OpenAI-compatible HTTP API and /metrics (orchestrator/http_api.py), on the gRPC host."""

    port: int | None = None  # None: no HTTP server; 0: any free port (written to ready_file)
    ready_file: Path | None = None  # gets its URL once it listens (https:// with the public port's TLS)
    # What /v1/chat/completions renders messages with when the tokenizer has no chat template (a Jinja file).
    chat_template: Path | None = None


@dataclass(frozen=True)
class OrchestratorSettings:
    target_address: str
    draft_addresses: Sequence[str]
    tokenizer_dir: Path
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    default_max_new_tokens: int = 128
    max_request_bytes: int = 4 * 1024 * 1024  # largest Generate request message on the public port
    scaler_address: str | None = None  # what starts and stops draft replicas (the `tandem serve` launcher)
    draft_discovery: DiscoverySettings | None = None  # follow a DNS name for draft replicas (beside draft_addresses)
    api_key: str | None = field(default=None, repr=False)  # Generate requires `authorization: Bearer <api_key>`
    admin: AdminSettings = field(default_factory=AdminSettings)
    internal_security: TransportSecurity = field(default_factory=Insecure)  # channels to target, drafts, scaler
    http: HttpSettings = field(default_factory=HttpSettings)
    served_model_name: str | None = None  # the model's name in the HTTP API and metrics; None: tokenizer_dir's name
    ngram: NgramSettings | None = None  # --draft ngram: draft here by prompt lookup (no draft_addresses with it)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.tokenizer_dir.resolve().name
