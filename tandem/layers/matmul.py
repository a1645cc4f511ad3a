"""y = x W^T + b on the CPU in float32, by the fastest of three routes for the shape, where PyTorch's own is slow.

`F.linear` on a CPU float32 input goes through the BLAS's x W^T with W transposed. On the 2-core development machine
(AMD EPYC, AVX-512) its kernels for a few rows ran at 6-11 GB/s of weight where reading memory runs at 27-32 GB/s,
and past a few rows they lose to oneDNN's inner product too. So `linear` takes one of:
- `few`: the product taken the other way round, (W x^T)^T, a single row fed in twice (two columns beat one);
- `onednn`: oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`, the kernel TorchInductor's CPU backend
  calls for a linear layer) on the plain weight;
- `F.linear` itself where neither applies (other dtypes and devices, inputs that are not [rows, in], autograd, a
  PyTorch built without oneDNN).
Measured per call on cold caches (each weight read once per pass, as a forward pass reads a model bigger than the
caches), 2 intra-op threads, microseconds, F.linear / few / onednn:

| W (out x in) | 1 row | 2 rows | 6 rows | 7 rows |
|---|---|---|---|---|
| 1536 x 512 (q/k/v) | 315 / 126 / 151 | 446 / 104 / 182 | 316 / 211 / 251 | 600 / 302 / 251 |
| 3072 x 512 (gate/up) | 585 / 208 / 247 | 988 / 199 / 387 | 1156 / 464 / 471 | 1356 / 589 / 487 |
| 512 x 1536 (down) | 196 / 113 / 99 | 309 / 105 / 142 | 329 / 326 / 183 | 385 / 373 / 181 |
| 4096 x 512 (LM head) | 787 / 254 / 329 | 1408 / 248 / 507 | 1665 / 592 / 606 | 1988 / 742 / 619 |

| W (out x in) | 48 rows | 192 rows | 2048 rows |
|---|---|---|---|
| 1536 x 512 (q/k/v) | 904 / 689 / 564 | 2346 / 2277 / 1554 | 16461 / 30635 / 15357 |
| 3072 x 512 (gate/up) | 1801 / 1409 / 1078 | 4542 / 4432 / 3085 | 34442 / 61250 / 32254 |
| 512 x 1536 (down) | 683 / 585 / 466 | 1957 / 1885 / 1475 | 16656 / 21329 / 15299 |
| 4096 x 512 (LM head) | 2339 / 1835 / 1415 | 6136 / 6196 / 4153 | 50478 / 56827 / 45541 |

Hence the rule (`route`): `few` up to 2 rows, and up to FEW_ROWS_WIDE rows for a weight at least as tall as it is
wide; `onednn` for everything larger. All three are float32 products of the same terms summed in another order:
results agree to float32 rounding (the parity tests with transformers hold), not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# `few` takes at most this many rows of a weight with out >= in (a wider one goes to oneDNN from 3 rows on).
FEW_ROWS_WIDE = 6
# Without oneDNN, `few` takes up to this many rows (as fast as F.linear or faster up to 64) and F.linear the rest.
FEW_ROWS = 64


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


ONEDNN = _onednn_linear_available()


def route(rows: int, out_features: int, in_features: int, onednn: bool) -> str:
    """Which product `linear` runs for a float32 CPU input of `rows` rows, `onednn` saying whether oneDNN may run it:
    "few", "onednn" or "f_linear"."""
    if rows <= 2 or (rows <= FEW_ROWS_WIDE and out_features >= in_features):
        return "few"
    if onednn:
        return "onednn"
    return "few" if rows <= FEW_ROWS else "f_linear"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): [..., in] x [out, in] -> [..., out]."""
    rows = x.shape[0]
    if x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32 or rows == 0:
        return F.linear(x, weight, bias)
    # oneDNN's op has no gradient: training (tandem.training) computes through the other two.
    tracked = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    how = route(rows, weight.shape[0], weight.shape[1], ONEDNN and not tracked)
    if how == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    if how == "f_linear":
        return F.linear(x, weight, bias)
    columns = torch.cat((x, x)) if rows == 1 else x  # a single row goes in twice: [max(rows, 2), in]
    # [out, columns] -> [rows, out], made contiguous: the layers after it view and slice it by row.
    y = torch.mm(weight, columns.t()).t()[:rows].contiguous()
    return y + bias if bias is not None else y


class Linear(nn.Linear):
    """nn.Linear through `linear`; the same parameters and checkpoint names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
