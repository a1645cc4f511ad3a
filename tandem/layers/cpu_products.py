"""Products with weights kept as stored on the CPU, fused: each row of the weight is expanded into a small buffer and
multiplied while it is in the L1 cache, never written out as a float matrix.

Expanding a whole run of rows with torch's own ops (tandem.layers.stored.StoredWeight.chunks) takes five passes over
memory per value and the float32 product a sixth: half the `--dequantize` path's decode speed on the development
machine. These kernels, compiled by Numba (LLVM, vectorized), read the stored bytes once. For a few rows of
activations (decode, verification of a few drafts: up to MAX_ROWS) the fp8 one outruns the float32 product of the
dequantized weight, which waits on memory for four bytes a value (docs/benchmarks.md, "Quantized weights on the CPU");
larger products (prefill) expand and multiply by oneDNN as before.

They run in parallel on Numba's OpenMP layer, with as many threads as torch runs (the layer's start sets its own
count for the process's OpenMP, which is put back), or on the calling thread where that layer cannot start. Numba's
own thread pool was slower beside torch's spinning OpenMP threads: a 6-layer DeepSeek-V3-shaped fp8 target at 2
threads decoded at 0.86x of --dequantize with it, 1.07x on one thread and 1.42x on the OpenMP layer. Numba caches
the compiled kernels beside this file (or in NUMBA_CACHE_DIR); a process without the cache compiles them at its first
product, a few seconds (the target does it at load: tandem.models.registry). Importers import this module where they
use it: Numba's own import takes most of a second.

- block-wise fp8 (`fp8_product`): an e4m3 code's bits moved into a float32 (sign to bit 31, exponent and mantissa to
  bits 20-26) read the code's value times 2 ** -120, exactly, subnormal codes included (they become float32
  subnormals, which an Intel core may multiply slower). Within a block of rows the scale only changes with the
  column block, so the activations are scaled instead of the weight: x[c] * scale[block, c // bw] * 2 ** 60, one
  value per column for the whole block; each sum is multiplied by 2 ** 60 at the end. The powers of two keep every
  product a normal float32 for any activation and scale a checkpoint holds.
- group-wise INT4 (`int4_product`): each nibble minus 8 times its group's scale, the dequantized value exactly; the
  activations' even and odd columns go apart, so that a byte's two nibbles meet their columns without a shuffle.
  Groups of a power of two columns (every release's: 32 for Kimi-K2.5), so that a byte finds its scale by a shift.

Sums are in float32 in another order than a BLAS's (`fastmath` reassociation, so that they vectorize): results agree
with the dequantized weight's product to float32 rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numba
import numpy as np
import torch
import torch.nn.functional as F

MAX_ROWS = 8  # activation rows up to which the fused kernels beat expanding the weight and multiplying by oneDNN
RAISE = np.float32(2.0**60)  # on the scaled activations; the products come out 2 ** -60 of the true ones
BITS_OF_CODE = np.int32(-0x78100000)  # 0x87F00000: sign, exponent and mantissa bits of a code shifted by 20
NUMBA_CONFIG: Any = numba.config  # its settings are set at import, unknown to a type checker
INT4_RUN = 64  # rows of an INT4 weight one thread takes at a time
SUMS = {"reassoc", "contract"}  # the LLVM flags that let a float32 sum vectorize; no other fast-math liberty


def applies(x: torch.Tensor) -> bool:
    """Whether a product of `x` ([rows, in]) with a stored weight runs here: float32 on the CPU, few rows."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS


def int4_applies(group: int) -> bool:
    """Whether `int4_product` takes INT4 groups of `group` columns: a power of two, at least a byte's two."""
    return group >= 2 and group & (group - 1) == 0


def fp8_product(x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [rows, in] float32 @ W^T for block-wise fp8 codes [out, in] with float32 multipliers [ceil(out / bh),
    ceil(in / bw)]; -> [rows, out] float32."""
    out = torch.empty((x.shape[0], codes.shape[0]), dtype=torch.float32)
    _kernel(_fp8_rows)(
        _array(x), _array(codes.view(torch.int8)), _array(scale_inv.float()), block[0], block[1], out.numpy()
    )
    return out


def int4_product(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, in] float32 @ W^T for compressed-tensors INT4 (words [out, ceil(in / 8)] int32, scales [out,
    ceil(in / group)]); -> [rows, out] float32."""
    assert int4_applies(group), f"an INT4 group of {group}: not a power of two"
    stored_bytes = packed.view(torch.uint8)
    # The activations' even and odd columns apart, zeros past the last column (a partial last word's padding).
    padded = x.new_zeros((x.shape[0], 2 * stored_bytes.shape[1]))
    padded[:, : x.shape[1]] = x
    out = torch.empty((x.shape[0], packed.shape[0]), dtype=torch.float32)
    even, odd = _array(padded[:, 0::2]), _array(padded[:, 1::2])
    # Scales for the padding's groups too (zeros), so that every byte's group is there to read.
    groups = -(-padded.shape[1] // group)
    scale = F.pad(scale.float(), (0, groups - scale.shape[1]))
    shift = (group // 2).bit_length() - 1  # a byte's group: byte >> shift
    _kernel(_int4_rows)(even, odd, _array(stored_bytes), _array(scale), shift, out.numpy())
    return out


def warm() -> None:
    """Compiles both kernels now (or loads them from Numba's cache), so that no request waits for it."""
    fp8_product(torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (1, 1))
    int4_product(torch.zeros(1, 2), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), 2)


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().numpy()


def _kernel(kernel: Callable[..., None]) -> Callable[..., None]:
    """The kernel compiled for this process's threads, with as many as torch runs where they are torch's."""
    parallel = _on_torchs_threads()
    if parallel:
        numba.set_num_threads(max(1, min(torch.get_num_threads(), NUMBA_CONFIG.NUMBA_NUM_THREADS)))
    return _compiled(kernel, parallel)


@cache
def _compiled(kernel: Callable[..., None], parallel: bool) -> Callable[..., None]:
    compiled: Callable[..., None]
    try:
        compiled = numba.njit(fastmath=SUMS, cache=True, parallel=parallel)(kernel)
    except RuntimeError:  # nowhere writable for Numba's cache (a read-only install, no home): compiled every start
        compiled = numba.njit(fastmath=SUMS, parallel=parallel)(kernel)
    return compiled


@cache
def _on_torchs_threads() -> bool:
    """Starts Numba's OpenMP layer, keeping torch's thread count; False where it cannot start."""
    threads = torch.get_num_threads()
    NUMBA_CONFIG.THREADING_LAYER = "omp"
    try:
        numba.set_num_threads(min(threads, NUMBA_CONFIG.NUMBA_NUM_THREADS))  # starts the layer
    except ValueError:  # no OpenMP runtime for it to load
        return False
    finally:
        torch.set_num_threads(threads)
    return True


def _fp8_rows(x: Any, codes: Any, scales: Any, block_rows: int, block_columns: int, out: Any) -> None:
    tokens, columns = x.shape
    rows = codes.shape[0]
    for row_block in numba.prange(scales.shape[0]):
        scaled = np.empty((tokens, columns), np.float32)
        for token in range(tokens):
            for column in range(columns):
                scaled[token, column] = x[token, column] * scales[row_block, column // block_columns] * RAISE
        bits = np.empty(columns, np.int32)
        values = bits.view(np.float32)
        for row in range(row_block * block_rows, min(rows, (row_block + 1) * block_rows)):
            for column in range(columns):
                bits[column] = (np.int32(codes[row, column]) << 20) & BITS_OF_CODE
            for token in range(tokens):
                total = np.float32(0.0)
                for column in range(columns):
                    total += values[column] * scaled[token, column]
                out[token, row] = total * RAISE


def _int4_rows(even: Any, odd: Any, stored_bytes: Any, scales: Any, shift: int, out: Any) -> None:
    tokens, width = even.shape  # width: the bytes of a row, each two columns
    rows = stored_bytes.shape[0]
    for run in numba.prange(-(-rows // INT4_RUN)):
        low = np.empty(width, np.float32)  # columns 2b (low nibbles) and 2b + 1 (high ones) of byte b
        high = np.empty(width, np.float32)
        for row in range(run * INT4_RUN, min(rows, (run + 1) * INT4_RUN)):
            for byte in range(width):
                value = np.int32(stored_bytes[row, byte])
                scale = scales[row, byte >> shift]
                low[byte] = np.float32((value & 15) - 8) * scale
                high[byte] = np.float32((value >> 4) - 8) * scale
            for token in range(tokens):
                total = np.float32(0.0)
                for byte in range(width):
                    total += low[byte] * even[token, byte] + high[byte] * odd[token, byte]
                out[token, row] = total
