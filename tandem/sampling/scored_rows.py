"""What the target does with a request's scored rows besides verification: min_tokens masking and logprobs.

Row i of the rows an item scores chooses the item's new token i (an accepted draft, then the correction or bonus
token; see tandem.sampling.verify), so row i decides generated token number `generated + i`, where `generated`
counts the request's new tokens before the item.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.sampling.logprobs import TokenLogprob
from tandem.sampling.params import SamplingParams


def mask_stop_tokens(
    logits: torch.Tensor,  # [num_rows, vocab]
    params: SamplingParams,
    generated: int,  # new tokens the request has before row 0 decides the next one
) -> torch.Tensor:  # [num_rows, vocab]
    """The logits with params.stop_token_ids set to -inf in every row that decides a token before min_tokens.

    Example, min_tokens 3 and generated 1: rows 0 and 1 decide tokens 1 and 2 and are masked; row 2 decides token
    3 and is not. Greedy decoding and verification then take the argmax of the masked rows, so a greedy request
    gives the same tokens with and without drafts.
    """
    masked_rows = min(logits.shape[0], params.min_tokens - generated)
    if masked_rows <= 0 or not params.stop_token_ids:
        return logits
    masked = logits.clone()
    ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=logits.device)
    masked[:masked_rows, ids] = float("-inf")
    return masked


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
