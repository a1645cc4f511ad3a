"""Settings of `tandem serve`, and the settings of the services it starts: one mapping for both launchers.

The process launcher writes each service's settings as its command line (tandem.flags.arguments_of); the Ray
launcher hands them to its actors as they are. Both get them from the methods here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from draft_server.settings import DraftSettings, ImageEmbeddings, MTPFeedback, MTPMode
from launch.stack_security import ServeSecurity
from orchestrator.settings import (
    AdminSettings,
    HttpSettings,
    NgramSettings,
    OrchestratorSettings,
    SchedulerSettings,
    check_ngram_kinds,
)
from tandem.flags import flag, flag_of, keepalive_seconds, nested, optional, thread_count
from tandem.grpc_util import KEEPALIVE_HELP, KEEPALIVE_TIMEOUT_S
from tandem.models.aux_layers import Convention
from tandem.settings import KVCacheSettings
from target_server.settings import TargetSettings

LAUNCHERS = ("process", "ray")


@dataclass(frozen=True)
class ServeSettings:
    """The whole stack; refuses, on construction, flags that do not fit together (the messages name them)."""

    target_dir: Path  # resolved: --target, or the bundled demo target
    draft_dir: Path | None  # resolved from --draft; None: no draft process (target-only, or ngram)
    # `--draft ngram` (the command's --draft): the orchestrator drafts by prompt lookup (draft_dir is None).
    ngram: NgramSettings | None = field(default=None, metadata=optional(NgramSettings, "--draft ngram"))
    draft_replicas: int = field(default=1, metadata=flag("--draft-replicas", "draft replicas to start"))
    host: str = field(default="127.0.0.1", metadata=flag("--host", "interface of the public port"))
    port: int = field(default=50051, metadata=flag("--port", "the public (Generate) port; 0 picks a free one"))
    # The orchestrator's: draft steps, tree shape, batching limits, timeouts, --hybrid-ngram. Drafts take its
    # num_steps and tree too.
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings, metadata=nested())
    aux_layer_convention: Convention = field(
        default=DraftSettings.aux_layer_convention, metadata=flag_of(DraftSettings, "aux_layer_convention")
    )
    dtype: str = "float32"  # resolved, as device (tandem.devices)
    device: str = "cpu"  # target rank 0's and every draft replica's: "cpu" or "cuda:N"
    cache: KVCacheSettings = field(default_factory=KVCacheSettings, metadata=nested())  # the target's, each replica's
    launcher: str = field(
        default="process", metadata=flag("--launcher", "child processes, or Ray actors", choices=LAUNCHERS)
    )
    # The Ray cluster to join; None: start a local one.
    ray_address: str | None = field(
        default=None, metadata=flag("--ray-address", "Ray cluster to join (with --launcher ray); default: a local one")
    )
    tp: int = field(
        default=TargetSettings.tp, metadata=flag_of(TargetSettings, "tp")
    )  # the target's tensor-parallel ranks
    dequantize: bool = field(default=TargetSettings.dequantize, metadata=flag_of(TargetSettings, "dequantize"))
    images: int = field(default=TargetSettings.images, metadata=flag_of(TargetSettings, "images"))
    allowed_media_domains: tuple[str, ...] = field(
        default=HttpSettings.allowed_media_domains, metadata=flag_of(HttpSettings, "allowed_media_domains")
    )
    allowed_local_media_path: Path | None = field(
        default=HttpSettings.allowed_local_media_path, metadata=flag_of(HttpSettings, "allowed_local_media_path")
    )
    target_threads: int = field(
        default=TargetSettings.threads,
        metadata=flag(
            "--target-threads",
            "intra-op (OpenMP) threads of each target rank's model; 0: the cores, over --tp",
            parse=thread_count,
        ),
    )
    draft_threads: int = field(
        default=DraftSettings.threads,
        metadata=flag(
            "--draft-threads",
            "intra-op (OpenMP) threads of each draft replica's model; 0: the cores",
            parse=thread_count,
        ),
    )
    mtp_feedback: MTPFeedback = field(
        default=DraftSettings.mtp_feedback, metadata=flag_of(DraftSettings, "mtp_feedback")
    )
    mtp_mode: MTPMode = field(default=DraftSettings.mtp_mode, metadata=flag_of(DraftSettings, "mtp_mode"))
    image_embeddings: ImageEmbeddings = field(
        default=DraftSettings.image_embeddings, metadata=flag_of(DraftSettings, "image_embeddings")
    )
    security: ServeSecurity = field(default_factory=ServeSecurity, metadata=nested())  # API key, admin port, TLS
    # Every service's (and the launcher's) --keepalive-timeout.
    keepalive_timeout_s: float = field(
        default=KEEPALIVE_TIMEOUT_S, metadata=flag("--keepalive-timeout", KEEPALIVE_HELP, parse=keepalive_seconds)
    )
    # The orchestrator's OpenAI-compatible HTTP API and /metrics; 0: a free port; None: off.
    http_port: int | None = field(
        default=0,
        metadata=flag(
            "--http-port",
            "port of the OpenAI-compatible HTTP API and /metrics, HTTPS when the public port serves TLS (0: a free "
            "port, printed)",
            parse=int,
            off="--no-http",
            off_help="serve gRPC only",
        ),
    )
    chat_template: Path | None = field(
        default=HttpSettings.chat_template, metadata=flag_of(HttpSettings, "chat_template")
    )
    served_model_name: str | None = field(
        default=OrchestratorSettings.served_model_name, metadata=flag_of(OrchestratorSettings, "served_model_name")
    )  # None: the target's name
    shutdown_timeout_s: float = field(
        default=OrchestratorSettings.shutdown_timeout_s, metadata=flag_of(OrchestratorSettings, "shutdown_timeout_s")
    )

    def __post_init__(self) -> None:
        check_ngram_kinds(self.ngram, self.scheduler.hybrid)
        if self.ngram is not None and self.draft_replicas != ServeSettings.draft_replicas:
            raise ValueError("--draft ngram drafts in the orchestrator and starts no --draft-replicas")
        if self.scheduler.hybrid is not None and self.draft_dir is None:
            raise ValueError("--hybrid-ngram merges n-gram drafts into a draft model's: give --draft DIR")
        if self.draft_replicas > self.security.max_draft_replicas:
            raise ValueError(f"--draft-replicas {self.draft_replicas} is above --max-draft-replicas")
        if self.launcher != "ray":
            if self.ray_address is not None:
                raise ValueError("--ray-address needs --launcher ray")
            if self.security.tls_server_name is not None:
                raise ValueError(
                    "--tls-server-name needs --launcher ray: the process launcher's services are on loopback, where "
                    "the certificate names 127.0.0.1"
                )
        elif self.device != "cpu":
            raise ValueError(f"--launcher ray: places services on CPUs only for now, not {self.device}")

    def target_settings(self, rendezvous: str | None = None) -> TargetSettings:
        """The target's; `rendezvous` where its ranks meet when someone else starts them (the Ray launcher)."""
        return TargetSettings(
            model_dir=self.target_dir,
            dtype=self.dtype,
            device=self.device,
            cache=self.cache,
            tp=self.tp,
            dequantize=self.dequantize,
            images=self.images,
            threads=self.target_threads,
            rendezvous=rendezvous,
        )

    def draft_settings(self, replica_id: str, target_address: str) -> DraftSettings:
        assert self.draft_dir is not None
        return DraftSettings(
            model_dir=self.draft_dir,
            target_address=target_address,
            replica_id=replica_id,
            num_steps=self.scheduler.num_steps,
            tree=self.scheduler.tree,
            aux_layer_convention=self.aux_layer_convention,
            cache=self.cache,
            dtype=self.dtype,
            device=self.device,
            threads=self.draft_threads,
            mtp_feedback=self.mtp_feedback,
            mtp_mode=self.mtp_mode,
            image_embeddings=self.image_embeddings,
        )

    def admin_settings(self, ready_file: Path | None = None, allowed: Sequence[str] = ()) -> AdminSettings:
        """The orchestrator's admin port, on loopback; `allowed`: addresses AddReplica may dial."""
        return AdminSettings(
            port=self.security.admin_port,
            ready_file=ready_file,
            token=self.security.admin_token,
            max_draft_replicas=self.security.max_draft_replicas,
            allowed_draft_addresses=tuple(allowed),
        )

    def orchestrator_settings(
        self,
        target_address: str,
        draft_addresses: Sequence[str],
        admin: AdminSettings,
        http_ready_file: Path,
        scaler_address: str | None = None,
    ) -> OrchestratorSettings:
        return OrchestratorSettings(
            target_address=target_address,
            draft_addresses=tuple(draft_addresses),
            tokenizer_dir=self.target_dir,
            scheduler=self.scheduler,
            scaler_address=scaler_address,
            api_key=self.security.api_key,
            admin=admin,
            http=HttpSettings(
                self.http_port,
                http_ready_file if self.http_port is not None else None,
                self.chat_template,
                allowed_media_domains=self.allowed_media_domains,
                allowed_local_media_path=self.allowed_local_media_path,
            ),
            served_model_name=self.served_model_name,
            ngram=self.ngram,
            shutdown_timeout_s=self.shutdown_timeout_s,
        )
