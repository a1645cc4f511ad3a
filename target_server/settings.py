"""Settings of a target process; the CLI's options of `tandem target` are their fields' (tandem.flags; no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.flags import checked, flag, nested, thread_count
from tandem.settings import KVCacheSettings, image_limit, metrics_port_field

# Images one prompt may hold unless --limit-mm-per-prompt says otherwise: none, so that a multimodal checkpoint's
# target loads no image tower unless asked.
IMAGES_PER_PROMPT = 0


@dataclass(frozen=True)
class TargetSettings:
    model_dir: Path = field(metadata=flag("--model", "the target model's directory (Hugging Face)", parse=Path))
    dtype: str = "float32"  # resolved (tandem.devices): the CLI's "auto" is bfloat16 on CUDA, float32 on the CPU
    device: str = "cpu"  # rank 0's device, resolved: "cpu" or "cuda:N" (rank r: cuda:N+r, tandem.devices.rank_device)
    max_context: int = field(
        default=0,
        metadata=flag("--max-context", "the longest request in tokens; 0: the model's max_position_embeddings"),
    )
    cache: KVCacheSettings = field(default_factory=KVCacheSettings, metadata=nested())
    tp: int = field(default=1, metadata=flag("--tp", "tensor-parallel ranks (target_server.ranks)"))
    threads: int = field(
        default=0,
        metadata=flag(
            "--threads",
            "intra-op (OpenMP) threads of each rank's model; 0: the cores this process may use, over --tp",
            parse=thread_count,
        ),
    )
    # Where the ranks meet ("host:port", rank 0 serves it). None: rank 0 picks a free loopback port and starts
    # ranks 1..tp-1 itself as child processes; given: someone else (the Ray launcher) starts them.
    rendezvous: str | None = None
    metrics_port: int | None = metrics_port_field()
    images: int = field(
        default=IMAGES_PER_PROMPT,
        metadata=flag(
            "--limit-mm-per-prompt",
            "JSON of the images one prompt may hold, e.g. '{\"image\": 2}', for a checkpoint whose image tower "
            "Tandem runs (Gemma 3); 0 (the default) serves its text model alone, with no tower loaded",
            parse=checked(image_limit),
            metavar="JSON",
        ),
    )
    dequantize: bool = field(
        default=False,
        metadata=flag(
            "--dequantize",
            "hold a quantized checkpoint's weights dequantized to --dtype instead of as stored (fp8 or INT4 with "
            "their scales, expanded before each product)",
        ),
    )
