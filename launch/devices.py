"""The device flags of `serve`, `target` and `draft` (tandem.devices.DeviceRequest), resolved once.

The parser takes "auto" for each; `placement_of` turns the request into concrete names (tandem.devices) before any
settings are built, raising StartupError when the machine cannot do what was asked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.devices import DeviceRequest, resolve_attention_backend, resolve_device, resolve_dtype
from tandem.errors import StartupError
from tandem.settings import KVCacheSettings


@dataclass(frozen=True)
class Placement:
    """Resolved: where a service computes, in which dtype, with which attention backend."""

    device: str  # "cpu" or "cuda:N"
    dtype: str  # one of tandem.devices.DTYPES
    attention_backend: str  # "torch" or "flashinfer"
    cuda_graphs: bool = KVCacheSettings.cuda_graphs  # decode-shaped steps replayed from CUDA graphs

    def cache(self, cache: KVCacheSettings) -> KVCacheSettings:
        """`cache` with this placement's attention backend and CUDA graphs."""
        return replace(cache, attention_backend=self.attention_backend, cuda_graphs=self.cuda_graphs)


def placement_of(request: DeviceRequest, ranks: int = 1) -> Placement:
    """The resolved device, dtype and attention backend of the request; `ranks` GPUs are needed on CUDA."""
    device = resolve_device(request.device, ranks)
    dtype = resolve_dtype(request.dtype, device)
    backend = resolve_attention_backend(request.attention_backend, device, dtype)
    if request.cuda_graphs and backend != "flashinfer":
        raise StartupError(
            f"--cuda-graphs: graphs replay FlashInfer's attention on CUDA; this service runs on {device} with the"
            f" {backend} attention backend"
        )
    if request.cuda_graphs and ranks > 1:
        raise StartupError(f"--cuda-graphs: runs with --tp 1 only for now, not --tp {ranks}")
    return Placement(device, dtype, backend, request.cuda_graphs)
