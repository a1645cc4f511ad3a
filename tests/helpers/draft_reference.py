"""Running an EAGLE3 head and a plain-torch reference of it the same way, for tests/unit/test_eagle3.py (Llama
layer) and tests/unit/test_eagle3_mla.py (MLA layer): ingest rows of target features at once, then take single-token
greedy steps, keeping every row's carried hidden and logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.eagle3 import Eagle3Draft

BLOCK_SIZE = 4  # small, so that a run spans several blocks


class ReferenceHead(Protocol):
    """A reference that recomputes every row from scratch (no cache)."""

    def project(self, features: torch.Tensor) -> torch.Tensor: ...  # [rows, num_aux * target_hidden] -> [rows, hidden]

    def rows(
        self,
        token_ids: list[int],  # target ids; row p takes token_ids[p]
        residuals: torch.Tensor,  # [rows, hidden]; row p sits at position p
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # carried hidden [rows, hidden], logits [rows, draft_vocab]

    def to_target_id(self, draft_id: int) -> int: ...


@dataclass(frozen=True)
class DraftRun:
    hidden: torch.Tensor  # [rows, hidden] carried hidden of every row
    logits: torch.Tensor  # [rows, draft_vocab]
    proposed: list[int]  # target ids, one per step


def run_reference(
    reference: ReferenceHead,
    features: torch.Tensor,  # [ingested, num_aux * target_hidden]
    token_ids: list[int],
    num_steps: int,
) -> DraftRun:
    """Ingests rows (features, token_ids), then takes num_steps - 1 single-token steps, recomputing from scratch."""
    residuals = reference.project(features)
    tokens = list(token_ids)
    proposed: list[int] = []
    for _ in range(num_steps):
        hidden, logits = reference.rows(tokens, residuals)
        proposed.append(reference.to_target_id(int(logits[-1].argmax())))
        # The next row: position len(tokens), carried hidden of the last row, the token just proposed.
        residuals = torch.cat([residuals, hidden[-1:]])
        tokens.append(proposed[-1])
    return DraftRun(hidden, logits, proposed)


def run_ours(
    model: Eagle3Draft,
    features: torch.Tensor,  # [ingested, num_aux * target_hidden]
    token_ids: list[int],
    num_steps: int,
) -> DraftRun:
    """The same with our model on a paged cache of its own layout: one multi-token ingest, then single-token steps."""
    layout = model.config.cache_layout
    num_blocks = -(-(len(token_ids) + num_steps) // BLOCK_SIZE)
    cache = PagedKVCache(
        1, num_blocks, BLOCK_SIZE, layout.num_kv_heads, layout.key_dim, torch.float32, value_dim=layout.value_dim
    )
    sequence = SequenceKV()
    hidden_rows, logit_rows, proposed = [], [], []
    with torch.no_grad():
        metadata = cache.plan([(sequence, len(token_ids))])
        step = model(torch.tensor(token_ids), model.project_features(features), metadata, cache)
        for step_index in range(num_steps):
            hidden_rows.append(step.hidden)
            logit_rows.append(step.logits)
            token = model.to_target_ids(step.logits[-1:].argmax(dim=-1))  # [1]
            proposed.append(int(token))
            if step_index + 1 < num_steps:
                step = model(token, step.hidden[-1:], cache.plan([(sequence, 1)]), cache)
    return DraftRun(torch.cat(hidden_rows), torch.cat(logit_rows), proposed)
