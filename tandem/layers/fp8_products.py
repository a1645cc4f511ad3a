"""Products with block-wise fp8 weights on the GPU's fp8 tensor cores: torch._scaled_mm with DeepSeek's recipe.

A weight kept as DeepSeek-V3 and Kimi-K2 store it (fp8 e4m3 in 128 x 128 blocks, each with a float32 multiplier,
`weight_scale_inv`) is multiplied as it is: the activations are quantized to fp8 per token in groups of 128 columns
(a group's multiplier is its largest magnitude over 448, e4m3's largest value), and torch._scaled_mm (cuBLAS's block
scaling: CUDA 12.9 or later on compute capability 9.x) multiplies the two with both multipliers, accumulating in
float32 and writing the serving dtype. This is what SGLang and vLLM run for these checkpoints. Its output is not
the dequantized weight's product bit for bit (the activations are rounded to fp8); `--dequantize` keeps that path.

Where the kernel does not apply (the CPU, another GPU, another block, a width that is not whole blocks, a torch that
refuses the call) the weight is expanded per product instead (tandem.layers.matmul.stored_linear). `emulated` is the
same product in float32 from the same fp8 values, what the CPU tests check the quantization against and the CUDA
tests check the kernel against (tests/cuda, run by scripts/gpu-check.sh).
"""

from __future__ import annotations

import torch

GROUP = 128  # columns of an activation group and of a weight block, both ways
E4M3_MAX = 448.0
SCALED_MM_CAPABILITY = (9, 0)  # cuBLAS block scaling: Hopper-class GPUs


def applies(device: torch.device, block: tuple[int, int], shape: tuple[int, int]) -> bool:
    """Whether a [rows, columns] weight in `block` blocks on `device` is multiplied by `scaled_block_mm`."""
    if device.type != "cuda" or block != (GROUP, GROUP) or shape[0] % GROUP or shape[1] % GROUP:
        return False
    return torch.cuda.get_device_capability(device)[0] == SCALED_MM_CAPABILITY[0] and hasattr(torch, "_scaled_mm")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, columns] -> fp8 e4m3 [tokens, columns] and float32 multipliers [tokens, columns / 128], one per group
    of 128 columns: x ~ fp8 * multiplier. An all-zero group gets multiplier 1 (its values are 0 either way)."""
    tokens, columns = x.shape
    groups = x.float().view(tokens, columns // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1)
    multipliers = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    values = (groups / multipliers[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.view(tokens, columns), multipliers


def scaled_block_mm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [tokens, columns] @ weight^T for an fp8 [rows, columns] weight with [rows / 128, columns / 128] multipliers;
    -> [tokens, rows] in x's dtype, on the fp8 tensor cores."""
    values, multipliers = quantize_activations(x)
    # cuBLAS takes the activations' multipliers outer-dim major, and the weight as its transpose.
    multipliers = multipliers.t().contiguous().t()
    return torch._scaled_mm(values, weight.t(), scale_a=multipliers, scale_b=scale_inv.float().t(), out_dtype=x.dtype)


def emulated(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """What scaled_block_mm computes, in float32 from the same fp8 values (any device): -> [tokens, rows] float32."""
    values, multipliers = quantize_activations(x)
    activations = values.float() * multipliers.repeat_interleave(GROUP, dim=1)
    scales = scale_inv.float().repeat_interleave(GROUP, dim=0).repeat_interleave(GROUP, dim=1)
    return activations @ (weight.float() * scales[: weight.shape[0], : weight.shape[1]]).t()
