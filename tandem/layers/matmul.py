"""y = x W^T + b on the CPU in float32, by the fastest of four routes for the shape, where PyTorch's own is slow.

`F.linear` on a CPU float32 input goes through the BLAS's x W^T with W transposed. On the 2-core development machine
(AMD EPYC, AVX-512) its kernels for a few rows ran at 6-11 GB/s of weight where reading memory runs at 27-32 GB/s,
and past a few rows they lose to oneDNN's inner product too. So `linear` takes one of:
- `few`: the product taken the other way round, (W x^T)^T, a single row fed in twice (two columns beat one);
- `prepacked`: oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`, the kernel TorchInductor's CPU backend
  calls for a linear layer) on oneDNN's blocked copy of the weight, made once by `prepack` (the runners call it:
  `torch.ops.mkldnn._reorder_linear_weight`, what TorchInductor's weight prepacking does when it freezes a model);
- `onednn`: the same inner product on the plain weight, for a weight without the copy;
- `F.linear` itself where none applies (other dtypes and devices, inputs that are not [rows, in], autograd, a
  PyTorch built without oneDNN).
The measurements behind the choice, per route and shape, are in docs/benchmarks.md ("Matrix products on the CPU").
The rule (`route`): `few` up to 2 rows; from 3 rows `prepacked` where the weight has its copy, otherwise `few`
up to FEW_ROWS_WIDE rows for a weight at least as tall as it is wide and `onednn` for everything larger. All are
float32 products of the same terms summed in another order: results agree to float32 rounding (the parity tests
with transformers hold), not bit for bit.

oneDNN builds a primitive (JIT-compiled kernels) for every shape it meets and keeps it in two caches of 1024 entries
(oneDNN's own and PyTorch's ideep wrapper's). A server meets a new row count with nearly every prompt, which would
build new kernels for each and grow the process. So the oneDNN routes compute a padded number of rows,
`onednn_rows`: exact up to EXACT_ROWS, then rounded up to a multiple of max(MIN_ROW_STEP, 1/ROW_STEPS of the count's
power of two) (at most 94 distinct counts up to 2048 rows, at most 1/16 more rows past 128), the extra rows zeros
whose results are dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.stored import StoredWeight

# `few` takes at most this many rows of a weight with out >= in (a wider one goes to oneDNN from 3 rows on).
FEW_ROWS_WIDE = 6
# Without oneDNN, `few` takes up to this many rows (as fast as F.linear or faster up to 64) and F.linear the rest.
FEW_ROWS = 64
# oneDNN computes row counts up to EXACT_ROWS as they are, larger ones rounded up (`onednn_rows`).
EXACT_ROWS = 16
MIN_ROW_STEP = 8
ROW_STEPS = 16  # padded row counts per doubling, past MIN_ROW_STEP * ROW_STEPS rows


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


ONEDNN = _onednn_linear_available()


def route(rows: int, out_features: int, in_features: int, onednn: bool, prepacked: bool = False) -> str:
    """Which product `linear` runs for a float32 CPU input of `rows` rows, `onednn` saying whether oneDNN may run it
    and `prepacked` whether the weight has oneDNN's blocked copy (`prepack`): "few", "prepacked", "onednn" or
    "f_linear"."""
    if rows <= 2:
        return "few"
    if onednn and prepacked:
        return "prepacked"
    if rows <= FEW_ROWS_WIDE and out_features >= in_features:
        return "few"
    if onednn:
        return "onednn"
    return "few" if rows <= FEW_ROWS else "f_linear"


def onednn_rows(rows: int) -> int:
    """The rows oneDNN computes for `rows`: a count from a small set, so that its kernels are built once per count
    (module docstring)."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(MIN_ROW_STEP, (1 << (rows.bit_length() - 1)) // ROW_STEPS)
    return -(-rows // step) * step


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    prepacked: torch.Tensor | None = None,  # oneDNN's blocked copy of weight (`prepack`), or None
) -> torch.Tensor:
    """F.linear(x, weight, bias): [..., in] x [out, in] -> [..., out]."""
    rows = x.shape[0]
    if x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32 or rows == 0:
        return F.linear(x, weight, bias)
    # oneDNN's op has no gradient: training (training) computes through the other two.
    tracked = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    how = route(rows, weight.shape[0], weight.shape[1], ONEDNN and not tracked, prepacked is not None)
    if how in ("prepacked", "onednn"):
        padded = onednn_rows(rows)
        # Zero rows below x (a slice of the first rows of a contiguous result is contiguous).
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1]))) if padded > rows else x.contiguous()
        product = prepacked if how == "prepacked" and prepacked is not None else weight
        y = torch.ops.mkldnn._linear_pointwise(x, product, bias, "none", [], "")
        return y[:rows] if padded > rows else y
    if how == "f_linear":
        return F.linear(x, weight, bias)
    columns = torch.cat((x, x)) if rows == 1 else x  # a single row goes in twice: [max(rows, 2), in]
    # [out, columns] -> [rows, out], made contiguous: the layers after it view and slice it by row.
    y = torch.mm(weight, columns.t()).t()[:rows].contiguous()
    return y + bias if bias is not None else y


class Modules(Protocol):
    """A model as `prepack` walks it: an nn.Module, or a protocol of one."""

    def modules(self) -> Iterator[nn.Module]: ...


class Linear(nn.Linear):
    """nn.Linear through `linear`; the same parameters and checkpoint names. `prepacked` is oneDNN's blocked copy of
    the weight once `prepack` made it (not a parameter or buffer: it is not saved, loaded or moved). A Linear that is
    never multiplied as a whole (`prepackable` False: stacked experts, run one expert's rows at a time) gets none.

    A quantized checkpoint's weight may be kept as stored (`keep_stored`): the float `weight` parameter is then gone
    and `stored` holds the stored parts, expanded before each product (tandem.layers.stored). `float_weight` is the
    weight either way."""

    prepacked: torch.Tensor | None = None
    prepackable: bool = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.stored: StoredWeight | None = None

    def keep_stored(self, stored: StoredWeight) -> None:
        """Replaces the float weight (on the meta device: never allocated) by its stored form."""
        assert stored.shape == (self.out_features, self.in_features), "a stored form of another shape"
        del self.weight
        self.stored = stored

    def float_weight(self) -> torch.Tensor:  # -> [out, in]
        """The weight in the serving dtype: the parameter, or the stored form expanded (a new tensor each call)."""
        return self.weight if self.stored is None else self.stored.expanded()

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
        """x W^T (+ bias): `linear`, or `stored_linear` for a weight kept as stored."""
        if self.stored is not None:
            return stored_linear(x, self.stored, bias)
        return linear(x, self.weight, bias, self.prepacked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


def stored_linear(
    x: torch.Tensor,  # [..., in]
    stored: StoredWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # -> [..., out]
    """linear(x, W, bias) for a weight kept as stored: by a kernel that takes it as stored where one applies
    (StoredWeight.kernel_product), else W expanded a run of rows at a time (StoredWeight.chunks), each run multiplied
    by `linear` while it is in the cache, so that no [out, in] float weight is ever allocated."""
    y = stored.kernel_product(x)
    if y is None:
        y = x.new_empty((*x.shape[:-1], stored.shape[0]))
        for rows, weight in stored.chunks():
            y[..., rows] = linear(x, weight)
    return y if bias is None else y + bias


def prepack(model: Modules) -> int:
    """Gives every Linear of `model` whose weight is a float32 CPU tensor oneDNN's blocked copy of that weight, which
    `linear` multiplies from 3 rows up; returns how many it packed (0 where oneDNN is missing).

    For inference, after the weights are loaded: a weight changed afterwards would leave its copy stale, so the
    runners call it when they are built and training never does. The copy takes as much memory as the weight.
    """
    packed = 0
    with torch.no_grad():
        for module in prepackable_linears(model):
            weight = module.weight
            if prepacks(weight.device.type, weight.dtype):
                module.prepacked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
                packed += 1
    return packed


def prepacks(device: str, dtype: torch.dtype) -> bool:
    """Whether `prepack` copies a weight held on `device` ("cpu", "cuda", ...) in `dtype`: float32 on the CPU, where
    PyTorch has oneDNN."""
    return ONEDNN and device == "cpu" and dtype == torch.float32


def prepackable_linears(model: Modules) -> Iterator[Linear]:
    """The Linears of `model` that `prepack` copies where it `prepacks`: those multiplied as a whole, with a float
    weight (a weight kept as stored gets no copy, which would be as large as its float form)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.prepackable and module.stored is None:
            yield module
