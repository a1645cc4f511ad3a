"""The logprobs of a request's scored rows (their processing before verification: tandem.sampling.processing).

Row i of the rows an item scores chooses the item's new token i (an accepted draft, then the correction or bonus
token; see tandem.sampling.verify), so row i decides generated token number `generated + i`, where `generated`
counts the request's new tokens before the item.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.sampling.logprobs import TokenLogprob


def token_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab], raw (before any processing); rows >= len(tokens)
    tokens: Sequence[int],  # [num_tokens], token i chosen by row i
    top: int,  # how many most likely tokens to report per row
) -> list[TokenLogprob]:
    """Each token's log probability under the raw distribution of its row, with the row's `top` best tokens."""
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [num_tokens, vocab]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=rows.device)
    chosen = rows.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()  # [num_tokens]
    best_values, best_ids = rows.topk(top, dim=-1) if top > 0 else (rows[:, :0], rows[:, :0].long())
    result = []
    for index, token in enumerate(tokens):
        pairs = tuple(zip(best_ids[index].tolist(), best_values[index].tolist(), strict=True))
        result.append(TokenLogprob(int(token), float(chosen[index]), pairs))
    return result
