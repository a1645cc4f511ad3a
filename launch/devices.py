"""The device flags of `serve`, `target` and `draft` (`--device`, `--dtype`, `--attention-backend`, `--cuda-graphs`),
resolved once.

The parser takes "auto" for each; `placement_of` turns the parsed flags into concrete names (tandem.devices) before
any settings are built, raising StartupError when the machine cannot do what was asked.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tandem.devices import (
    ATTENTION_BACKEND_NAMES,
    AUTO,
    DTYPES,
    device_flag,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from tandem.errors import StartupError
from tandem.settings import KVCacheSettings


@dataclass(frozen=True)
class Placement:
    """Resolved: where a service computes, in which dtype, with which attention backend."""

    device: str  # "cpu" or "cuda:N"
    dtype: str  # one of tandem.devices.DTYPES
    attention_backend: str  # "torch" or "flashinfer"
    cuda_graphs: bool = KVCacheSettings.cuda_graphs  # decode-shaped steps replayed from CUDA graphs


def _device(text: str) -> str:
    try:
        return device_flag(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--device: ")) from None


def add_device_options(parser: argparse.ArgumentParser, whose: str) -> None:
    parser.add_argument(
        "--device",
        type=_device,
        default=AUTO,
        help=f"where {whose} computes: auto (CUDA when available), cpu, cuda or cuda:N",
    )
    parser.add_argument(
        "--dtype", choices=(AUTO, *DTYPES), default=AUTO, help="auto: bfloat16 on CUDA, float32 on the CPU"
    )
    parser.add_argument(
        "--attention-backend",
        choices=(AUTO, *ATTENTION_BACKEND_NAMES),
        default=AUTO,
        help="auto: flashinfer on CUDA when installed (tandem[cuda]) and the dtype is 16-bit, else torch (SDPA)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=KVCacheSettings.cuda_graphs,
        help="replay decode and verification steps from CUDA graphs (CUDA, flashinfer, --tp 1; not yet run on a GPU)",
    )


def placement_of(args: argparse.Namespace, ranks: int = 1) -> Placement:
    """The resolved device, dtype and attention backend of the parsed flags; `ranks` GPUs are needed on CUDA."""
    device = resolve_device(args.device, ranks)
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_attention_backend(args.attention_backend, device, dtype)
    if args.cuda_graphs and backend != "flashinfer":
        raise StartupError(
            f"--cuda-graphs: graphs replay FlashInfer's attention on CUDA; this service runs on {device} with the"
            f" {backend} attention backend"
        )
    if args.cuda_graphs and ranks > 1:
        raise StartupError(f"--cuda-graphs: runs with --tp 1 only for now, not --tp {ranks}")
    return Placement(device, dtype, backend, args.cuda_graphs)
