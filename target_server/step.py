"""One packed forward pass of the target, as every rank runs it, and its wire form between ranks.

Rank 0 plans a step (block tables and slots come from its KV-cache bookkeeping only); with tensor parallelism it
broadcasts the step and every rank runs `run_step` on its own KV-cache shard with the same slots.

Wire form: one int64 tensor, a header of four counts followed by the fields in a fixed order:
    [num_tokens, num_spans, num_capture, num_logit_rows, capture (num_capture),
     input_ids (num_tokens), positions (num_tokens), write_slots (num_tokens), logit_rows (num_logit_rows),
     (query_start, query_len, context_len) per span, the context_slots of every span one after the other]
Example: one sequence with KV for positions 0..4 (slots 8..12) verifying 2 tokens t, d at positions 5, 6 (slots 13,
14), capture (2,), logits of both rows:
    [2, 1, 1, 2,  2,  t, d,  5, 6,  13, 14,  0, 1,  0, 2, 7,  8, 9, 10, 11, 12, 13, 14]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.kv_cache import AttentionMetadata, PagedKVCache, SequenceSpan
from tandem.models.registry import TargetModel
from tandem.models.stack import TargetOutput

HEADER = 4


@dataclass(frozen=True)
class ForwardStep:
    """Everything a rank needs to run one packed forward pass and its LM head."""

    input_ids: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    capture: tuple[int, ...]  # capture indices, the union over the batch's requests
    logit_rows: torch.Tensor  # [num_rows] rows of the packed batch whose logits are wanted; empty: no LM head


@torch.inference_mode()
def run_step(
    model: TargetModel, cache: PagedKVCache, step: ForwardStep
) -> tuple[TargetOutput, torch.Tensor]:  # -> output, logits [num_rows, vocab] float32
    """The forward pass and LM head of one step; every rank runs it, so the model's collectives line up."""
    output = model(step.input_ids, step.metadata, cache, step.capture)
    if step.logit_rows.numel() == 0:
        return output, output.normed.new_empty((0, model.config.vocab_size), dtype=torch.float32)
    return output, model.compute_logits(output.normed[step.logit_rows])


def encode_step(step: ForwardStep) -> torch.Tensor:  # -> [payload] int64 on the CPU
    metadata = step.metadata
    spans = metadata.spans
    counts = [len(step.input_ids), len(spans), len(step.capture), len(step.logit_rows)]
    span_fields = [value for span in spans for value in (span.query_start, span.query_len, span.context_len)]
    parts = [
        torch.tensor(counts + list(step.capture), dtype=torch.long),
        step.input_ids.cpu(),
        metadata.positions.cpu(),
        metadata.write_slots.cpu(),
        step.logit_rows.cpu(),
        torch.tensor(span_fields, dtype=torch.long),
        *(span.context_slots.cpu() for span in spans),
    ]
    return torch.cat([part.long() for part in parts])


def decode_step(payload: torch.Tensor, device: torch.device) -> ForwardStep:  # payload: [n] int64, from encode_step
    num_tokens, num_spans, num_capture, num_logit_rows = payload[:HEADER].tolist()
    capture = tuple(payload[HEADER : HEADER + num_capture].tolist())
    fields = payload[HEADER + num_capture :]
    sizes = [num_tokens, num_tokens, num_tokens, num_logit_rows, 3 * num_spans]
    input_ids, positions, write_slots, logit_rows, span_fields, slots = fields.split([*sizes, len(fields) - sum(sizes)])
    spans = []
    offset = 0
    for query_start, query_len, context_len in span_fields.view(num_spans, 3).tolist():
        # Context slots stay on the CPU, where PagedKVCache.plan leaves them on rank 0.
        spans.append(SequenceSpan(query_start, query_len, context_len, slots[offset : offset + context_len]))
        offset += context_len
    metadata = AttentionMetadata(tuple(spans), write_slots.to(device), positions.to(device))
    return ForwardStep(input_ids.to(device), metadata, capture, logit_rows.to(device))
