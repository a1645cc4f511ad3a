"""The device flags resolved on this machine (tandem.devices), and the GPU bench refusing to run without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem import devices
from tandem.devices import (
    GPU_DEVICE_NODES,
    device_flag,
    pinned_host_copies,
    rank_device,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from tandem.errors import StartupError

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize("text", ["auto", "cpu", "cuda", "cuda:3"])
def test_device_flag_accepts(text: str) -> None:
    assert device_flag(text) == text


@pytest.mark.parametrize("text", ["gpu", "cpu:0", "cuda:", "cuda:x", "auto:1", ""])
def test_device_flag_refuses_naming_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match="is not one of auto, cpu, cuda, cuda:N"):
        device_flag(text)


@NO_CUDA
def test_auto_is_the_cpu_without_cuda() -> None:
    assert resolve_device("auto") == "cpu"
    assert resolve_device("auto", ranks=4) == "cpu"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_attention_backend("auto", "cpu", "float32") == "torch"


@pytest.mark.skipif(any(map(os.path.exists, GPU_DEVICE_NODES)), reason="this machine has a GPU device node")
def test_auto_without_any_gpu_device_node_needs_no_torch() -> None:
    # The launcher resolves --device auto for every child; torch's import would be about 1.4 s of its CPU.
    script = (
        "import sys; from tandem.devices import resolve_device; print(resolve_device('auto'), 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == ["cpu", "False"]


@pytest.mark.parametrize(("available", "expected"), [(False, "cpu"), (True, "cuda:0")])
def test_auto_with_a_gpu_device_node_asks_torch(
    monkeypatch: pytest.MonkeyPatch, available: bool, expected: str
) -> None:
    monkeypatch.setattr(devices, "_gpu_device_nodes", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == expected


@NO_CUDA
@pytest.mark.parametrize("text", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_a_startup_error(text: str) -> None:
    with pytest.raises(StartupError, match=f"--device {text}: CUDA is not available"):
        resolve_device(text)


def test_dtype_and_backend_follow_the_device() -> None:
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16"
    assert resolve_attention_backend("torch", "cuda:0", "bfloat16") == "torch"
    with pytest.raises(StartupError, match="runs on CUDA in bfloat16 or float16, not on cuda:0 in float32"):
        resolve_attention_backend("flashinfer", "cuda:0", "float32")
    with pytest.raises(StartupError, match="'xla' is not one of"):
        resolve_attention_backend("xla", "cpu", "float32")


def test_rank_devices_count_from_rank_zeros_gpu() -> None:
    assert [rank_device("cuda:2", rank) for rank in range(3)] == ["cuda:2", "cuda:3", "cuda:4"]
    assert rank_device("cpu", 1) == "cpu"


def test_host_tensors_are_not_copied() -> None:
    tensors = [torch.ones(2, 3, device="cpu"), torch.zeros(1, device="cpu")]
    copies = pinned_host_copies(tensors)
    assert all(copy is tensor for copy, tensor in zip(copies, tensors, strict=True))


@NO_CUDA
def test_gpu_bench_refuses_without_a_gpu() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stdout.strip() == "bench.gpu: needs a CUDA GPU; torch.cuda.is_available() is False on this machine"
