"""`tandem plan`: whether a target checkpoint fits a machine at a tp, read from config.json and the safetensors
headers alone (tandem.models.memory_plan), printed per rank.

Exit codes: 0 it fits on every rank, 1 some rank is short (the output says by how many bytes), 2 the input cannot
be planned (no such directory, no config.json, an architecture, tp or checkpoint the code refuses).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from launch.plan_command import PlanRequest
from tandem import flags
from tandem.devices import AUTO, resolve_device, resolve_dtype
from tandem.errors import StartupError
from tandem.models.config import read_hf_config
from tandem.models.memory_plan import KVBudget, MemoryPlan, RankPlan, kv_budget, plan_memory
from tandem.weights.headers import checkpoint_headers

FITS, SHORT, BAD_INPUT = 0, 1, 2


@dataclass(frozen=True)
class RankMemory:
    bytes: int
    source: str  # where the number comes from, for the report


def run_plan(args: argparse.Namespace) -> int:
    """Prints the plan; returns FITS, SHORT or BAD_INPUT (with one line naming what is wrong on stderr)."""
    request = flags.settings_of(PlanRequest, args)
    try:
        if not request.target.is_dir():
            raise StartupError(f"--target {request.target}: no such directory")
        device = _device(request.device)
        dtype = resolve_dtype(request.dtype, device)
        memory = _memory(request, device)
        headers = checkpoint_headers(request.target)
        plan = plan_memory(read_hf_config(request.target), headers, request.tp, dtype, device, str(request.target))
    except (StartupError, OSError) as error:
        print(f"tandem plan: {error}", file=sys.stderr)
        return BAD_INPUT
    budgets = [kv_budget(rank, memory.bytes, request.block_size, request.dequantize) for rank in plan.ranks]
    print("\n".join(report(plan, request, memory)))
    short = [(budget.shortfall, rank) for rank, budget in enumerate(budgets) if not budget.fits]
    weights = _form(plan, request.dequantize)
    if short:
        shortfall, rank = max(short)
        print(f"does not fit: rank {rank} is short by {_size(shortfall)} for its {weights} and one KV block")
        return SHORT
    print(f"fits: {min(budget.tokens for budget in budgets)} tokens of KV on every rank, with the {weights}")
    return FITS


def _device(requested: str) -> str:
    """The device planned for, "cpu" or "cuda"; a plan for a GPU may be made without one (--gpu-memory-bytes)."""
    if requested == AUTO:
        return "cuda" if resolve_device(AUTO).startswith("cuda") else "cpu"
    return requested


def _memory(request: PlanRequest, device: str) -> RankMemory:
    if request.memory_bytes is not None:
        return RankMemory(request.memory_bytes, "given")
    if device == "cpu":
        available = _available_memory()
        return RankMemory(available // request.tp, f"MemAvailable {available} over --tp {request.tp}")
    if not torch.cuda.is_available():
        raise StartupError("--gpu-memory-bytes: required with --device cuda where torch sees no GPU")
    properties = torch.cuda.get_device_properties(0)
    return RankMemory(properties.total_memory, f"the total memory of GPU 0 ({properties.name})")


def _available_memory() -> int:
    """The machine's available memory (Linux's MemAvailable: free memory plus what the page cache would give back)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024  # in kB
    raise StartupError("--gpu-memory-bytes: required where /proc/meminfo gives no MemAvailable")


def report(plan: MemoryPlan, request: PlanRequest, memory: RankMemory) -> list[str]:
    """The plan as lines of text: the model, what is not read, the memory, one token's KV, then each rank."""
    lines = [
        f"{plan.architecture} in {request.target}: tp {plan.tp}, {plan.dtype}",
        f"  parameters read by the target: {plan.parameters / 1e9:.2f} billion ({plan.parameters})",
        f"  quantization: {plan.quantization or 'none'}",
    ]
    if plan.skipped:
        lines.append(f"  not read: {len(plan.skipped)} tensors, {_size(plan.skipped_bytes)}, e.g. {plan.skipped[0]}")
    if plan.unused:
        lines.append(f"  not used: {len(plan.unused)} tensors, {_size(plan.unused_bytes)}, e.g. {plan.unused[0]}")
    lines.append(f"  memory per rank: {_size(memory.bytes)}, {memory.source}")
    lines.append(f"  KV per token per rank: {_token_bytes(plan, plan.ranks[0])}")
    lines.extend(_cut_notes(plan))
    for rank in plan.ranks:
        lines.extend(_rank_lines(rank, plan, request, memory))
    return lines


def _token_bytes(plan: MemoryPlan, rank: RankPlan) -> str:
    """Example (DeepSeek-V3 in bfloat16, MLA): 61 layers x 1 KV heads x 576 (one row, no values) x 2 bytes."""
    layout = rank.kv_layout
    item = getattr(torch, plan.dtype).itemsize
    row = f"(key {layout.key_dim} + value {layout.value_dim})" if layout.value_dim else f"{layout.key_dim} (one row)"
    heads = f"{layout.num_kv_heads} KV heads"
    return f"{plan.num_layers} layers x {heads} x {row} x {item} bytes = {rank.kv_token_bytes} bytes"


def _cut_notes(plan: MemoryPlan) -> list[str]:
    if not plan.cuts:
        return []
    weights = {cut.weight for cut in plan.cuts}
    cut = plan.cuts[0]
    what = "rows" if cut.dim == 0 else "columns"
    return [
        f"  note: tp {plan.tp} cuts the quantization blocks or groups of {len(weights)} weights, e.g. rank "
        f"{cut.rank}'s {what} [{cut.start}, {cut.end}) of {cut.weight}, in blocks of {cut.cell}; a rank is counted "
        "with the scales of every block it touches, and the target refuses this tp unless it dequantizes "
        "(--dequantize)"
    ]


def _form(plan: MemoryPlan, dequantize: bool) -> str:
    if plan.quantization is None:
        return "weights"
    return f"weights dequantized to {plan.dtype} (--dequantize)" if dequantize else "weights as stored"


def _rank_lines(rank: RankPlan, plan: MemoryPlan, request: PlanRequest, memory: RankMemory) -> list[str]:
    lines = [f"rank {rank.rank}"]
    if plan.quantization is None:
        budget = kv_budget(rank, memory.bytes, request.block_size, dequantize=False)
        return [
            *lines,
            f"  weights: {_size(budget.weight_bytes)}",
            *_copy_lines(rank.float_copy_bytes),
            f"    KV: {_outcome(budget, plan)}",
        ]
    lines.append(f"  quantized weights as stored, with their scales: {_size(rank.quantized_bytes)}")
    lines.append(f"  float weights in the dtype held: {_size(rank.float_bytes)}")
    for dequantize in (False, True):
        budget = kv_budget(rank, memory.bytes, request.block_size, dequantize)
        chosen = " (planned)" if dequantize == request.dequantize else ""
        lines.append(f"  {_form(plan, dequantize)}: {_size(budget.weight_bytes)}{chosen}")
        lines.extend(_copy_lines(rank.dequantized_copy_bytes if dequantize else rank.float_copy_bytes))
        lines.append(f"    KV: {_outcome(budget, plan)}")
    return lines


def _copy_lines(copy_bytes: int) -> list[str]:
    if not copy_bytes:
        return []
    return [f"    of which oneDNN's copies of the linear weights (float32 on the CPU): {_size(copy_bytes)}"]


def _outcome(budget: KVBudget, plan: MemoryPlan) -> str:
    if not budget.fits:
        return f"does not fit: short by {_size(budget.shortfall)} for the weights and one block"
    sequences = budget.tokens / plan.max_position_embeddings
    return (
        f"{_size(budget.kv_bytes)} left: {budget.tokens} tokens ({budget.blocks} blocks of {budget.block_size}), "
        f"{sequences:.2f} x max_position_embeddings {plan.max_position_embeddings}"
    )


def _size(size: int) -> str:
    return f"{size / 2**30:.2f} GiB ({size} bytes)"
