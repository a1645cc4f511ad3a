"""Settings of the orchestrator process; `tandem orchestrator`'s options are their fields' (tandem.flags)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.api.tool_formats import TOOL_CALL_FORMATS
from tandem.flags import (
    checked,
    flag,
    nested,
    non_negative,
    non_negative_seconds,
    optional,
    positive,
    positive_seconds,
)
from tandem.settings import TreeShape, parse_size
from tandem.transport import Insecure, TransportSecurity


@dataclass(frozen=True)
class NgramSettings:
    """`--draft ngram`: prompt-lookup drafting in the orchestrator (orchestrator/loop/ngram.py), with no draft model.

    The last n tokens of a request (n from max_n down to min_n) are looked up in its earlier tokens, and what followed
    the most recent match is proposed. Longer n first, as vLLM's prompt_lookup_max / prompt_lookup_min; min_n 1 as
    transformers' prompt lookup, which tries sizes from its max_matching_ngram_size (2) down to 1.
    """

    max_n: int = field(
        default=4, metadata=flag("--ngram-max", "the longest suffix looked up, tried first", parse=positive)
    )
    min_n: int = field(default=1, metadata=flag("--ngram-min", "the shortest suffix looked up", parse=positive))

    def __post_init__(self) -> None:
        if self.min_n < 1:
            raise ValueError(f"--ngram-min: {self.min_n}; the shortest suffix to look up is at least 1 token")
        if self.max_n < self.min_n:
            raise ValueError(f"--ngram-max: {self.max_n} is below --ngram-min {self.min_n}")


@dataclass(frozen=True)
class HybridSettings:
    """`--hybrid-ngram`: the prompt-lookup proposal merged into every draft replica's answer
    (orchestrator/loop/hybrid.py).

    The lookup runs with `ngram`'s suffix lengths (--ngram-max, --ngram-min). The merged tree is the replica's answer
    whole plus the nodes of the lookup's branch it does not share: at most k (--speculative-num-steps) more drafts.
    Suffixes of at least 3 tokens by default: shorter ones verified more extra drafts per extra accepted token on the
    demo pair (docs/drafting.md, "Hybrid drafting").
    """

    ngram: NgramSettings = field(default_factory=lambda: NgramSettings(max_n=4, min_n=3), metadata=nested())


def check_ngram_kinds(ngram: NgramSettings | None, hybrid: HybridSettings | None) -> None:
    """Refuses n-gram drafting in the orchestrator beside n-gram drafts merged into a draft model's: settings that
    hold both (--draft ngram and --hybrid-ngram, which share --ngram-max and --ngram-min) call this."""
    if ngram is not None and hybrid is not None:
        raise ValueError("--hybrid-ngram merges n-gram drafts into a draft model's; --draft ngram has none")


@dataclass(frozen=True)
class SchedulerSettings:
    num_steps: int = field(
        default=5,
        metadata=flag(
            "--speculative-num-steps", "draft tokens per round; with --adaptive-k, the most a round asks for"
        ),
    )
    # The drafts' tree shape, resolved against num_steps on construction; topk 1: chains.
    tree: TreeShape = field(default_factory=TreeShape, metadata=nested())
    # Choose k (0 included) per batch from measured costs and acceptance (speculation.py); at k = 0 a batch's
    # requests leave their replica (Scheduler._pause_speculation). False: every round drafts num_steps.
    adaptive_k: bool = field(
        default=True,
        metadata=flag(
            "--adaptive-k",
            "choose k (0 included) per batch from measured round costs and acceptance, at most "
            "--speculative-num-steps; at k = 0 a batch's requests decode target-only (--no-adaptive-k always drafts "
            "--speculative-num-steps tokens)",
        ),
    )
    # Each step carries at most these.
    max_num_seqs: int = field(default=32, metadata=flag("--max-num-seqs", "requests running at once", parse=positive))
    # Chunked prefill: verification rows first, then prompt chunks.
    max_num_batched_tokens: int = field(
        default=2048,
        metadata=flag(
            "--max-num-batched-tokens",
            "tokens one target step computes: verification rows first, then prompt chunks",
            parse=positive,
        ),
    )
    # Beyond, Generate answers RESOURCE_EXHAUSTED.
    max_waiting: int = field(
        default=1024, metadata=flag("--max-waiting", "queued requests before refusing", parse=positive)
    )
    # vLLM's name: the hop to the target and the scheduling are paid once per this many tokens
    # (orchestrator/loop/batching.py).
    num_scheduler_steps: int = field(
        default=4,
        metadata=flag(
            "--num-scheduler-steps",
            "forward passes one target step may run when its requests decode without drafts and nothing else waits "
            "(1: one token per step)",
            parse=positive,
        ),
    )
    # A target step or release that takes longer counts as a target that stopped answering
    # (orchestrator/peers/recovery.py).
    target_timeout_s: float = field(default=300.0, metadata=flag("--target-timeout", "seconds per target step"))
    # How long requests wait for a target that stopped answering, or is restarting, before they fail.
    target_wait_s: float = field(
        default=60.0,
        metadata=flag(
            "--target-wait",
            "seconds requests wait for a target that stopped answering or restarts, then start over on it (longer: "
            "they fail with UNAVAILABLE)",
        ),
    )
    # A Propose that takes longer costs its round's drafts and demotes the replica.
    draft_timeout_s: float = field(default=10.0, metadata=flag("--draft-timeout", "seconds per Propose"))
    # A demoted replica is probed again after 1 s (or this, if shorter), the wait doubling up to this.
    reprobe_max_s: float = field(
        default=30.0,
        metadata=flag(
            "--reprobe-max-interval",
            "the longest wait in seconds between probes of a demoted draft replica (the first is 1 s, or this if "
            "shorter; the wait doubles up to this)",
            parse=positive_seconds,
        ),
    )
    # Health reports NOT_SERVING when the loop has held work this long (since it arrived, or since the last step)
    # without finishing a step.
    stall_s: float = field(
        default=60.0,
        metadata=flag(
            "--stall-timeout",
            "seconds the loop may hold work without finishing a step before health reports NOT_SERVING",
            parse=positive_seconds,
        ),
    )
    hybrid: HybridSettings | None = field(
        default=None,
        metadata=optional(
            HybridSettings,
            "--hybrid-ngram",
            "merge the prompt-lookup proposal into every draft model's answer as one more branch "
            "(--ngram-max / --ngram-min apply)",
        ),
    )
    # In steps with at most this many drafting requests, ask their replicas to draft the next round as soon as the
    # target's rows arrive, while the target's answer and the next Propose travel (StepItem.draft_ahead); 0: never.
    # Larger batches lost on 2 cores: the batch drafted ahead competed with the orchestrator's work on their outputs.
    draft_ahead: int = field(
        default=8,
        metadata=flag(
            "--draft-ahead",
            "in steps with at most N drafting requests, draft replicas draft a request's next round as soon as the "
            "target's hidden rows reach them, before the orchestrator asks (0: only when asked)",
            parse=non_negative,
            metavar="N",
        ),
    )

    def __post_init__(self) -> None:
        # The tree shape is checked against num_steps, and N filled in, once: ValueError names the flags.
        object.__setattr__(self, "tree", self.tree.resolved(self.num_steps))

    @property
    def max_tree_drafts(self) -> int:
        """Drafts a round's tree may hold: --speculative-num-draft-tokens - 1, and with --hybrid-ngram the n-gram
        branch's at most num_steps more."""
        extra = self.num_steps if self.hybrid is not None else 0
        return self.tree.max_drafts + extra


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

    # A host other than loopback needs a token.
    host: str = field(
        default="127.0.0.1", metadata=flag("--admin-host", "interface of the admin port (loopback by default)")
    )
    # 0: any free port (written to ready_file).
    port: int = field(default=50052, metadata=flag("--admin-port", "port of OrchestratorAdmin (0 picks a free one)"))
    ready_file: Path | None = field(
        default=None, metadata=flag("--admin-ready-file", "write the admin port's bound host:port here", parse=Path)
    )
    token: str | None = field(default=None, repr=False)  # `authorization: Bearer <token>` on every admin call
    # Scale above it is refused with INVALID_ARGUMENT.
    max_draft_replicas: int = field(
        default=8,
        metadata=flag("--max-draft-replicas", "the most draft replicas Scale may ask for", parse=non_negative),
    )
    # AddReplica dials only these ("host:port", or "host:*" for any port of host), besides the start-up addresses.
    allowed_draft_addresses: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--allow-draft-address",
            "HOST:PORT (or HOST:*) that AddReplica may dial, besides --draft-address; repeat per entry",
            repeat=True,
        ),
    )


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
    """The OpenAI-compatible HTTP API and /metrics (orchestrator/api/http_api.py), on the gRPC host."""

    # None: no HTTP server; 0: any free port (written to ready_file).
    port: int | None = field(
        default=None,
        metadata=flag(
            "--http-port",
            "serve the OpenAI-compatible HTTP API and /metrics here (0: free), HTTPS with --tls-cert/--tls-key unless "
            "--public-plaintext",
            parse=int,
        ),
    )
    # Gets its URL once it listens (https:// with the public port's TLS).
    ready_file: Path | None = field(
        default=None, metadata=flag("--http-ready-file", "write the HTTP API's URL here once it listens", parse=Path)
    )
    # What /v1/chat/completions renders messages with when the tokenizer has no chat template (a Jinja file).
    chat_template: Path | None = field(
        default=None,
        metadata=flag(
            "--chat-template",
            "Jinja chat template for /v1/chat/completions when the tokenizer has none (demo target: bundled)",
            parse=Path,
        ),
    )
    # The tool-call format of chat replies (orchestrator/api/tool_formats.py); auto: the one the chat template writes.
    tool_call_parser: str = field(
        default="auto",
        metadata=flag(
            "--tool-call-parser",
            "how the model writes tool calls; auto: found in the chat template",
            choices=("auto", *TOOL_CALL_FORMATS),
        ),
    )
    # Hosts whose http(s) image URLs chat requests may name (public addresses only: orchestrator/api/media.py).
    allowed_media_domains: tuple[str, ...] = field(
        default=(),
        metadata=flag("--allowed-media-domains", "hosts whose http(s) image URLs are fetched", count="+"),
    )
    # The directory file:// image URLs may name; None: file:// refused.
    allowed_local_media_path: Path | None = field(
        default=None,
        metadata=flag("--allowed-local-media-path", "directory whose files file:// image URLs may name", parse=Path),
    )


@dataclass(frozen=True)
class OrchestratorSettings:
    target_address: str = field(metadata=flag("--target-address", "host:port of the target service"))
    draft_addresses: Sequence[str] = field(metadata=flag("--draft-address", "repeat per replica", repeat=True))
    tokenizer_dir: Path = field(metadata=flag("--tokenizer", "directory with tokenizer files", parse=Path))
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings, metadata=nested())
    default_max_new_tokens: int = field(
        default=128, metadata=flag("--default-max-new-tokens", "a request's token budget when it gives none")
    )
    # Largest Generate request message on the public port.
    max_request_bytes: int = field(
        default=4 * 1024 * 1024,
        metadata=flag(
            "--max-request-bytes",
            "largest Generate request message accepted, e.g. 4MiB (larger: RESOURCE_EXHAUSTED)",
            parse=checked(parse_size),
        ),
    )
    # What starts and stops draft replicas (the `tandem serve` launcher).
    scaler_address: str | None = field(
        default=None, metadata=flag("--scaler-address", "the launcher that starts and stops draft replicas")
    )
    # Follow a DNS name for draft replicas (beside draft_addresses); the command's --draft-dns gives it.
    draft_discovery: DiscoverySettings | None = None
    api_key: str | None = field(default=None, repr=False)  # Generate requires `authorization: Bearer <api_key>`
    admin: AdminSettings = field(default_factory=AdminSettings, metadata=nested())
    internal_security: TransportSecurity = field(default_factory=Insecure)  # channels to target, drafts, scaler
    http: HttpSettings = field(default_factory=HttpSettings, metadata=nested())
    # None: tokenizer_dir's name.
    served_model_name: str | None = field(
        default=None,
        metadata=flag("--served-model-name", "the model's name in the HTTP API and metrics (default: its dir)"),
    )
    # Draft here by prompt lookup (no draft_addresses with it); `--draft ngram` is the command's.
    ngram: NgramSettings | None = field(default=None, metadata=optional(NgramSettings, "--draft ngram"))
    shutdown_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "--shutdown-timeout",
            "seconds the streams in flight may take to finish after SIGTERM (new requests are refused meanwhile); "
            "those still running then end with UNAVAILABLE",
            parse=non_negative_seconds,
        ),
    )

    def __post_init__(self) -> None:
        check_ngram_kinds(self.ngram, self.scheduler.hybrid)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.tokenizer_dir.resolve().name
