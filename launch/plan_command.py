"""`tandem plan`'s flags (`PlanRequest`). The plan itself runs in launch.plan_report, imported only when the command
runs: it needs torch (each rank's model is built on the meta device), which the parser does without.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from tandem import flags
from tandem.devices import AUTO, DeviceRequest
from tandem.flags import checked, flag, flag_of, positive
from tandem.settings import KVCacheSettings, parse_size
from target_server.settings import TargetSettings

PLAN_DEVICES = (AUTO, "cpu", "cuda")


@dataclass(frozen=True)
class PlanRequest:
    """What `tandem plan` is asked: a checkpoint, a tp, and each rank's memory and dtype."""

    target: Path = field(
        metadata=flag(
            "--target", "the target model's directory (Hugging Face): config.json and *.safetensors", parse=Path
        )
    )
    tp: int = field(default=TargetSettings.tp, metadata=flag("--tp", "tensor-parallel ranks", parse=positive))
    device: str = field(
        default=AUTO,
        metadata=flag(
            "--device",
            "what each rank computes on, for the default memory and dtype: auto (cuda when torch sees a GPU), cpu, "
            "cuda",
            choices=PLAN_DEVICES,
        ),
    )
    dtype: str = field(default=DeviceRequest.dtype, metadata=flag_of(DeviceRequest, "dtype"))
    memory_bytes: int | None = field(
        default=None,
        metadata=flag(
            "--gpu-memory-bytes",
            "memory of each rank, e.g. 141e9 or 80GiB; default: on cuda GPU 0's total memory (required when torch "
            "sees no GPU), on cpu the machine's available memory over --tp",
            parse=checked(parse_size),
        ),
    )
    block_size: int = field(default=KVCacheSettings.block_size, metadata=flag_of(KVCacheSettings, "block_size"))
    dequantize: bool = field(
        default=False,
        metadata=flag(
            "--dequantize",
            "judge the fit with quantized weights dequantized to --dtype (what the target holds with --dequantize) "
            "instead of kept as stored",
        ),
    )


def add_plan_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "plan", help="whether a target fits: weights and KV per tensor-parallel rank, from the checkpoint's headers"
    )
    flags.add_options(parser, PlanRequest)
