"""Where a service computes: the `--device` and `--dtype` flags, resolved once before settings are frozen.

`--device` is `auto` (CUDA when torch sees a GPU, else the CPU), `cpu`, `cuda` (GPU 0) or `cuda:N`. Settings hold the
resolved form, "cpu" or "cuda:N". Target rank r of a tensor-parallel target computes on GPU N + r (N: the resolved
index, so `cuda` puts ranks 0..tp-1 on GPUs 0..tp-1). `--dtype auto` is bfloat16 on CUDA and float32 on the CPU.
`--attention-backend auto` is FlashInfer on CUDA when it imports and the dtype is a 16-bit one, else torch (SDPA).

Asking for CUDA where there is none is a StartupError with one line naming the flag; nothing falls back silently.
The flags are the options of DeviceRequest (tandem.flags), parsed torch-free (the CLI builds its parser without
torch); resolving imports torch, except `auto` on a machine with no GPU device at all. Settings hold the resolved
values and have no device options of their own: a launcher hands a child its resolved values as a request
(DeviceRequest.of), which resolves to itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.errors import StartupError
from tandem.flags import flag
from tandem.settings import KVCacheSettings

if TYPE_CHECKING:
    import torch

AUTO = "auto"
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKEND_NAMES = ("torch", "flashinfer")
_DEVICE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def device_flag(text: str) -> str:
    """The argparse type of `--device`: auto, cpu, cuda or cuda:N; raises ValueError naming the accepted forms."""
    match = _DEVICE.match(text.strip())
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise ValueError(f"--device: {text!r} is not one of auto, cpu, cuda, cuda:N")
    return text.strip()


def device_option(text: str) -> str:
    """device_flag as argparse's type: the message follows argparse's own "argument --device:"."""
    try:
        return device_flag(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--device: ")) from None


@dataclass(frozen=True)
class DeviceRequest:
    """What the device flags ask for, before it is resolved against the machine (launch.devices.placement_of)."""

    device: str = field(
        default=AUTO,
        metadata=flag(
            "--device",
            "where the model computes: auto (CUDA when available), cpu, cuda or cuda:N (a tensor-parallel target's "
            "rank r: GPU N + r)",
            parse=device_option,
        ),
    )
    dtype: str = field(
        default=AUTO,
        metadata=flag("--dtype", "auto: bfloat16 on CUDA, float32 on the CPU", choices=(AUTO, *DTYPES)),
    )
    attention_backend: str = field(
        default=AUTO,
        metadata=flag(
            "--attention-backend",
            "auto: flashinfer on CUDA when installed (tandem[cuda]) and the dtype is 16-bit, else torch (SDPA)",
            choices=(AUTO, *ATTENTION_BACKEND_NAMES),
        ),
    )
    cuda_graphs: bool = field(
        default=KVCacheSettings.cuda_graphs,
        metadata=flag(
            "--cuda-graphs",
            "replay decode and verification steps from CUDA graphs (CUDA, flashinfer, --tp 1; not yet run on a GPU)",
        ),
    )

    @staticmethod
    def of(device: str, dtype: str, cache: KVCacheSettings) -> DeviceRequest:
        """The request of settings' resolved values: what a launcher gives a child, which resolves to the same."""
        return DeviceRequest(device, dtype, cache.attention_backend or AUTO, cache.cuda_graphs)


def resolve_device(requested: str, ranks: int = 1) -> str:
    """The device ("cpu" or "cuda:N") for `requested` (see device_flag), checked against the GPUs this process sees.

    `ranks` GPUs are needed from N on (a tensor-parallel target puts rank r on GPU N + r).
    """
    requested = device_flag(requested)
    if requested == "cpu" or (requested == AUTO and not _gpu_device_nodes()):
        return "cpu"
    import torch

    if requested == AUTO and not torch.cuda.is_available():
        return "cpu"
    if not torch.cuda.is_available():
        raise StartupError(
            f"--device {requested}: CUDA is not available to this process (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu or auto"
        )
    index = int(requested.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index + ranks > count:
        need = f"GPUs {index}..{index + ranks - 1}" if ranks > 1 else f"GPU {index}"
        raise StartupError(f"--device {requested}: needs {need}, this process sees {count} GPU(s)")
    return f"cuda:{index}"


# What a GPU driver puts in /dev or /proc (NVIDIA, NVIDIA under WSL, AMD's ROCm); none of them: no torch build sees
# a GPU. Checked before `import torch`, which costs a launcher that computes nothing about 1.4 s of CPU.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def _gpu_device_nodes() -> bool:
    return any(os.path.exists(path) for path in GPU_DEVICE_NODES)


def resolve_dtype(requested: str, device: str) -> str:
    """The dtype name for `requested` ("auto": bfloat16 on CUDA, float32 on the CPU) on a resolved device."""
    if requested == AUTO:
        return "bfloat16" if device.startswith("cuda") else "float32"
    if requested not in DTYPES:
        raise StartupError(f"--dtype: {requested!r} is not one of auto, {', '.join(DTYPES)}")
    return requested


def flashinfer_installed() -> bool:
    """Whether the optional FlashInfer package (the `tandem[cuda]` extra) can be imported; does not import it."""
    return importlib.util.find_spec("flashinfer") is not None


def resolve_attention_backend(requested: str, device: str, dtype: str) -> str:
    """The backend ("torch" or "flashinfer") for `requested` on a resolved device and dtype; refuses what cannot
    run there."""
    fits_flashinfer = device.startswith("cuda") and dtype in ("bfloat16", "float16")
    if requested == AUTO:
        return "flashinfer" if fits_flashinfer and flashinfer_installed() else "torch"
    if requested not in ATTENTION_BACKEND_NAMES:
        raise StartupError(f"--attention-backend: {requested!r} is not one of auto, torch, flashinfer")
    if requested == "flashinfer":
        if not fits_flashinfer:
            raise StartupError(
                f"--attention-backend flashinfer: runs on CUDA in bfloat16 or float16, not on {device} in {dtype}"
            )
        if not flashinfer_installed():
            raise StartupError(
                "--attention-backend flashinfer: the flashinfer package is not installed (pip install 'tandem[cuda]')"
            )
    return requested


def rank_device(device: str, rank: int) -> str:
    """The device of target rank `rank` when rank 0 computes on `device` (resolved): GPU N + rank, or the CPU."""
    if device == "cpu":
        return device
    return f"cuda:{int(device.partition(':')[2] or 0) + rank}"


def pinned_host_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of device tensors in page-locked host memory, made with one wait for the device; CPU tensors come back
    as they are (nothing to copy). The target's captured rows of a step go on the wire from the host this way."""
    import torch

    if all(tensor.device.type == "cpu" for tensor in tensors):
        return list(tensors)
    copies = []
    for tensor in tensors:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        copies.append(host)
    torch.cuda.current_stream(tensors[0].device).synchronize()  # the one wait: every copy above is queued on it
    return copies
