"""What the target does to a request's scored rows before it verifies or samples from them.

Row r of an item's scored rows decides the token after the path to it: nothing for the root's row (the last
committed token), a draft node's path from the root for the others (DraftTree.paths). Each row is processed with its
own path counted as if it were already generated, so a row gives the same distribution whether its path arrived as
drafts or was committed a token at a time: speculation cannot change the output. In order:

1. logit_bias (OpenAI): bias[token] added to the token's logit;
2. repetition_penalty p (transformers' RepetitionPenaltyLogitsProcessor): every token in the prompt, the new tokens
   or the path has its logit divided by p if positive, multiplied by p if not;
3. frequency and presence penalties (OpenAI): logit -= frequency * count + presence * (count > 0), count being the
   token's occurrences among the new tokens and the path;
4. min_tokens: the stop ids get -inf in every row that decides a token before min_tokens;
5. structured output: the tokens a row's grammar state does not allow get -inf (`allowed`, tandem.sampling.grammar).

Example: new tokens [5, 5], a chain of drafts [7, 5], frequency_penalty 0.5: rows 0, 1, 2 see counts of token 5 of 2,
2 and 3, so its logit drops by 1.0, 1.0 and 1.5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.sampling.verify import seeded_scores


def process_rows(
    logits: torch.Tensor,  # [1 + len(tree), vocab], row 0 the root's
    tree: DraftTree,
    params: SamplingParams,
    tokens: Sequence[int],  # the request's committed tokens: prompt, then new ones
    prompt_length: int,
    allowed: torch.Tensor | None = None,  # [1 + len(tree), vocab] bool: each row's grammar mask; None: no grammar
) -> torch.Tensor:  # [1 + len(tree), vocab]
    """The rows as the request's options make them (the module docstring); `logits` itself when none apply."""
    generated = len(tokens) - prompt_length
    stops = params.min_tokens > generated and bool(params.stop_token_ids)
    if not params.processes_rows and not stops and allowed is None:
        return logits
    paths = tree.paths()[: logits.shape[0]]
    rows = logits.clone()
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias], dtype=torch.long, device=rows.device)
        bias = torch.tensor([value for _, value in params.logit_bias], dtype=rows.dtype, device=rows.device)
        rows[:, ids] += bias
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        counts = _path_counts(tokens[prompt_length:], paths, rows.shape[1], rows.device)  # [rows, vocab]
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            seen[:, torch.tensor(list(tokens[:prompt_length]), dtype=torch.long, device=rows.device)] = True
            penalty = params.repetition_penalty
            rows = torch.where(seen, torch.where(rows < 0, rows * penalty, rows / penalty), rows)
        rows -= params.frequency_penalty * counts.to(rows.dtype) + params.presence_penalty * (counts > 0).to(rows.dtype)
    if stops:
        early = torch.tensor([len(path) < params.min_tokens - generated for path in paths], device=rows.device)
        ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=rows.device)
        rows[early.nonzero().flatten().unsqueeze(1), ids] = float("-inf")
    if allowed is not None:
        rows = rows.masked_fill(~allowed[: rows.shape[0]], float("-inf"))
    return rows


def _path_counts(
    new_tokens: Sequence[int], paths: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:  # [len(paths), vocab], int64
    """Each row's occurrences of every token among the new tokens and its path."""
    base = torch.bincount(torch.tensor(list(new_tokens), dtype=torch.long), minlength=vocab)[:vocab]  # [vocab]
    counts = base.to(device).repeat(len(paths), 1)
    for row, path in enumerate(paths):
        if path:
            ids = torch.tensor(list(path), dtype=torch.long, device=device)
            counts[row].index_add_(0, ids, torch.ones_like(ids))
    return counts


@dataclass(frozen=True)
class Shaping:
    """A request's options that change its rows (bias, penalties, min_tokens; no grammar) and its committed tokens at
    one point: what a draft needs to choose its drafts as the target's rows will be shaped."""

    sampling: SamplingParams
    prompt_length: int  # tokens[:prompt_length] are the prompt
    tokens: tuple[int, ...]  # the committed tokens x[0..]

    @classmethod
    def of(cls, sampling: SamplingParams, prompt_length: int, tokens: Sequence[int]) -> Shaping | None:
        """None when the options leave rows as they are (a grammar shapes drafts on the target)."""
        shaped = sampling.processes_rows or (sampling.min_tokens and sampling.stop_token_ids)
        if not shaped and not sampling.is_seeded:
            return None
        return cls(sampling, prompt_length, tuple(tokens))

    def row(self, logits: torch.Tensor, path: Sequence[int]) -> torch.Tensor:  # [vocab] -> [vocab]
        """One row deciding the token after the committed tokens and then `path` (drafts): processed as the target
        processes it, and for a seeded sampled request scored with the noise the target's row will get
        (tandem.sampling.verify.seeded_scores, keyed by the seed and the row's position): its argmax is a sample of
        the draft's distribution that is the target's own choice wherever the two distributions agree."""
        tokens = (*self.tokens, *path)
        processed = process_rows(logits.unsqueeze(0), DraftTree(), self.sampling, tokens, self.prompt_length)
        if self.sampling.is_seeded:
            return seeded_scores(processed, self.sampling, [len(tokens)])[0]
        return processed[0]
