"""Decode-shaped steps replayed from CUDA graphs (`--cuda-graphs`), padded to a few batch sizes.

On a GPU a decoding step of a few rows per sequence is bound by kernel launches and the host's Python, not by the
GPU's arithmetic: a graph recorded once per shape replays every kernel of the forward with one launch.

Which steps: those where every sequence adds the same number of rows q (a decode: q = 1; a chain verification of
k drafts: q = k + 1; a draft step: q = 1), none of them a tree, q at most a block, and at most `max_batch`
sequences. Other steps (prompt chunks, trees, mixed q) run as they always do. A step of b sequences is padded to
the smallest recorded batch size B >= b (`batch_sizes`): 1, 2, 4, 8, then every multiple of 8.

Padding: each of the B - b extra sequences adds q rows at positions 0..q-1 of the cache's scratch block, a block no
sequence ever holds (`PagedKVCache(scratch_block=True)`), so their KV writes land there and their attention reads
nothing else; their inputs are zeros (token 0, a zero hidden row) and their outputs are dropped. Example, q = 2,
block size 4, scratch block 9, two real sequences padded to B = 4: the extra sequences' rows write slots 36, 37 and
attend over those two keys, causally, as a two-token prompt would.

A shape (B, q and the caller's key, e.g. the capture layers a target step returns) is recorded the first time it is
met: the forward runs once on the shape's static buffers (which also plans every layer's attention wrapper, since
planning cannot happen while a graph is recorded), then again under recording. Before every replay the step's
inputs, positions and write slots are copied into the static buffers and the attention is planned again from the
step's page table (`Recorder.replan`). Outputs are views of the recorded outputs: they hold until the next replay
of the same runner, so a caller copies what it keeps longer. A shape that fails to record is logged once and runs
as other steps do from then on.

The recorder is the seam: `CudaGraphRecorder` records CUDA graphs over the FlashInfer backend in its CUDA-graph
mode (fixed index buffers per batch size; tandem.layers.flashinfer_attention).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from tandem.layers.attention_backend import AttentionMetadata, AttentionStep
from tandem.layers.kv_cache import PagedKVCache
from tandem.layers.page_table import PageTable, PlanEntry, build_page_table

LOG = logging.getLogger(__name__)

MAX_BATCH = 64  # the largest batch size recorded; larger steps run eagerly

# The rows of a step by name, [num_rows, ...] each, in the step's row order.
Tensors = Mapping[str, torch.Tensor]
# A step's forward over its inputs and attention metadata; returns its outputs, [num_rows, ...] each.
Forward = Callable[[Tensors, AttentionMetadata], dict[str, torch.Tensor]]


def batch_sizes(max_batch: int) -> list[int]:
    """The recorded batch sizes: 1, 2, 4, 8, then multiples of 8 up to max_batch (itself included)."""
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    sizes += range(8, max_batch, 8)
    return [*sizes, max_batch]


def uniform_rows(table: PageTable) -> int | None:
    """q when every sequence of the step adds q rows as a chain (no tree), else None."""
    if any(mask is not None for mask in table.custom_masks):
        return None
    lengths = set(table.query_lens())
    return lengths.pop() if len(lengths) == 1 else None


def pad_table(table: PageTable, batch: int, scratch_block: int) -> PageTable:
    """The step's page table with batch - table.batch_size more sequences of q rows each in the scratch block (see
    the module docstring); every sequence must add the same q rows, at most a block."""
    rows = uniform_rows(table)
    if rows is None or rows > table.page_size:
        raise ValueError("only steps whose sequences all add the same rows, at most a block, as chains are padded")
    if batch < table.batch_size:
        raise ValueError(f"cannot pad {table.batch_size} sequences to {batch}")
    if batch == table.batch_size:
        return table
    extra = build_page_table(
        [PlanEntry([scratch_block], 0, rows)] * (batch - table.batch_size), table.page_size, table.positions.device
    )
    page_offset = int(table.kv_indptr[-1])
    row_offset = int(table.qo_indptr[-1])
    return PageTable(
        page_size=table.page_size,
        qo_indptr=torch.cat((table.qo_indptr, extra.qo_indptr[1:] + row_offset)),
        kv_indptr=torch.cat((table.kv_indptr, extra.kv_indptr[1:] + page_offset)),
        kv_page_indices=torch.cat((table.kv_page_indices, extra.kv_page_indices)),
        kv_last_page_len=torch.cat((table.kv_last_page_len, extra.kv_last_page_len)),
        positions=torch.cat((table.positions, extra.positions)),
        write_slots=torch.cat((table.write_slots, extra.write_slots)),
        custom_masks=table.custom_masks + extra.custom_masks,
    )


class Recorder(Protocol):
    """How a shape's forward is recorded and replayed, and how its attention follows each step's page table."""

    def attention(self, table: PageTable, batch: int) -> AttentionStep:
        """The attention step a recorded forward of `batch` sequences keeps (planned for `table`)."""
        ...

    def replan(self, attention: AttentionStep, table: PageTable) -> None:
        """Plans `attention` (from `attention()`) for another step's page table of the same shape."""
        ...

    def record(self, forward: Callable[[], dict[str, torch.Tensor]]) -> Callable[[], dict[str, torch.Tensor]]:
        """Records `forward` (which reads the static buffers); returns what runs it again. Raises when the forward
        cannot be recorded."""
        ...


@dataclass
class _Shape:
    """One recorded shape: its static buffers and what replays it."""

    inputs: dict[str, torch.Tensor]  # name -> [batch * q, ...]
    positions: torch.Tensor  # [batch * q]
    write_slots: torch.Tensor  # [batch * q]
    attention: AttentionStep
    replay: Callable[[], dict[str, torch.Tensor]]


class GraphedForward:
    """Runs the decode-shaped steps of one cache's forwards from recorded shapes (see the module docstring)."""

    def __init__(self, cache: PagedKVCache, recorder: Recorder, max_batch: int = MAX_BATCH) -> None:
        if cache.scratch_block is None:
            raise ValueError("CUDA graphs pad steps in a scratch block: build the cache with scratch_block=True")
        self.scratch_block: int = cache.scratch_block
        self.recorder = recorder
        self.sizes = batch_sizes(max_batch)
        self._shapes: dict[Hashable, _Shape | None] = {}  # None: the shape failed to record; it runs eagerly

    def padded_batch(self, table: PageTable) -> int | None:
        """The recorded batch size this step runs at, or None when it runs eagerly."""
        rows = uniform_rows(table)
        if rows is None or rows > table.page_size or table.batch_size > self.sizes[-1]:
            return None
        return next(size for size in self.sizes if size >= table.batch_size)

    def run(self, table: PageTable, inputs: Tensors, key: Hashable, forward: Forward) -> dict[str, torch.Tensor] | None:
        """The step's outputs (views, valid until the next replay), or None when the caller runs it eagerly with
        `table` as planned. `key` names what else shapes the forward (it is part of the recorded shape)."""
        batch = self.padded_batch(table)
        if batch is None:
            return None
        rows = int(table.qo_indptr[-1])
        shape_key = (batch, rows // table.batch_size, key)
        if shape_key in self._shapes and self._shapes[shape_key] is None:
            return None
        padded = pad_table(table, batch, self.scratch_block)
        shape = self._shapes.get(shape_key)
        if shape is None:
            try:
                shape = self._record(padded, inputs, forward)
            except Exception:  # a forward that cannot be recorded runs as it always did
                LOG.warning("cannot record a CUDA graph of %s: it runs eagerly", shape_key, exc_info=True)
                self._shapes[shape_key] = None
                return None
            self._shapes[shape_key] = shape
        else:
            static_table = _fill(shape.inputs, shape.positions, shape.write_slots, padded, inputs)
            self.recorder.replan(shape.attention, static_table)
        return {name: output[:rows] for name, output in shape.replay().items()}

    def _record(self, padded: PageTable, inputs: Tensors, forward: Forward) -> _Shape:
        total = len(padded.positions)
        static = {name: tensor.new_zeros((total, *tensor.shape[1:])) for name, tensor in inputs.items()}
        positions, write_slots = torch.empty_like(padded.positions), torch.empty_like(padded.write_slots)
        static_table = _fill(static, positions, write_slots, padded, inputs)
        attention = self.recorder.attention(static_table, padded.batch_size)

        def run() -> dict[str, torch.Tensor]:
            # A new tensor object over the static positions each run: what caches per positions tensor (the rotary
            # embedding's cos and sin, tandem.layers.rotary) is computed again in each run, so also while recording.
            table = replace(static_table, positions=positions.view(-1))
            return forward(static, AttentionMetadata(table, attention))

        return _Shape(static, positions, write_slots, attention, self.recorder.record(run))


def run_step(
    graphs: GraphedForward | None,
    cache: PagedKVCache,
    table: PageTable,
    inputs: Tensors,
    key: Hashable,
    forward: Forward,
) -> dict[str, torch.Tensor]:
    """A step's outputs: from a recorded shape when CUDA graphs are on (`graphs`) and take the step (views, valid
    until the next replay), else `forward` run eagerly on `table` as the cache's backend plans it."""
    outputs = graphs.run(table, inputs, key, forward) if graphs is not None else None
    if outputs is None:
        outputs = forward(inputs, AttentionMetadata.planned(table, cache.backend))
    return outputs


def _fill(
    buffers: dict[str, torch.Tensor],  # name -> [batch * q, ...] a shape's static inputs
    positions: torch.Tensor,  # [batch * q]
    write_slots: torch.Tensor,  # [batch * q]
    padded: PageTable,
    inputs: Tensors,
) -> PageTable:
    """Copies a padded step into a shape's static buffers (padding rows get zeros); returns its page table over them."""
    for name, tensor in inputs.items():
        buffers[name][: len(tensor)].copy_(tensor)
        buffers[name][len(tensor) :].zero_()
    positions.copy_(padded.positions)
    write_slots.copy_(padded.write_slots)
    return replace(padded, positions=positions, write_slots=write_slots)


class CudaGraphRecorder:
    """Records CUDA graphs over the FlashInfer backend's CUDA-graph mode; every shape shares one memory pool (they
    replay one at a time)."""

    def __init__(self, cache: PagedKVCache) -> None:
        if cache.device.type != "cuda" or cache.backend.name != "flashinfer":
            raise ValueError(
                f"CUDA graphs replay FlashInfer's attention on CUDA: this cache is on {cache.device} with the "
                f"{cache.backend.name} backend"
            )
        self.backend: Any = cache.backend  # a FlashInferBackend (imported only on CUDA)
        self.num_pages = cache.num_blocks + 1  # the scratch block too
        self.pool = torch.cuda.graph_pool_handle()

    def attention(self, table: PageTable, batch: int) -> AttentionStep:
        step: AttentionStep = self.backend.graph_step(table, batch, self.num_pages)
        return step

    def replan(self, attention: AttentionStep, table: PageTable) -> None:
        attention.replan(table)  # type: ignore[attr-defined]  # a FlashInferStep in CUDA-graph mode

    def record(self, forward: Callable[[], dict[str, torch.Tensor]]) -> Callable[[], dict[str, torch.Tensor]]:
        # The first run plans every layer's wrapper and runs kernels that compile or tune on first use; on a side
        # stream, as PyTorch asks of what is recorded next.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = forward()

        def replay() -> dict[str, torch.Tensor]:
            graph.replay()
            return outputs

        return replay


# What a runner builds its GraphedForward with, from its cache (tests pass their own recorder this way).
GraphsFactory = Callable[[PagedKVCache], GraphedForward]


def recorded_graphs(cache: PagedKVCache) -> GraphedForward:
    """CUDA graphs of the forwards over `cache` (what a runner uses unless it is given another GraphsFactory)."""
    return GraphedForward(cache, CudaGraphRecorder(cache))
