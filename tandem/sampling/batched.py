"""Verification of a whole step's items at once, on the device that holds the logits (tandem.sampling.verify's terms).

The per-item rules of tandem.sampling.verify draw from each request's own CPU generator, or for a seed from noise
keyed by (seed, position); that is what the CPU runs, and what seeded requests run everywhere. On a GPU the other items
of a step (greedy ones, and sampled ones without a seed) go through `verify_batch` instead: their logits stay where
the LM head left them and only the accepted counts and the next tokens come back to the host, [items] each.

Packing: item i scores num_drafts[i] + 1 consecutive rows of `logits`, items in order. Example, drafts [[5, 7], [],
[9]]: rows 0..2 are item 0's, row 3 item 1's, rows 4..5 item 2's; padded to [items, max_k + 1] row indices
[[0, 1, 2], [3, 3, 3], [4, 5, 4]] (a padding slot repeats the item's first row and is never read as a draft's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sampling.params import SamplingParams
from tandem.sampling.verify import VerifyOutcome


@dataclass(frozen=True)
class BatchSampling:
    """Each item's sampling parameters as tensors on the logits' device."""

    temperature: torch.Tensor  # [items] float32; 0: greedy
    top_k: torch.Tensor  # [items] int64; 0: off
    top_p: torch.Tensor  # [items] float32; 1: off

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device) -> BatchSampling:
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        )


@dataclass(frozen=True)
class BatchedVerify:
    accepted: torch.Tensor  # [items] int64, draft tokens accepted
    next_tokens: torch.Tensor  # [items] int64, the correction or bonus token after them


def batch_target_probs(
    logits: torch.Tensor,  # [items, rows, vocab]
    sampling: BatchSampling,
) -> torch.Tensor:  # [items, rows, vocab] float32, what tandem.sampling.verify.target_probs gives each item's rows
    """Temperature, top_k, top_p (in that order) with each item's own parameters; greedy items give one-hot rows."""
    logits = logits.float()
    items, rows, vocab_size = logits.shape
    greedy = sampling.temperature == 0  # [items]
    temperature = torch.where(greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None, None]
    uses_top_k = (sampling.top_k > 0) & (sampling.top_k < vocab_size)  # [items]
    kth_index = (sampling.top_k.clamp(min=1, max=vocab_size) - 1)[:, None, None].expand(items, rows, 1)
    kth_largest = scaled.sort(dim=-1, descending=True).values.gather(-1, kth_index)  # [items, rows, 1]
    # As in target_probs, tokens tied with the k-th largest logit all stay.
    scaled = scaled.masked_fill(uses_top_k[:, None, None] & (scaled < kth_largest), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, sorted_tokens = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # see tandem.sampling.verify._keep_top_p
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(
        -1, sorted_tokens, mass_above < sampling.top_p[:, None, None]
    )
    nucleus = probs.masked_fill(~keep, 0.0)
    nucleus = nucleus / nucleus.sum(dim=-1, keepdim=True)
    probs = torch.where((sampling.top_p < 1.0)[:, None, None], nucleus, probs)
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab_size).float()
    return torch.where(greedy[:, None, None], one_hot, probs)


def verify_batch(
    logits: torch.Tensor,  # [rows, vocab], item i's num_drafts[i] + 1 rows in a row, items in order
    draft_ids: torch.Tensor,  # [items, max_k] int64; entries past num_drafts[i] are ignored
    num_drafts: torch.Tensor,  # [items] int64
    sampling: BatchSampling,
    generator: torch.Generator | None = None,  # on the logits' device; None: its default generator
) -> BatchedVerify:
    """The lossless rule for deterministic drafts (q one-hot), every item at once: accept draft x with probability
    p(x), on the first rejection sample p with x removed, after all k the bonus from row k. Greedy items accept while
    the draft equals the row's argmax and end with the argmax, as verify_greedy does."""
    device = logits.device
    items, max_k = draft_ids.shape
    width = max_k + 1
    row_counts = num_drafts + 1
    starts = row_counts.cumsum(0) - row_counts  # [items]
    slot = torch.arange(width, device=device)  # [width]
    real_row = slot[None, :] < row_counts[:, None]  # [items, width]
    row_index = torch.where(real_row, starts[:, None] + slot[None, :], starts[:, None])  # see the module docstring
    padded = logits[row_index]  # [items, width, vocab]
    real_draft = slot[None, :max_k] < num_drafts[:, None]  # [items, max_k]
    drafts = torch.where(real_draft, draft_ids, torch.zeros_like(draft_ids))

    greedy = sampling.temperature == 0  # [items]
    choices = padded.argmax(dim=-1)  # [items, width]
    probs = batch_target_probs(padded, sampling)  # [items, width, vocab]
    draft_mass = probs[:, :max_k].gather(-1, drafts[..., None]).squeeze(-1)  # [items, max_k], p(x_i)
    uniforms = torch.rand((items, max_k), generator=generator, device=device)
    accepts = torch.where(greedy[:, None], drafts == choices[:, :max_k], uniforms < draft_mass) & real_draft
    accepted = accepts.long().cumprod(dim=1).sum(dim=1)  # [items]: the leading run, as in verify_sampled

    items_index = torch.arange(items, device=device)
    next_probs = probs[items_index, accepted]  # [items, vocab], row `accepted`
    rejected = accepted < num_drafts  # [items]
    if max_k > 0:
        rejected_token = drafts[items_index, accepted.clamp(max=max_k - 1)]  # [items]
        residual = next_probs.scatter(-1, rejected_token[:, None], 0.0)
        total = residual.sum(dim=-1, keepdim=True)
        # A residual of zero mass has probability 0 (see _residual_probs): p itself is the fallback.
        residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(total.dtype).tiny), next_probs)
        next_probs = torch.where(rejected[:, None], residual, next_probs)
    sampled = torch.multinomial(next_probs, 1, generator=generator).squeeze(1)  # [items]
    next_tokens = torch.where(greedy, choices[items_index, accepted], sampled)
    return BatchedVerify(accepted, next_tokens)


def verify_items(
    scored: Sequence[torch.Tensor],  # per item [k_i + 1, vocab], all on one device
    drafts: Sequence[Sequence[int]],  # per item [k_i]
    params: Sequence[SamplingParams],
    generator: torch.Generator | None = None,
) -> list[VerifyOutcome]:
    """verify_batch over per-item rows; the only host transfer is its [items] results."""
    device = scored[0].device
    max_k = max(len(tokens) for tokens in drafts)
    padded = [[*tokens, *[0] * (max_k - len(tokens))] for tokens in drafts]
    result = verify_batch(
        torch.cat(list(scored)),
        torch.tensor(padded, dtype=torch.long, device=device).reshape(len(drafts), max_k),
        torch.tensor([len(tokens) for tokens in drafts], dtype=torch.long, device=device),
        BatchSampling.of(params, device),
        generator,
    )
    accepted, next_tokens = torch.stack((result.accepted, result.next_tokens)).tolist()
    return [
        VerifyOutcome(count, [*map(int, tokens[:count]), token])
        for tokens, count, token in zip(drafts, accepted, next_tokens, strict=True)
    ]
