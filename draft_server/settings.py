"""Settings of a draft replica process; `tandem draft`'s options are their fields' (tandem.flags; no torch)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tandem.flags import flag, nested, thread_count
from tandem.models.aux_layers import CONVENTIONS, Convention
from tandem.settings import KVCacheSettings, TreeShape, metrics_port_field
from tandem.transport import Insecure, TransportSecurity

# What an MTP step hands to the next: the layer's shared_head.norm output or its pre-norm stream (for chained MTP,
# also what the target hands layer 0: its hidden after or before the final norm). "auto": the family's authors'
# serving code (SGLang): post_norm for DeepSeek NextN (vLLM: pre_norm), pre_norm for Step-3.5's chained layers
# (transformers' generate(use_mtp=True): post_norm). Resolved when the checkpoint is read (draft_server.formats).
MTPFeedback = Literal["auto", "post_norm", "pre_norm"]
MTP_FEEDBACKS: tuple[MTPFeedback, ...] = ("auto", "post_norm", "pre_norm")
# Multi-layer MTP: layer k consumes layer k - 1's output ("chain", Step-3.5) or the target's hidden too.
MTPMode = Literal["chain", "independent"]
MTP_MODES: tuple[MTPMode, ...] = ("chain", "independent")
# The input embedding an EAGLE3 or NextN draft takes at an image's tokens (draft_server.image_inputs).
ImageEmbeddings = Literal["checkpoint", "placeholder", "merged"]
IMAGE_EMBEDDINGS: tuple[ImageEmbeddings, ...] = ("checkpoint", "placeholder", "merged")


def default_replica_id() -> str:
    """A name no other replica has: this machine's and this process's."""
    return f"draft-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class DraftSettings:
    model_dir: Path = field(metadata=flag("--model", "the draft model's directory", parse=Path))
    target_address: str = field(metadata=flag("--target-address", "host:port of the target service"))
    replica_id: str = field(
        default_factory=default_replica_id, metadata=flag("--replica-id", "this replica's name for the orchestrator")
    )
    num_steps: int = field(default=5, metadata=flag("--speculative-num-steps", "draft tokens per round"))
    # Resolved against num_steps on construction; topk 1: chains.
    tree: TreeShape = field(default_factory=TreeShape, metadata=nested())
    aux_layer_convention: Convention = field(
        default="auto",
        metadata=flag(
            "--aux-layer-convention",
            "how an EAGLE3 config's layer ids name target layers: output (id + 1), input (as they are), auto",
            choices=CONVENTIONS,
        ),
    )
    cache: KVCacheSettings = field(default_factory=KVCacheSettings, metadata=nested())
    dtype: str = "float32"  # resolved (tandem.devices): the CLI's "auto" is bfloat16 on CUDA, float32 on the CPU
    device: str = "cpu"  # resolved: "cpu" or "cuda:N"
    threads: int = field(
        default=0,
        metadata=flag(
            "--threads",
            "intra-op (OpenMP) threads of the draft model; 0: PyTorch's default (one per core this process may use)",
            parse=thread_count,
        ),
    )
    rows_timeout_s: float = 60.0  # how long Propose waits for the target's rows of a round
    rows_ttl_s: float = 120.0  # rows nobody asked for (finished requests) are dropped after this
    mtp_feedback: MTPFeedback = field(
        default="auto",
        metadata=flag(
            "--mtp-feedback",
            "MTP drafts: what one step hands to the next, post_norm or pre_norm; auto: as the family's authors' "
            "serving code (DeepSeek NextN post_norm, Step-3.5 pre_norm)",
            choices=MTP_FEEDBACKS,
        ),
    )
    mtp_mode: MTPMode = field(
        default="chain",
        metadata=flag(
            "--mtp-mode",
            "multi-layer MTP drafts: layer k reads layer k-1's output (chain) or the target's hidden",
            choices=MTP_MODES,
        ),
    )
    image_embeddings: ImageEmbeddings = field(
        default="checkpoint",
        metadata=flag(
            "--image-embeddings",
            "EAGLE3 and NextN drafts: the input embedding of an image's tokens, the placeholder token's (as vLLM) or "
            "the target's merged one, the image's features (as SGLang); checkpoint: the EAGLE3 config's "
            "image_embeddings, else placeholder",
            choices=IMAGE_EMBEDDINGS,
        ),
    )
    target_security: TransportSecurity = field(default_factory=Insecure)  # the channel to the target
    metrics_port: int | None = metrics_port_field()

    def __post_init__(self) -> None:
        # The tree shape is checked against num_steps, and N filled in, once: ValueError names the flags.
        object.__setattr__(self, "tree", self.tree.resolved(self.num_steps))
