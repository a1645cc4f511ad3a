"""Settings of a draft replica process; the CLI takes its defaults from these (no torch import here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tandem.models.aux_layers import Convention
from tandem.settings import KVCacheSettings, TreeShape
from tandem.transport import Insecure, TransportSecurity

# DeepSeek NextN reused for several steps: what a step hands to the next, the layer's shared_head.norm output
# (SGLang) or its pre-norm stream (vLLM).
MTPFeedback = Literal["post_norm", "pre_norm"]
MTP_FEEDBACKS: tuple[MTPFeedback, ...] = ("post_norm", "pre_norm")
# Multi-layer MTP: layer k consumes layer k - 1's output ("chain", Step-3.5) or the target's hidden too.
MTPMode = Literal["chain", "independent"]
MTP_MODES: tuple[MTPMode, ...] = ("chain", "independent")


@dataclass(frozen=True)
class DraftSettings:
    model_dir: Path
    target_address: str
    replica_id: str
    num_steps: int = 5
    tree: TreeShape = field(default_factory=TreeShape)  # resolved against num_steps; topk 1: chains
    aux_layer_convention: Convention = "auto"
    cache: KVCacheSettings = field(default_factory=KVCacheSettings)
    dtype: str = "float32"  # resolved (tandem.devices): the CLI's "auto" is bfloat16 on CUDA, float32 on the CPU
    device: str = "cpu"  # resolved: "cpu" or "cuda:N"
    threads: int = 0  # intra-op (OpenMP) threads of the model; 0: PyTorch's default (one per core it may use)
    rows_timeout_s: float = 60.0  # how long Propose waits for the target's rows of a round
    rows_ttl_s: float = 120.0  # rows nobody asked for (finished requests) are dropped after this
    mtp_feedback: MTPFeedback = "post_norm"
    mtp_mode: MTPMode = "chain"
    target_security: TransportSecurity = field(default_factory=Insecure)  # the channel to the target
    metrics_port: int | None = None  # serve Prometheus /metrics on this port (0: a free one); None: no endpoint
