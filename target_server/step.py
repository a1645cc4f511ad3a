"""One packed forward pass of the target, as every rank runs it, and its wire form between ranks.

Rank 0 plans a step (block tables and slots come from its KV-cache bookkeeping only); with tensor parallelism it
broadcasts the step and every rank runs `run_step` on its own KV-cache shard with the same slots.

Wire form: one int64 tensor, a header of six numbers followed by the fields in a fixed order:
    [num_tokens, batch, num_capture, num_logit_rows, num_pages, page_size, capture (num_capture),
     input_ids (num_tokens), positions (num_tokens), write_slots (num_tokens), logit_rows (num_logit_rows),
     qo_indptr (batch + 1), kv_indptr (batch + 1), kv_page_indices (num_pages), kv_last_page_len (batch),
     has_mask (batch: 1 for a sequence with a custom mask, 2 for one whose mask is its images' spans over a chain),
     the masks of those sequences (query_len ** 2 each, 0/1)]
The page table is tandem.layers.page_table's; every rank plans it with its own cache's attention backend.
Example (page size 4): one sequence with KV for positions 0..4 in pages [2, 3] (slots 8..12) verifying 2 tokens t, d
at positions 5, 6 (slots 13, 14), capture (2,), logits of both rows:
    [2, 1, 1, 2, 2, 4,  2,  t, d,  5, 6,  13, 14,  0, 1,  0, 2,  0, 2,  2, 3,  3,  0]
The same tokens as a tree, d a child of t (parents [-1, 0]), end in has_mask 1 and the mask: [..., 3,  1,  1, 0, 1, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import PagedKVCache
from tandem.layers.page_table import HOST, PageTable
from tandem.models.registry import TargetModel
from tandem.models.stack import Embeddings, TargetOutput

HEADER = 6


@dataclass(frozen=True)
class ForwardStep:
    """Everything a rank needs to run one packed forward pass and its LM head."""

    input_ids: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    capture: tuple[int, ...]  # capture indices, the union over the batch's requests
    logit_rows: torch.Tensor  # [num_rows] rows of the packed batch whose logits are wanted; empty: no LM head
    embeddings: Embeddings | None = None  # rows embedded as given (an image's tokens; sent apart to other ranks)


@torch.inference_mode()
def run_step(
    model: TargetModel, cache: PagedKVCache, step: ForwardStep
) -> tuple[TargetOutput, torch.Tensor]:  # -> output, logits [num_rows, vocab] float32
    """The forward pass and LM head of one step; every rank runs it, so the model's collectives line up."""
    output = model(step.input_ids, step.metadata, cache, step.capture, step.embeddings)
    if step.logit_rows.numel() == 0:
        return output, output.normed.new_empty((0, model.config.vocab_size), dtype=torch.float32)
    return output, model.compute_logits(output.normed[step.logit_rows])


def encode_step(step: ForwardStep) -> torch.Tensor:  # -> [payload] int64 on the CPU; embeddings go apart (ranks)
    table = step.metadata.page_table
    masks = [mask for mask in table.custom_masks if mask is not None]
    header = [len(step.input_ids), table.batch_size, len(step.capture), len(step.logit_rows)]
    header += [len(table.kv_page_indices), table.page_size, *step.capture]
    spanned = table.spanned or (False,) * table.batch_size
    has_mask = [(mask is not None) + span for mask, span in zip(table.custom_masks, spanned, strict=True)]
    parts = [
        torch.tensor(header, dtype=torch.long, device=HOST),
        step.input_ids.cpu(),
        table.positions.cpu(),
        table.write_slots.cpu(),
        step.logit_rows.cpu(),
        table.qo_indptr,
        table.kv_indptr,
        table.kv_page_indices,
        table.kv_last_page_len,
        torch.tensor(has_mask, dtype=torch.long, device=HOST),
        *(mask.flatten().cpu() for mask in masks),
    ]
    return torch.cat([part.long() for part in parts])


def decode_step(payload: torch.Tensor, cache: PagedKVCache) -> ForwardStep:  # payload: [n] int64, from encode_step
    """The step encode_step sent, planned by this rank's cache (its device and attention backend)."""
    num_tokens, batch, num_capture, num_logit_rows, num_pages, page_size = payload[:HEADER].tolist()
    capture = tuple(payload[HEADER : HEADER + num_capture].tolist())
    fields = payload[HEADER + num_capture :]
    sizes = [num_tokens, num_tokens, num_tokens, num_logit_rows, batch + 1, batch + 1, num_pages, batch, batch]
    input_ids, positions, write_slots, logit_rows, qo_indptr, kv_indptr, pages, last_page_len, has_mask, masks = (
        fields.split([*sizes, len(fields) - sum(sizes)])
    )
    query_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    custom_masks: list[torch.Tensor | None] = []
    offset = 0
    flags = has_mask.tolist()
    for query_len, flagged in zip(query_lens, flags, strict=True):
        if not flagged:
            custom_masks.append(None)
            continue
        custom_masks.append(masks[offset : offset + query_len * query_len].view(query_len, query_len).bool())
        offset += query_len * query_len
    device = cache.device
    table = PageTable(
        page_size=page_size,
        qo_indptr=qo_indptr.int(),
        kv_indptr=kv_indptr.int(),
        kv_page_indices=pages.int(),
        kv_last_page_len=last_page_len.int(),
        positions=positions.to(device),
        write_slots=write_slots.to(device),
        custom_masks=tuple(custom_masks),
        spanned=tuple(flag == 2 for flag in flags) if 2 in flags else (),
    )
    metadata = AttentionMetadata.planned(table, cache.backend)
    return ForwardStep(input_ids.to(device), metadata, capture, logit_rows.to(device))
