"""What a target checkpoint takes on each tensor-parallel rank, read from its config.json and safetensors headers
alone (`tandem plan`): the rank's weights, one token's KV, and what a memory of a given size leaves for the KV pool.

Rank 0's model is built on the meta device by the family's own code (tandem.models.registry.built_target: shapes
and dtypes, no memory), and each checkpoint tensor is matched to its parameter as the loader matches them
(tandem.weights.loader.ParameterSlots) and to each rank's slice of it (ShardSpec.on_rank: the ranks' models differ in
nothing else), so the numbers follow the code's sharding: column- and row-parallel weights split, vocab-parallel
tables cut by the vocab rule, the rest replicated, and a family that refuses a tp refuses it here too.

Quantized weights are counted two ways. As stored, what the target holds by default (tandem.layers.stored): the
rank's slice of every part it keeps, scales included (INT4's weight_shape is not kept), where a slice that starts or
ends inside a block (fp8) or group (INT4) takes all of that block's scales and is reported as cut (`CutBlock`; the
target refuses such a tp unless it dequantizes). Dequantized: the values in the serving dtype, what the target holds
with --dequantize. Float weights count in the dtype the target holds them in.

On the CPU in float32 the target also holds oneDNN's blocked copy of every linear weight it multiplies as a whole
(tandem.layers.matmul.prepack, as large as the weight), so there those weights count twice: the float ones in both
forms, the quantized ones only dequantized (a weight kept quantized would not be copied).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from tandem.layers.kv_cache import CacheLayout
from tandem.layers.matmul import Linear, prepackable_linears, prepacks
from tandem.models.registry import TargetModel, built_target, not_read
from tandem.parallel.group import ParallelGroup
from tandem.parallel.layers import ParallelLMHead
from tandem.parallel.vocab import vocab_shard
from tandem.weights.formats import Quantization, QuantizationError, cell_span
from tandem.weights.headers import TensorHeader
from tandem.weights.loader import CheckpointError, ParameterSlots, Slot
from tandem.weights.quantized import Grouped, grouped, quantization_of


@dataclass(frozen=True)
class CutBlock:
    """A rank's slice of a quantized weight that starts or ends inside a block (fp8) or group (INT4): the rank holds
    the scales of every block it touches, and a kernel on the stored form would have to split the block."""

    weight: str
    rank: int
    dim: int  # 0: rows, 1: columns
    start: int
    end: int
    cell: int  # the block's or group's extent along dim


@dataclass(frozen=True)
class RankPlan:
    rank: int
    quantized_bytes: int  # the rank's slices of the quantized weights' kept parts as stored, scales included
    float_bytes: int  # every other weight and buffer, in the dtype the target holds it in
    dequantized_bytes: int  # every weight and buffer with the quantized ones dequantized to the serving dtype
    float_copy_bytes: int  # oneDNN's copies of the float linear weights (CPU, float32; tandem.layers.matmul.prepack)
    dequantized_copy_bytes: int  # the same, of every linear weight with the quantized ones dequantized
    kv_layout: CacheLayout  # what one token leaves in one layer of this rank's pool
    kv_token_bytes: int  # what one token takes in this rank's pool, all layers

    def weight_bytes(self, dequantize: bool) -> int:
        if dequantize:
            return self.dequantized_bytes + self.dequantized_copy_bytes
        return self.quantized_bytes + self.float_bytes + self.float_copy_bytes


@dataclass(frozen=True)
class MemoryPlan:
    architecture: str
    tp: int
    dtype: str  # the serving dtype: float weights, dequantized weights and the KV cache
    quantization: str | None  # the checkpoint's quantization, described; None: no quantized weights
    parameters: int  # values of the weights the target reads, all ranks together
    num_layers: int
    max_position_embeddings: int
    ranks: tuple[RankPlan, ...]
    cuts: tuple[CutBlock, ...]
    skipped: tuple[str, ...]  # checkpoint tensors the target does not read (draft layers, other models' towers)
    skipped_bytes: int
    unused: tuple[str, ...]  # tensors no parameter takes (a tied head's copy, rotary tables)
    unused_bytes: int


@dataclass(frozen=True)
class KVBudget:
    """What one rank's memory leaves for its KV pool once its weights are in. It fits when the pool gets one block,
    the least the target starts with (tandem.settings.KVCacheSettings.blocks_for)."""

    memory_bytes: int
    weight_bytes: int
    block_size: int  # tokens per block
    block_bytes: int  # one block of KV on this rank

    @property
    def kv_bytes(self) -> int:
        return max(0, self.memory_bytes - self.weight_bytes)

    @property
    def blocks(self) -> int:
        return self.kv_bytes // self.block_bytes

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def fits(self) -> bool:
        return self.blocks >= 1

    @property
    def shortfall(self) -> int:
        """Bytes more this rank would need for its weights and one block; 0 when it fits."""
        return max(0, self.weight_bytes + self.block_bytes - self.memory_bytes)


def kv_budget(rank: RankPlan, memory_bytes: int, block_size: int, dequantize: bool) -> KVBudget:
    return KVBudget(memory_bytes, rank.weight_bytes(dequantize), block_size, block_size * rank.kv_token_bytes)


def plan_memory(
    hf: dict[str, Any], headers: Sequence[TensorHeader], tp: int, dtype: str, device: str, source: str
) -> MemoryPlan:
    """The per-rank plan of the target whose config.json is `hf` and whose checkpoint lists `headers`, at tp ranks
    serving in `dtype` ("bfloat16", ...) on `device` ("cpu" or "cuda"). Raises a StartupError naming what the code
    refuses: an architecture, a tp that does not divide a head count (ParallelismError), a missing or misshapen
    tensor (CheckpointError), a quantization (QuantizationError)."""
    serving_dtype = getattr(torch, dtype)
    architecture, model = built_target(hf, serving_dtype, "meta", ParallelGroup(rank=0, world_size=tp))
    skip = not_read(architecture, model.config.num_layers)
    skipped = [header for header in headers if skip is not None and skip(header.name)]
    skipped_names = {header.name for header in skipped}
    quantization = quantization_of(hf)
    read = [(header.name, header) for header in headers if header.name not in skipped_names]
    weights = grouped(read, quantization, source)
    # Rank 0's model stands for every rank: ranks differ only in which slice of each tensor they hold
    # (ShardSpec.on_rank), so one build (tens of seconds for DeepSeek-V3's 60 000 linear layers) counts them all.
    assert isinstance(model, nn.Module)
    slots = ParameterSlots(model, architecture.name_map)
    used, unused = _matched(slots, weights, quantization, source)
    groups = [ParallelGroup(rank=rank, world_size=tp) for rank in range(tp)]
    counted = [_count_rank(model, slots, used, quantization, group, device) for group in groups]
    unused_names = set(unused)
    return MemoryPlan(
        architecture=model.config.architecture,
        tp=tp,
        dtype=dtype,
        quantization=quantization.describe() if quantization is not None else None,
        parameters=sum(math.prod(slot.full_shape) for _, slot in used),
        num_layers=model.config.num_layers,
        max_position_embeddings=model.config.max_position_embeddings,
        ranks=tuple(rank.plan for rank in counted),
        cuts=tuple(cut for rank in counted for cut in rank.cuts),
        skipped=tuple(header.name for header in skipped),
        skipped_bytes=sum(header.nbytes for header in skipped),
        unused=tuple(unused),
        unused_bytes=sum(_stored_bytes(weight) for weight in weights if weight.name in unused_names),
    )


@dataclass(frozen=True)
class _CountedRank:
    plan: RankPlan
    cuts: list[CutBlock]


def _matched(
    slots: ParameterSlots, weights: Sequence[Grouped[TensorHeader]], quantization: Quantization | None, source: str
) -> tuple[list[tuple[Grouped[TensorHeader], Slot]], list[str]]:
    """Each weight matched to its parameter (in rank 0's model) as load_weights matches it, the loader's checks made
    on it, once for every rank; and the names of the weights no parameter takes."""
    filled: set[tuple[str, str | None]] = set()
    present_roots: set[str] = set()
    used: list[tuple[Grouped[TensorHeader], Slot]] = []
    unused: list[str] = []
    for weight in weights:
        present_roots.add(weight.name.split(".")[0])
        slot = slots.slot(weight.name)
        if slot is None or slot.key in filled:
            unused.append(weight.name)
            continue
        _check_stored(weight, slot, quantization, source)
        used.append((weight, slot))
        filled.add(slot.key)
    slots.check_filled(filled, frozenset(), present_roots, source)
    return used, unused


def _count_rank(
    model: TargetModel,
    slots: ParameterSlots,
    used: Sequence[tuple[Grouped[TensorHeader], Slot]],
    quantization: Quantization | None,
    group: ParallelGroup,
    device: str,
) -> _CountedRank:
    """One rank's bytes: the slice it holds of each weight matched (ShardSpec.on_rank)."""
    assert isinstance(model, nn.Module)
    rank = group.rank
    quantized: set[int] = set()  # ids of the parameters that quantized weights fill
    totals = {"quantized": 0, "float": 0, "dequantized": 0}
    cuts: list[CutBlock] = []
    # What a weight's slice holds follows from its shapes and its spec alone: DeepSeek-V3's 45,000 weights have a
    # few dozen of those between them (the experts of 58 layers alike), so each is counted once.
    counted: dict[tuple[object, ...], tuple[int, int | None]] = {}
    for weight, found in used:
        parameter = slots.parameters[found.parameter_name]
        owner_name, _, leaf = found.parameter_name.rpartition(".")
        as_stored = weight.quantized and leaf == "weight" and isinstance(slots.modules[owner_name], Linear)
        shapes = tuple((part, header.shape, header.nbytes) for part, header in weight.parts.items())
        key = (found.full_shape, found.spec, parameter.element_size(), as_stored, shapes)
        counts = counted.get(key)
        if counts is None:
            slot = found if found.spec is None else replace(found, spec=found.spec.on_rank(rank, group.world_size))
            held, stored = _slice_values(slot) * parameter.element_size(), None
            cut: list[CutBlock] = []
            if as_stored:  # kept as stored
                assert quantization is not None
                stored, cut = _stored_slice(weight, slot, quantization, rank)
            counts = (held, stored)
            if not cut:  # a cut names its weight: each weight that cuts is counted on its own
                counted[key] = counts
            cuts.extend(cut)
        held, stored = counts
        totals["dequantized"] += held
        if stored is not None:
            totals["quantized"] += stored
            quantized.add(id(parameter))
        else:
            totals["float"] += held
    layout = model.cache_layout
    token_bytes = layout.token_bytes(model.config.num_layers, next(model.parameters()).dtype)
    copies = _prepacked_copies(model, quantized, device, group)
    plan = RankPlan(rank, totals["quantized"], totals["float"], totals["dequantized"], *copies, layout, token_bytes)
    return _CountedRank(plan, cuts)


def _prepacked_copies(model: nn.Module, quantized: set[int], device: str, group: ParallelGroup) -> tuple[int, int]:
    """The bytes of oneDNN's copies that tandem.layers.matmul.prepack makes of this rank's linear weights: of those
    no quantized weight fills, and of all of them; (0, 0) where it makes none (off the CPU, not float32). A tied LM
    head is a linear layer too: its table is copied, though the embedding holds it. `model` is rank 0's: a
    vocab-parallel head's rows are this rank's."""
    float_copies = all_copies = 0
    for linear in prepackable_linears(model):
        if prepacks(device, linear.weight.dtype):
            values = linear.weight.numel()
            if isinstance(linear, ParallelLMHead):
                values = vocab_shard(linear.vocab_size, group.world_size, group.rank).real * linear.in_features
            size = values * linear.weight.element_size()
            all_copies += size
            float_copies += 0 if id(linear.weight) in quantized else size
    return float_copies, all_copies


def _check_stored(weight: Grouped[TensorHeader], slot: Slot, quantization: Quantization | None, source: str) -> None:
    """The loader's checks, made on the stored parts of a quantized weight: QuantizationError naming a part whose
    dtype is not the format's, CheckpointError naming the tensor whose stored shape is not the one its parameter
    takes."""
    if not weight.quantized:
        expected = {"weight": slot.full_shape}
    elif len(slot.full_shape) == 2:
        assert quantization is not None
        for part, dtype in quantization.stored_dtypes().items():
            if weight.parts[part].dtype != dtype:
                raise QuantizationError(
                    f"tensor {weight.parts[part].name} in {source}: stored as {weight.parts[part].dtype}, "
                    f"{quantization.describe()} stores {dtype}"
                )
        expected = quantization.stored_shapes(slot.full_shape)
    else:
        raise CheckpointError(f"tensor {weight.name} in {source}: quantized, for a {len(slot.full_shape)}-d parameter")
    for part, header in weight.parts.items():
        if header.shape != expected[part]:
            raise CheckpointError(
                f"tensor {header.name} in {source}: expected shape {expected[part]}, got {header.shape}"
            )


def _stored_bytes(weight: Grouped[TensorHeader]) -> int:
    return sum(header.nbytes for header in weight.parts.values())


def _slice_values(slot: Slot) -> int:
    """Values of the rank's slice of the (float) weight."""
    values = math.prod(slot.full_shape)
    spec = slot.spec
    if spec is None or spec.size is None:
        return values
    return values // slot.full_shape[spec.dim] * spec.size


def _stored_slice(
    weight: Grouped[TensorHeader], slot: Slot, quantization: Quantization, rank: int
) -> tuple[int, list[CutBlock]]:
    """Bytes of the rank's slice of every part the target keeps of a quantized weight, and the blocks the slice cuts.

    Example: fp8 with 128 x 128 blocks, a [7168, 2048] weight split by columns at tp 32: rank 1 holds columns
    [64, 128), 64 of the weight's 2048 fp8 columns and all of scale column 0 (1 of 16), which it shares with rank 0.
    """
    spec = slot.spec
    total = 0
    cuts: list[CutBlock] = []
    cells = quantization.cells()
    for part in quantization.kept:
        header, part_cells = weight.parts[part], cells[part]
        if spec is None or spec.size is None or part_cells is None:
            total += header.nbytes
            continue
        span = cell_span(part_cells, spec)
        total += header.nbytes * (span.stop - span.first) // header.shape[spec.dim]
        if span.cut:
            cuts.append(CutBlock(weight.name, rank, spec.dim, spec.start, spec.start + spec.size, span.cell))
    return total, [max(cuts, key=lambda cut: cut.cell)] if cuts else []  # the widest cut stands for the weight
