"""Drafts chosen from logits shaped as the target will shape its rows: a request's penalties, logit_bias and
min_tokens (tandem.sampling.processing) applied to each draft row, with the row's own path of drafts counted.

The target sends a request's options once, on the rows that start it over (HiddenStates.shaping); the replica keeps
the request's committed tokens from its rows (RequestShaping) and hands each proposal a snapshot (Shaping, in
tandem.sampling.processing). A row's logits over the draft's own vocabulary (an EAGLE3 head's may be a subset of the
target's) are placed in the target's columns, processed, and read back, so the draft's choice differs from plain
argmax only where the target's would.

Example: logit_bias {42: 100} makes the target choose 42 at every position; a draft shaped the same way drafts 42,
42, ... and every draft is accepted, where an unshaped draft's choices would all be rejected.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.sampling.params import SamplingParams
from tandem.sampling.processing import Shaping
from tandem.wire import target_pb2
from tandem.wire.sampling import sampling_from_proto

LOG = logging.getLogger(__name__)


@dataclass
class RequestShaping:
    """What a replica keeps of a request with options: the options and the committed tokens its rows brought."""

    sampling: SamplingParams
    prompt_length: int
    tokens: list[int]  # x[0..]: the first token from the options' message, then each row's next token

    def add(self, start_position: int, next_tokens: Sequence[int]) -> bool:
        """Takes rows of positions [start, start + n) (row p brings x[p + 1]); False when they leave a gap (the
        request's tokens are then unknown here)."""
        if start_position + 1 > len(self.tokens):
            return False
        del self.tokens[start_position + 1 :]
        self.tokens.extend(next_tokens)
        return True

    def at(self, end_position: int) -> Shaping:
        """A snapshot up to rows ending at `end_position` (the committed tokens x[0..end_position])."""
        return Shaping(self.sampling, self.prompt_length, tuple(self.tokens[: end_position + 1]))


@dataclass
class Shapings:
    """A replica's requests whose options shape their drafts, each with the committed tokens its rows brought."""

    requests: dict[str, RequestShaping] = field(default_factory=dict)

    def note(self, message: target_pb2.HiddenStates) -> None:
        """Takes the options of rows that start a request over, and the tokens of every row of a shaped request."""
        request_id = message.request_id
        if message.HasField("shaping"):
            options = message.shaping
            known = list(message.prefix_tokens) or [options.first_token]  # x[0 .. start_position], or x[0]
            self.requests[request_id] = RequestShaping(
                sampling_from_proto(options.sampling), options.prompt_length, known
            )
        shaping = self.requests.get(request_id)
        if shaping is not None and not shaping.add(message.start_position, message.next_tokens):
            LOG.warning("request %s: rows at %d leave a gap: drafts unshaped", request_id, message.start_position)
            del self.requests[request_id]

    def at(self, request_id: str, end_position: int) -> Shaping | None:
        """The request's options and tokens up to rows ending at `end_position`; None for an unshaped request."""
        shaping = self.requests.get(request_id)
        return shaping.at(end_position) if shaping is not None else None


def shape_logits(
    logits: torch.Tensor,  # [rows, draft vocab]
    shapings: Sequence[Shaping | None],  # per row: its request's, None for a request without options
    paths: Sequence[Sequence[int]],  # per row: the drafts (target ids) between the committed tokens and its choice
    columns: tuple[torch.Tensor, int] | None = None,  # a draft vocabulary of its own: each column's target id
    # ([draft vocab]) and the target's vocabulary size; None: the columns are the target's ids
) -> torch.Tensor:  # [rows, draft vocab]
    """The logits with each shaped row processed as the target processes it; `logits` itself when no row is."""
    if all(shaping is None for shaping in shapings):
        return logits
    shaped = logits.clone()
    for row, (shaping, path) in enumerate(zip(shapings, paths, strict=True)):
        if shaping is None:
            continue
        if columns is None:
            shaped[row] = shaping.row(logits[row], path)
            continue
        target_ids, target_vocab = columns
        full = logits.new_full((target_vocab,), float("-inf"))  # ids the draft cannot propose stay unchosen
        full[target_ids] = logits[row]
        shaped[row] = shaping.row(full, path)[target_ids]
    return shaped
