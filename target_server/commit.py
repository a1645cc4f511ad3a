"""After a step's forward pass: deciding items in one batch on the device, and what each item hands its draft.

The rows an item captured go to its draft replica as `CapturedRows`: the replayed ones (a replica starting the request
from scratch), then the committed ones, each paired with the token that follows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from tandem.models.stack import TargetOutput
from tandem.sampling.batched import verify_items
from target_server.admission import AdmittedItem
from target_server.items import CapturedRows, StepItem, StepResult


def verify_batched(planned: Sequence[AdmittedItem], logits: torch.Tensor) -> None:  # logits [scored rows, vocab]
    """Decides, in one batch on the logits' device (tandem.sampling.batched), every item that needs no request's own
    generator: greedy ones and sampled ones without a seed. Seeded ones are decided by the runner's commit from
    their seeded scores (tandem.sampling.verify), which are keyed by sequence positions."""
    chosen = [
        entry
        for entry in planned
        if entry.reaches_end
        and entry.item.drafts.is_chain  # trees are verified item by item
        and (entry.request.sampling.is_greedy or entry.request.sampling.seed is None)
    ]
    if not chosen:
        return
    scored = []
    for entry in chosen:
        rows = logits[entry.logit_start : entry.logit_start + 1 + len(entry.item.drafts)]  # [1 + k, vocab]
        scored.append(entry.request.processed(rows, entry.item.drafts))
    drafts = [list(entry.item.drafts.tokens) for entry in chosen]
    outcomes = verify_items(scored, drafts, [entry.request.sampling for entry in chosen])
    for entry, outcome in zip(chosen, outcomes, strict=True):
        entry.outcome = outcome


def captured_rows(
    entry: AdmittedItem, output: TargetOutput, end: int, device: torch.device, rows: Sequence[int] | None = None
) -> CapturedRows | None:
    """Rows of positions [first, end) for the request's draft: the replayed ones, then the committed ones (`rows` of
    the packed batch after a tree; None: the item's first end - start rows)."""
    request = entry.request
    start = entry.start_length
    if request.stream.tokens_only:
        # A token-only draft needs x[0] too: rows from scratch start at position -1, which pairs with x[0].
        first = -1 if start == 0 or entry.item.replay else start
        empty = torch.empty((end - first, 0), device=device)  # [end - first, 0]
        return CapturedRows(request.request_id, first, request.tokens[first + 1 : end + 1], empty)
    if not request.stream.capture:
        return None
    parts: list[slice | torch.Tensor] = [entry.scratch_rows] if entry.scratch is not None else []
    if rows is None:
        parts.append(slice(entry.rows.start, entry.rows.start + end - start))
    else:
        parts.append(torch.tensor(rows, dtype=torch.long, device=device))
    features = torch.cat(
        [torch.cat([output.captured[index][part] for index in request.stream.capture], dim=-1) for part in parts]
    )  # [end - first, len(capture) * hidden]
    first = 0 if entry.scratch is not None else start
    starts_over = entry.scratch is not None or start == entry.reused  # the item began the request's KV
    prefix = tuple(request.tokens[: first + 1]) if request.stream.prefix_caching and starts_over else ()
    return CapturedRows(request.request_id, first, request.tokens[first + 1 : end + 1], features, prefix)


def joined(first: StepResult, then: StepResult) -> StepResult:
    """One result for two consecutive forward passes of a decoding request (no drafts, so nothing accepted)."""
    captured = first.captured
    if captured is not None and then.captured is not None:
        captured = CapturedRows(
            captured.request_id,
            captured.start_position,
            [*captured.next_tokens, *then.captured.next_tokens],
            torch.cat([captured.features, then.captured.features]),  # rows of consecutive positions
            captured.prefix,
        )
    return replace(
        first,
        new_tokens=[*first.new_tokens, *then.new_tokens],
        captured=captured,
        logprobs=[*first.logprobs, *then.logprobs],
    )


def tree_of(item: StepItem) -> list[int]:
    """The parents of an item's new tokens: its committed tokens as a chain, then its draft tree under the last one.

    Example: num_tokens 1 and draft parents [-1, -1, 0] give [-1, 0, 0, 1].
    """
    chain = list(range(-1, item.num_tokens - 1))
    last = item.num_tokens - 1
    return [*chain, *(last if parent < 0 else item.num_tokens + parent for parent in item.drafts.parents)]
