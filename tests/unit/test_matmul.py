"""tandem.layers.matmul.linear: F.linear's answer, to float32 rounding, on each of its routes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.layers import matmul
from tandem.layers.matmul import EXACT_ROWS, FEW_ROWS, FEW_ROWS_WIDE, Linear, linear, onednn_rows, prepack, route
from tandem.parallel.group import SINGLE_PROCESS
from tandem.parallel.layers import ParallelLMHead, RowParallelLinear


@pytest.mark.parametrize("onednn", [True, False], ids=["with-onednn", "without-onednn"])
@pytest.mark.parametrize("shape", [(96, 40), (40, 96)], ids=["tall", "wide"])
@pytest.mark.parametrize("rows", [1, 2, 3, FEW_ROWS_WIDE, FEW_ROWS_WIDE + 1, FEW_ROWS, FEW_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_gives_what_f_linear_gives(
    rows: int, shape: tuple[int, int], with_bias: bool, onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if onednn and not matmul.ONEDNN:
        pytest.skip("this PyTorch has no oneDNN")
    monkeypatch.setattr(matmul, "ONEDNN", onednn)
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    y = linear(x, weight, bias)
    assert y.shape == (rows, out_features) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_the_route_is_the_one_measured_fastest_for_the_shape() -> None:
    # Up to 2 rows: the few-row product, whatever the shape.
    assert route(1, 4096, 512, onednn=True) == route(2, 512, 1536, onednn=True) == "few"
    # A weight at least as tall as wide keeps it up to FEW_ROWS_WIDE rows; a wide one (a down projection) does not.
    assert route(FEW_ROWS_WIDE, 3072, 512, onednn=True) == "few"
    assert route(FEW_ROWS_WIDE + 1, 3072, 512, onednn=True) == "onednn"
    assert route(3, 512, 1536, onednn=True) == "onednn"
    assert route(2048, 512, 512, onednn=True) == "onednn"
    # Without oneDNN: the few-row product up to FEW_ROWS rows, then F.linear.
    assert route(FEW_ROWS, 512, 1536, onednn=False) == "few"
    assert route(FEW_ROWS + 1, 3072, 512, onednn=False) == "f_linear"
    # A weight with oneDNN's blocked copy: that copy from 3 rows up, whatever the shape; up to 2 rows as before.
    assert route(3, 3072, 512, onednn=True, prepacked=True) == "prepacked"
    assert route(2048, 512, 1536, onednn=True, prepacked=True) == "prepacked"
    assert route(2, 3072, 512, onednn=True, prepacked=True) == "few"
    # The copy is oneDNN's: where oneDNN may not run (no oneDNN, or autograd), the plain weight's routes.
    assert route(3, 512, 1536, onednn=False, prepacked=True) == "few"


def test_onednn_meets_few_row_counts_and_little_padding() -> None:
    padded = [onednn_rows(rows) for rows in range(1, 4097)]
    assert all(p >= rows for rows, p in enumerate(padded, start=1))
    assert padded == sorted(padded)  # more rows never compute fewer
    assert padded[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    # Kernels are built once per count: up to 2048 rows, 94 counts instead of 2048.
    assert len(set(padded[:2048])) == 94
    # Past 128 rows at most 1/16 more rows are computed; below, at most 7 (of rows cheap next to the weight's read).
    assert max((p - rows) / rows for rows, p in enumerate(padded, start=1) if rows > 128) <= 1 / 16
    assert max(p - rows for rows, p in enumerate(padded[:128], start=1)) == 7
    assert [onednn_rows(rows) for rows in (17, 48, 129, 300, 2047)] == [24, 48, 136, 304, 2048]


def test_a_strided_input_and_its_rows_are_taken_as_they_are() -> None:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(32, 24, generator=generator)
    packed = torch.randn(5, 48, generator=generator)
    x = packed[:, 24:]  # a column slice: rows are not contiguous
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x[2:3], weight), F.linear(x[2:3], weight), rtol=1e-5, atol=1e-5)
    many = torch.randn(EXACT_ROWS + 3, 48, generator=generator)[:, 24:]  # oneDNN's route, rows padded to 24
    y = linear(many, weight)
    assert y.shape == (EXACT_ROWS + 3, 32) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(many, weight), rtol=1e-5, atol=1e-5)


def test_other_dtypes_shapes_and_empty_batches_are_f_linear_itself() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 8, generator=generator)
    half = torch.randn(4, 8, generator=generator).bfloat16()
    assert torch.equal(linear(half, weight.bfloat16()), F.linear(half, weight.bfloat16()))
    batched = torch.randn(2, 3, 8, generator=generator)  # not [rows, in]
    assert torch.equal(linear(batched, weight), F.linear(batched, weight))
    assert linear(torch.empty(0, 8), weight).shape == (0, 16)


def test_the_module_keeps_nn_linear_parameters_and_gradients_flow() -> None:
    torch.manual_seed(0)
    module, reference = Linear(8, 4), torch.nn.Linear(8, 4)
    reference.load_state_dict(module.state_dict())
    assert list(module.state_dict()) == ["weight", "bias"]
    assert_same_gradients(module, reference)  # its rows would go to oneDNN without gradients


def assert_same_gradients(module: Linear, reference: torch.nn.Linear) -> None:
    """Gradients through `module` of a product of more rows than `few` takes equal those through `reference`."""
    x = torch.randn(FEW_ROWS_WIDE + 1, 8, requires_grad=True)
    module(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    reference(x).sum().backward()
    torch.testing.assert_close(x.grad, expected)
    torch.testing.assert_close(module.weight.grad, reference.weight.grad)


@pytest.mark.parametrize("rows", [1, 2, 3, FEW_ROWS_WIDE, FEW_ROWS_WIDE + 1, EXACT_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_prepacked_module_gives_what_f_linear_gives(rows: int, with_bias: bool) -> None:
    if not matmul.ONEDNN:
        pytest.skip("this PyTorch has no oneDNN")
    torch.manual_seed(rows)
    module = Linear(40, 96, bias=with_bias)
    assert prepack(module) == 1 and module.prepacked is not None
    x = torch.randn(rows, 40)
    with torch.no_grad():
        torch.testing.assert_close(module(x), F.linear(x, module.weight, module.bias), rtol=1e-5, atol=1e-5)


def test_prepack_packs_every_float32_cpu_linear_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    if not matmul.ONEDNN:
        pytest.skip("this PyTorch has no oneDNN")
    model = torch.nn.ModuleDict(
        {
            "linear": Linear(8, 16),
            "row_parallel": RowParallelLinear(16, 8, bias=True, group=SINGLE_PROCESS),
            "lm_head": ParallelLMHead(32, 8, SINGLE_PROCESS),
            "plain": torch.nn.Linear(8, 8),  # not computed through `linear`: nothing would read a copy
            "other_dtype": Linear(8, 8).bfloat16(),  # `linear` gives other dtypes to F.linear
        }
    )
    assert prepack(model) == 3
    assert [name for name, module in model.items() if getattr(module, "prepacked", None) is not None] == [
        "linear",
        "row_parallel",
        "lm_head",
    ]
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(model["lm_head"](x), F.linear(x, model["lm_head"].weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            model["row_parallel"](model["linear"](x)),
            F.linear(
                F.linear(x, model["linear"].weight, model["linear"].bias),
                model["row_parallel"].weight,
                model["row_parallel"].bias,
            ),
            rtol=1e-5,
            atol=1e-5,
        )
    monkeypatch.setattr(matmul, "ONEDNN", False)
    assert prepack(Linear(8, 8)) == 0


def test_gradients_flow_through_a_prepacked_module() -> None:
    # oneDNN's op has no gradient: a product autograd tracks takes the plain weight's routes, copy or not.
    torch.manual_seed(1)
    module, reference = Linear(8, 4), torch.nn.Linear(8, 4)
    reference.load_state_dict(module.state_dict())
    prepack(module)
    assert_same_gradients(module, reference)
