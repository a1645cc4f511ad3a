"""Greedy speculative decoding of the trained pair in one process, with the serving runners and no gRPC.

TargetRunner and the draft runners are the classes the servers run (DraftRunner for EAGLE3 heads of either layer
kind, MTPRunner for chained MTP layers); here they are called directly, round by round: draft (propose k tokens from
the rows the target committed), verify (one target pass over k + 1 tokens), commit. The result measures what the
pair is made of: acceptance length and the cost of a draft step and a verify pass.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from draft_server.block_runner import BlockRunner
from draft_server.mtp_runner import MTPRunner
from draft_server.proposals import as_draft_tree
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from tandem.models.aux_layers import resolve_capture
from tandem.models.block_format import BLOCK_ARCHITECTURES, architecture_name
from tandem.models.config import read_hf_config
from tandem.models.dflash2 import load_block_draft
from tandem.models.eagle3 import load_eagle3
from tandem.models.llama import LlamaForCausalLM
from tandem.models.mtp import load_mtp
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.runner import TargetRunner
from training.target import load_llama_target

GREEDY = SamplingParams()


@dataclass(frozen=True)
class AcceptanceReport:
    num_prompts: int
    num_steps: int  # k, draft tokens per round
    mean_acceptance_length: float  # committed tokens per verification round (accepted + 1)
    acceptance_per_position: tuple[float, ...]  # share of rounds whose draft i (0-based) was accepted
    draft_round_ms: float  # median time of one propose call: ingest plus k chain steps
    verify_ms: float  # median time of one target pass over k + 1 tokens
    target_token_ms: float  # median time of one target pass over 1 token (plain decoding)
    matches_target_only: bool  # the speculative output equals plain greedy decoding on every prompt
    projected_speedup: float  # acceptance length * target_token_ms / (draft_round_ms + verify_ms)


class Proposer(Protocol):
    """What the evaluation drives of a draft runner (DraftRunner, MTPRunner, BlockRunner: its drafts are chains)."""

    def propose(self, inputs: Sequence[ProposeInput]) -> Sequence[list[int]] | Sequence[DraftTree]: ...
    def release(self, request_ids: Sequence[str]) -> None: ...


def load_proposer(
    draft_dir: Path, target: LlamaForCausalLM, cache: KVCacheSettings
) -> tuple[Proposer, tuple[int, ...]]:
    """The serving runner for the draft directory and the target capture indices it consumes, filling from the target
    what the checkpoint shares with it (as the draft server does over GetWeights). An MTP checkpoint is told apart
    by its format key, num_nextn_predict_layers (tandem.models.mtp), a block drafter by its architecture name; anything
    else is an EAGLE3 head."""
    hf = read_hf_config(draft_dir)
    tables = {"embed_tokens": target.model.embed_tokens.weight, "lm_head": target.lm_head.weight}
    if architecture_name(hf) in BLOCK_ARCHITECTURES:
        block, missing = load_block_draft(draft_dir)
        for name in missing:
            block.fill_table(name, tables[name].detach())
        return BlockRunner(block, cache), block.config.capture_indices(target.config.num_layers)
    if hf.get("num_nextn_predict_layers"):
        loaded = load_mtp(draft_dir)
        if loaded.model.config.style != "chained":
            raise ValueError(f"{draft_dir}: evaluation runs chained MTP heads, got {loaded.model.config.style!r}")
        for name in loaded.missing_shared:
            loaded.model.fill_shared(name, tables[name].detach())
        return MTPRunner(loaded.model, cache, chain=True), (loaded.model.config.capture_index,)
    draft, has_embedding = load_eagle3(draft_dir)
    if not has_embedding:
        draft.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    capture = resolve_capture(draft.config.aux_layer_ids, target.config.num_layers, draft.config.num_aux).indices
    return DraftRunner(draft, cache), capture


def measure_acceptance(
    target_dir: Path,
    draft_dir: Path,
    prompts: Sequence[Sequence[int]],
    num_steps: int = 5,
    max_new_tokens: int = 128,
) -> AcceptanceReport:
    target = load_llama_target(target_dir)
    cache = KVCacheSettings(num_blocks=256, block_size=16)
    target_runner = TargetRunner(target, cache, max_context=target.config.max_position_embeddings)
    draft_runner, capture = load_proposer(draft_dir, target, cache)
    draft_times: list[float] = []
    verify_times: list[float] = []
    plain_times: list[float] = []
    accepted_counts: list[int] = []
    all_match = True
    for index, prompt in enumerate(tqdm(prompts, desc="acceptance", unit="prompt")):
        request_id = f"prompt-{index}"
        result = target_runner.prefill(request_id, list(prompt), GREEDY, capture)
        generated = list(result.new_tokens)
        captured = result.captured
        while len(generated) < max_new_tokens:
            assert captured is not None
            rows = TargetRows(captured.start_position, captured.next_tokens, captured.features)
            started = time.perf_counter()
            (proposal,) = draft_runner.propose([ProposeInput(request_id, rows, num_steps)])
            draft_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            result = target_runner.verify(request_id, as_draft_tree(proposal).tokens)
            verify_times.append(time.perf_counter() - started)
            accepted_counts.append(result.accepted)
            generated.extend(result.new_tokens)
            captured = result.captured
        target_runner.release([request_id])
        draft_runner.release([request_id])
        plain = _plain_greedy(target_runner, f"plain-{index}", prompt, len(generated), plain_times)
        all_match = all_match and plain == generated
    mean_length = 1.0 + statistics.fmean(accepted_counts)
    per_position = tuple(
        sum(1 for count in accepted_counts if count > position) / len(accepted_counts) for position in range(num_steps)
    )
    draft_ms = 1000 * statistics.median(draft_times)
    verify_ms = 1000 * statistics.median(verify_times)
    token_ms = 1000 * statistics.median(plain_times)
    return AcceptanceReport(
        num_prompts=len(prompts),
        num_steps=num_steps,
        mean_acceptance_length=mean_length,
        acceptance_per_position=per_position,
        draft_round_ms=draft_ms,
        verify_ms=verify_ms,
        target_token_ms=token_ms,
        matches_target_only=all_match,
        projected_speedup=mean_length * token_ms / (draft_ms + verify_ms),
    )


@torch.inference_mode()
def _plain_greedy(
    runner: TargetRunner, request_id: str, prompt: Sequence[int], length: int, times: list[float]
) -> list[int]:
    """Target-only greedy decoding of `length` tokens; appends the time of each single-token pass to times."""
    result = runner.prefill(request_id, list(prompt), GREEDY)
    generated = list(result.new_tokens)
    while len(generated) < length:
        started = time.perf_counter()
        result = runner.verify(request_id)
        times.append(time.perf_counter() - started)
        generated.extend(result.new_tokens)
    runner.release([request_id])
    return generated
