"""The FlashInfer backend's planning, on the CPU, against a stand-in for the flashinfer package that records what a
step asks of it: which wrapper it makes (the backend's shared one, or a recorded step's own over its fixed buffers),
and what it plans each with. The kernels themselves run in tests/cuda.

Page size 4 and two sequences throughout: A with pages [1, 2] and B with page [3], holding 5 and 2 KV rows before
the step.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from tandem.layers.flashinfer_attention import FlashInferBackend, FlashInferStep
from tandem.layers.page_table import PageTable, PlanEntry, build_page_table

PAGE_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
NUM_PAGES = 8
HOST = torch.device("cpu")

Call = tuple[str, str, tuple[Any, ...], dict[str, Any]]  # (what, wrapper kind, positional, keyword arguments)


class RecordingWrapper:
    """Stands in for a FlashInfer wrapper: records its making and its plans; runs to zeros."""

    def __init__(self, calls: list[Call], kind: str, *args: Any, **kwargs: Any) -> None:
        self.calls = calls
        self.kind = kind
        calls.append(("make", kind, args, kwargs))

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("plan", self.kind, args, kwargs))

    def run(self, query: torch.Tensor, *pages: Any) -> torch.Tensor:
        return torch.zeros_like(query)


def recording_backend(calls: list[Call]) -> FlashInferBackend:
    """A FlashInferBackend on the CPU over the recording stand-in (its constructor wants CUDA and the package)."""
    backend = FlashInferBackend.__new__(FlashInferBackend)
    backend.flashinfer = SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=partial(RecordingWrapper, calls, "decode"),
        BatchPrefillWithPagedKVCacheWrapper=partial(RecordingWrapper, calls, "prefill"),
    )
    backend.device = HOST
    backend.workspace = torch.empty(0, dtype=torch.uint8)
    backend._wrappers = {}
    return backend


def step_table(new_a: int, new_b: int, tree: list[int] | None = None) -> PageTable:
    """A adds new_a tokens after its 5 rows (as a tree of these parents when given), B new_b after its 2."""
    entries = [PlanEntry([1, 2, 4], 5, new_a, tree), PlanEntry([3, 5], 2, new_b)]
    return build_page_table(entries, PAGE_SIZE, HOST)


def attend(step: FlashInferStep, table: PageTable, sliding_window: int | None = None) -> None:
    """One grouped-query layer's attention over the step, as an attention layer calls it."""
    num_tokens = len(table.positions)
    query = torch.zeros(num_tokens, NUM_HEADS, HEAD_DIM)
    key = torch.zeros(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    pool = torch.zeros(NUM_PAGES * PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    output = step.attend(query, key, key.clone(), pool, pool.clone(), None, sliding_window)
    assert output.shape == query.shape


def paged_arguments(table: PageTable) -> tuple[Any, ...]:
    return (
        table.kv_indptr,
        table.kv_page_indices,
        table.kv_last_page_len,
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        PAGE_SIZE,
    )


def shape_arguments(window_left: int = -1) -> dict[str, Any]:
    return {
        "sm_scale": HEAD_DIM**-0.5,
        "window_left": window_left,
        "q_data_type": torch.float32,
        "kv_data_type": torch.float32,
    }


def same(got: Any, expected: Any) -> bool:
    if isinstance(expected, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected)
    if isinstance(expected, tuple):
        return isinstance(got, tuple) and len(got) == len(expected) and all(map(same, got, expected))
    if isinstance(expected, dict):
        return isinstance(got, dict) and got.keys() == expected.keys() and all(same(got[k], expected[k]) for k in got)
    return bool(got == expected)


def assert_calls(calls: list[Call], expected: list[Call]) -> None:
    assert len(calls) == len(expected), [call[:2] for call in calls]
    for got, wanted in zip(calls, expected, strict=True):
        assert got[:2] == wanted[:2]
        assert same(got[2], wanted[2]), (got[:2], got[2])
        assert same(got[3], wanted[3]), (got[:2], got[3])


def test_decoding_steps_plan_the_backends_decode_wrapper_once_per_shape() -> None:
    calls: list[Call] = []
    backend = recording_backend(calls)
    table = step_table(1, 1)
    step = backend.plan(table)
    for sliding_window in (None, None, 3):  # two layers of one shape, then a sliding-window layer
        attend(step, table, sliding_window)
    attend(backend.plan(table), table)  # the next step plans the backend's wrapper again, without making one
    workspace = (backend.workspace, "NHD")
    assert_calls(
        calls,
        [
            ("make", "decode", workspace, {}),
            ("plan", "decode", paged_arguments(table), shape_arguments()),
            ("make", "decode", workspace, {}),
            ("plan", "decode", paged_arguments(table), shape_arguments(window_left=2)),
            ("plan", "decode", paged_arguments(table), shape_arguments()),
        ],
    )


def test_chain_and_tree_steps_plan_the_prefill_wrapper() -> None:
    calls: list[Call] = []
    backend = recording_backend(calls)
    chain, tree = step_table(3, 1), step_table(3, 2, tree=[-1, 0, 0])
    attend(backend.plan(chain), chain)
    attend(backend.plan(tree), tree)
    # A sees its 5 context rows and its tree (node 2 not node 1); B, a chain, sees rows up to its own.
    a_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 1]])
    b_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    packed = torch.cat((a_mask.flatten(), b_mask.flatten())).bool()
    assert_calls(
        calls,
        [
            ("make", "prefill", (backend.workspace, "NHD"), {}),
            (
                "plan",
                "prefill",
                (chain.qo_indptr, *paged_arguments(chain)),
                {"custom_mask": None, "causal": True, **shape_arguments()},
            ),
            # A masked step has a wrapper of its own: an image's step plans a causal one beside it (its spans
            # dropped, for layers that attend causally over images).
            ("make", "prefill", (backend.workspace, "NHD"), {}),
            (
                "plan",
                "prefill",
                (tree.qo_indptr, *paged_arguments(tree)),
                {"custom_mask": packed, "causal": False, **shape_arguments()},
            ),
        ],
    )


def test_recorded_steps_make_their_own_wrappers_over_fixed_buffers_and_replan_them() -> None:
    calls: list[Call] = []
    backend = recording_backend(calls)
    decoding, verifying = step_table(1, 1), step_table(2, 2)
    next_decoding = build_page_table([PlanEntry([1, 2], 6, 1), PlanEntry([3], 3, 1)], PAGE_SIZE, HOST)
    decode_step = backend.graph_step(decoding, 2, NUM_PAGES)
    attend(decode_step, decoding)
    decode_step.replan(next_decoding)
    verify_step = backend.graph_step(verifying, 2, NUM_PAGES)
    attend(verify_step, verifying)
    decode_graph, verify_graph = decode_step.graph, verify_step.graph
    assert decode_graph is not None and verify_graph is not None
    decode_buffers = {
        "paged_kv_indptr_buffer": decode_graph.kv_indptr,
        "paged_kv_indices_buffer": decode_graph.kv_page_indices,
        "paged_kv_last_page_len_buffer": decode_graph.kv_last_page_len,
    }
    prefill_buffers = {
        "qo_indptr_buf": verify_graph.qo_indptr,
        "paged_kv_indptr_buf": verify_graph.kv_indptr,
        "paged_kv_indices_buf": verify_graph.kv_page_indices,
        "paged_kv_last_page_len_buf": verify_graph.kv_last_page_len,
    }
    workspace = (backend.workspace, "NHD")
    assert_calls(
        calls,
        [
            ("make", "decode", workspace, {"use_cuda_graph": True, **decode_buffers}),
            ("plan", "decode", paged_arguments(decoding), shape_arguments()),
            ("plan", "decode", paged_arguments(next_decoding), shape_arguments()),  # the same wrapper, replanned
            ("make", "prefill", workspace, {"use_cuda_graph": True, **prefill_buffers}),
            (
                "plan",
                "prefill",
                (verifying.qo_indptr, *paged_arguments(verifying)),
                {"custom_mask": None, "causal": True, **shape_arguments()},
            ),
        ],
    )
    # The buffers are the recorded step's own: the backend keeps no wrapper of them for other steps.
    assert backend._wrappers == {}
