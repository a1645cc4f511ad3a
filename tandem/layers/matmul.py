"""y = x W^T + b for the few rows of a decoding step on the CPU, where PyTorch's own path is slow.

`F.linear` on a CPU float32 input of a few rows goes through the BLAS's x W^T with W transposed, and its kernels for
that case ran at 6-11 GB/s of weight on the 2-core development machine, where reading memory runs at 27 GB/s. The
product taken the other way round, (W x^T)^T, with two or more columns of x^T, ran 2-3 times faster; a single row
(one decoding token, one draft step) is duplicated to make two columns, which still beats the one-column product.
Measured per call, 2 intra-op threads, microseconds (F.linear / this):

| W (out x in) | 1 row | 2 rows | 6 rows | 16 rows | 64 rows | 192 rows |
|---|---|---|---|---|---|---|
| 3072 x 512 (gate/up) | 586 / 175 | 975 / 161 | 639 / 359 | 778 / 638 | 1621 / 1588 | 3828 / 3808 |
| 512 x 1536 (down) | 195 / 125 | 295 / 98 | 318 / 322 | 393 / 295 | 718 / 710 | 1711 / 1779 |
| 4096 x 512 (LM head) | 771 / 235 | 1489 / 263 | 923 / 475 | 1074 / 874 | 2193 / 2127 | 5223 / 5279 |

At 64 rows (8 requests verifying 7 tokens each fit) this path is still as fast or faster; past about 200 rows
F.linear is the faster, so only steps of at most FEW_ROWS rows take this path. Both are float32 products of the same
terms, summed in another order: results agree to float32 rounding (the parity tests with transformers hold), not bit
for bit. Other dtypes and devices (CUDA's GEMMs have no such gap) keep F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): [..., in] x [out, in] -> [..., out]."""
    rows = x.shape[0]
    if x.dim() != 2 or rows > FEW_ROWS or x.device.type != "cpu" or x.dtype != torch.float32 or rows == 0:
        return F.linear(x, weight, bias)
    columns = torch.cat((x, x)) if rows == 1 else x  # a single row goes in twice: [max(rows, 2), in]
    # [out, columns] -> [rows, out], made contiguous: the layers after it view and slice it by row.
    y = torch.mm(weight, columns.t()).t()[:rows].contiguous()
    return y + bias if bias is not None else y


class Linear(nn.Linear):
    """nn.Linear through `linear`; the same parameters and checkpoint names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
